#!/usr/bin/env bash
# `moekit simulate` end to end: the table, --json against closed forms computed here, E and k
# from a model spec (embedded and a custom file), --save-trace read back, determinism, a clean
# --json stdout, and every bad flag: a non-zero exit and an error naming the value.
# Usage: bash tests/cli/simulate.sh <path-to-moekit> <source-dir>
set -u
source "$(dirname "$0")/lib.bash"

# --- uniform routing against the closed forms, the EP4 case (E = 256, k = 8, B = 64) ---
run_ok "uniform json" "$tmp/u.json" simulate --experts 256 --topk 8 --ranks 4 --batch 64 --trials 2000 --seed 5 --json
# coverage 1 − (1 − 8/256)^64; CV_e sqrt((1 − 1/32)/2) — both exact for uniform top-k; distinct
# ranks: the closed form's 3.60 = 4(1 − (3/4)^8) (docs/theory.md §All-to-all bytes) assumes picks
# with replacement, the exact value for 8 distinct experts is 4[1 − Π_{i<8} (192 − i)/(256 − i)] =
# 3.6142.
json_code "uniform: simulated within 4.5 s.e. of the exact forms" "$tmp/u.json" "
def z(m, v): return abs(m['simulated'] - v) / m['std_error']
none = math.prod((192 - i) / (256 - i) for i in range(8))
ok = (z(j['coverage'], 1 - (31/32)**64) < 4.5 and z(j['cv_expert'], math.sqrt((1 - 1/32) / 2)) < 4.5 and
      z(j['dedup_targets'], 4 * (1 - none)) < 4.5 and abs(j['dedup_targets']['closed_form'] - 3.5995) < 1e-4 and
      abs(j['dedup_targets']['reference'] - 4 * (1 - none)) < 1e-12)"
json_check "uniform: keys and gaps" "$tmp/u.json" \
  "all(k in j[m] for m in ('coverage', 'dedup_targets', 's0', 'cv_expert') for k in ('simulated', 'std_error', 'closed_form', 'gap', 'gap_in_se', 'closed_form_assumes')) and abs(j['s0']['gap'] - (j['s0']['simulated'] - j['s0']['closed_form'])) < 1e-12"
run_ok "uniform table" "$tmp/u.txt" simulate --experts 256 --topk 8 --ranks 4 --batch 64 --trials 200
grep -qF "closed forms (docs/theory.md, uniform routing)" "$tmp/u.txt" && grep -q "S0 = max/mean GPU load" "$tmp/u.txt" &&
  pass "table has the closed forms and where they are derived" ||
  { fail "table has the closed forms and where they are derived"; cat "$tmp/u.txt"; }

# --- determinism: same seed, same output, whatever the threads ---
run_ok "seed 5, 1 thread" "$tmp/t1.json" simulate --experts 256 --topk 8 --ranks 4 --batch 64 --trials 2000 --seed 5 --threads 1 --json
if cmp -s "$tmp/u.json" "$tmp/t1.json"; then pass "same seed, same JSON, any thread count"; else fail "same seed, same JSON, any thread count"; fi

# --- E and k from a model spec; a skewed routing ---
run_ok "model deepseek-v3, hot experts" "$tmp/h.json" simulate --model deepseek-v3 --ranks 8 --batch 1024 --trials 100 --routing hot:8:4 --json
# GPU 0 holds the 8 hot experts: about (8·4 + 24)/(280/8) = 1.6 with independent picks, a little lower for distinct ones.
json_check "hot experts: S0 near 1.6, no uniform reference" "$tmp/h.json" \
  "j['experts'] == 256 and j['topk'] == 8 and j['routing'] == 'hot:8:4' and 1.5 < j['s0']['simulated'] < 1.6 and j['s0']['reference'] is None"
cat > "$tmp/toy.json" << 'J'
{"name": "toy", "hidden_size": 64, "num_layers": 2, "num_moe_layers": 2, "moe_intermediate_size": 32,
 "num_routed_experts": 16, "num_experts_per_token": 2, "num_shared_experts": 0, "shared_intermediate_size": 0,
 "total_params": 1e6, "active_params": 1e5, "weight_bytes_per_param": 1, "kv_bytes_per_token": 256,
 "router": {"scoring": "softmax", "num_groups": 1, "topk_groups": 1, "routed_scaling_factor": 1.0, "normalize_topk": true}}
J
run_ok "custom model file" "$tmp/toy-out.json" simulate --model "$tmp/toy.json" --ranks 4 --batch 8 --trials 500 --routing zipf:1 --json
json_check "custom model: E and k from the file" "$tmp/toy-out.json" "j['experts'] == 16 and j['topk'] == 2 and j['routing'] == 'zipf:1'"

# --- --save-trace: the trace format, read back ---
run_ok "save trace" "$tmp/s.json" simulate --experts 64 --topk 6 --ranks 8 --batch 16 --trials 5 --layers 2 --steps 3 --save-trace "$tmp/trace.json" --json
json_code "trace: shape, distinct in-range ids" "$tmp/trace.json" "
L = j['layers']
ok = (j['format'] == 'moekit-trace' and j['num_experts'] == 64 and j['topk'] == 6 and j['num_ranks'] == 8 and
      len(L) == 2 and all(len(s) == 3 for s in L) and all(len(step) == 16 for s in L for step in s) and
      all(len(set(tok)) == 6 and all(0 <= e < 64 for e in tok) for s in L for step in s for tok in step))"
json_check "trace: stdout JSON stays clean" "$tmp/s.json" "j['trials'] == 5"
run_ok "trace with steps = trials" "$tmp/s1.json" simulate --experts 64 --topk 6 --ranks 8 --batch 16 --trials 40 --save-trace "$tmp/trace1.json" --json
# One layer and steps = trials: the trace holds the very samples of the statistics.
python3 - "$tmp/trace1.json" "$tmp/s1.json" << 'P' && pass "trace samples are the statistics' samples" || fail "trace samples are the statistics' samples"
import json, sys
t = json.load(open(sys.argv[1])); s = json.load(open(sys.argv[2]))
cov = sum(len({e for tok in step for e in tok}) / 64 for step in t['layers'][0]) / len(t['layers'][0])
sys.exit(0 if len(t['layers'][0]) == 40 and abs(cov - s['coverage']['simulated']) < 1e-12 else 1)
P

# --- bad flags ---
expect_error "ranks not dividing E" "--ranks = 3 must divide E = 256" simulate --ranks 3
expect_error "ranks 0" "--ranks = 0 must be >= 1" simulate --ranks 0
expect_error "topk 0" "--topk = 0 must be in [1, E = 8]" simulate --experts 8 --topk 0
expect_error "topk > E" "--topk = 9 must be in [1, E = 8]" simulate --experts 8 --topk 9
expect_error "batch 0" "--batch = 0 must be >= 1" simulate --batch 0
expect_error "trials 1" "--trials = 1 must be >= 2" simulate --trials 1
expect_error "unknown routing" "--routing 'gauss' is unknown: expected uniform, zipf:S or hot:H:R" simulate --routing gauss
expect_error "hot H > E" "H = 300 hot experts exceeds E = 256" simulate --routing hot:300:2
expect_error "hot R 0" "must be > 0" simulate --routing hot:4:0
expect_error "zipf negative" "the exponent S must be >= 0" simulate --routing zipf:-1
expect_error "dense model" "is dense" simulate --model llama-3-70b
expect_error "experts without topk" "--experts needs --topk" simulate --experts 64
expect_error "topk without experts" "--topk needs --experts" simulate --topk 4
expect_error "unknown model" "unknown model 'nope'" simulate --model nope
expect_error "trace batch not a multiple of ranks" "--batch = 12 must be a multiple of --ranks = 8" simulate --batch 12 --trials 4 --save-trace "$tmp/x.json"
expect_error "trace folder missing" "does not exist" simulate --trials 4 --save-trace "$tmp/no/such/dir/x.json"
expect_error "steps without trace" "--steps goes with --save-trace" simulate --steps 3
expect_error "layers 0" "--layers = 0 must be >= 1" simulate --batch 16 --trials 4 --layers 0 --save-trace "$tmp/x.json"
[ ! -e "$tmp/x.json" ] && pass "failed runs write no trace" || fail "failed runs write no trace"

finish "simulate CLI"
