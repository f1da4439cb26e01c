#!/usr/bin/env bash
# `moekit run --backend cpu` end to end: the default model runs; the JSON figures hold the
# protocol's invariants (every token-expert pair received once, one message per distinct target,
# message and combine bytes by their formulas); the output matches the float64 oracle; bad input
# exits 2 with an error naming the value.
# Usage: bash tests/cli/run.sh <path-to-moekit> <source-dir>
set -u
source "$(dirname "$0")/lib.bash"

# json_check NAME FILE PYTHON-EXPRESSION over j
json_check() {
  if python3 -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($3) else 1)" "$2"; then pass "$1"
  else fail "$1"; python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1])))[:600])" "$2"; fi
}

expect_error() {
  local name=$1 fragment=$2
  shift 2
  "$MOEKIT" run "$@" > "$tmp/stdout" 2> "$tmp/stderr"
  local rc=$?
  if [ $rc -ne 2 ]; then fail "$name: exit $rc, expected 2"; cat "$tmp/stderr"; return; fi
  if ! grep -qF -- "$fragment" "$tmp/stderr"; then fail "$name: stderr lacks '$fragment'"; cat "$tmp/stderr"; return; fi
  pass "$name"
}

# A small model so each run takes well under a second: d = 256, 16 experts, top-4, one shared (tests/cli/data/small-moe.json).
cp "$2/tests/cli/data/small-moe.json" "$tmp/small.json"

# The default (tiny-moe, EP 4, batch 64) prints every section.
if "$MOEKIT" run > "$tmp/default.txt" 2> "$tmp/stderr"; then
  missing=""
  for s in gate dispatch gemm1 activation gemm2 combine shared_expert "recv_count (masked_m)" \
           "distinct target ranks per token: measured" "P[1-(1-1/P)^k]" "max/mean"; do
    grep -qF -- "$s" "$tmp/default.txt" || missing="$missing '$s'"
  done
  if [ -z "$missing" ]; then pass "default run prints every section"; else fail "default run lacks$missing"; fi
else
  fail "default run: exit $?"; cat "$tmp/stderr"
fi

# Invariants on the JSON, both protocols, with and without redundant experts, 2 layers.
# message_bytes = align16(d + 4 d/128 + 4 + 8 k) = align16(256 + 8 + 4 + 32) = 304; combine 2 d = 512.
for proto in low-latency normal; do
  for extra in "" "--redundant 8 --routing hot:2:6"; do
    name="$proto${extra:+ $extra}"
    # shellcheck disable=SC2086
    if "$MOEKIT" run --model "$tmp/small.json" --ep 4 --batch 30 --layers 2 --protocol $proto $extra --check --json \
        > "$tmp/run.json" 2> "$tmp/stderr"; then
      json_check "$name: every token on one rank once" "$tmp/run.json" "sum(r['tokens'] for r in j['ranks']) == 30 * 2"
      json_check "$name: every token-expert pair received once" "$tmp/run.json" \
        "sum(r['recv_rows'] for r in j['ranks']) == 30 * 4 * 2 and j['recv_count']['mean'] * j['recv_count']['experts'] == 30 * 4 * 2"
      json_check "$name: dispatch bytes = messages x 304" "$tmp/run.json" \
        "all(r['dispatch_bytes'] == 304 * r['dispatch_messages'] for r in j['ranks'])"
      json_check "$name: one combine vector per message" "$tmp/run.json" \
        "sum(r['combine_bytes'] for r in j['ranks']) == 512 * sum(r['dispatch_messages'] for r in j['ranks'])"
      json_check "$name: distinct targets between 1 and min(k, P)" "$tmp/run.json" \
        "1 <= j['dedup_targets']['measured'] <= 4 and abs(j['dedup_targets']['closed_form'] - 4 * (1 - 0.75 ** 4)) < 1e-12"
      json_check "$name: output within 3e-3 of the float64 oracle" "$tmp/run.json" \
        "all(0 < e <= 3e-3 for e in j['error_vs_oracle'])"
    else
      fail "$name: exit $?"; cat "$tmp/stderr"
    fi
  done
done

# Skew shows and EPLB's redundant experts reduce it.
"$MOEKIT" run --model "$tmp/small.json" --ep 4 --batch 64 --routing hot:2:8 --json > "$tmp/hot.json" 2> /dev/null
"$MOEKIT" run --model "$tmp/small.json" --ep 4 --batch 64 --routing hot:2:8 --redundant 8 --json > "$tmp/eplb.json" 2> /dev/null
if python3 -c "
import json,sys
a = json.load(open(sys.argv[1]))['load_max_over_mean'][0]; b = json.load(open(sys.argv[2]))['load_max_over_mean'][0]
sys.exit(0 if a > 1.5 and b < a else 1)" "$tmp/hot.json" "$tmp/eplb.json"; then pass "hot routing skews the load, redundant experts reduce it"
else fail "hot routing skew / EPLB"; fi

# Without CUDA in the binary, or without a GPU on the machine (CI), --backend cuda says so.
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi > /dev/null 2>&1; then
  expect_error "cuda backend unavailable" "--backend cuda:" --backend cuda --model "$tmp/small.json"
fi
expect_error "unknown backend" "--backend 'tpu'" --backend tpu
expect_error "P not dividing E" "--ep 3" --model "$tmp/small.json" --ep 3
expect_error "batch 0" "--batch 0" --model "$tmp/small.json" --batch 0
expect_error "too many layers" "--layers 3" --model "$tmp/small.json" --layers 3
expect_error "bad routing" "zipf:x" --model "$tmp/small.json" --routing zipf:x
expect_error "bad protocol" "--protocol 'fast'" --model "$tmp/small.json" --protocol fast
expect_error "redundant not fitting" "--redundant 3" --model "$tmp/small.json" --ep 4 --redundant 3
expect_error "missing checkpoint" "$tmp/nowhere" --model "$tmp/small.json" --weights "$tmp/nowhere"
# Random weights kept with --save-weights load back with --weights; a checkpoint of another
# shape or a truncated shard is an error naming the tensor or the file.
if "$MOEKIT" run --model "$tmp/small.json" --ep 2 --batch 8 --save-weights "$tmp/ckpt" --json > "$tmp/a.json" 2> "$tmp/stderr" &&
   "$MOEKIT" run --model "$tmp/small.json" --ep 2 --batch 8 --weights "$tmp/ckpt" --json > "$tmp/b.json" 2>> "$tmp/stderr"; then
  json_check "saved weights load back to the same step" "$tmp/b.json" \
    "[r['recv_rows'] for r in j['ranks']] == [r['recv_rows'] for r in json.load(open('$tmp/a.json'))['ranks']] and j['weights'] == '$tmp/ckpt'"
else
  fail "--save-weights / --weights: exit $?"; cat "$tmp/stderr"
fi
sed 's/"moe_intermediate_size": 128/"moe_intermediate_size": 256/' "$tmp/small.json" > "$tmp/wider.json"
expect_error "checkpoint of another shape" "gate_proj" --model "$tmp/wider.json" --weights "$tmp/ckpt"
shard=$(ls "$tmp"/ckpt/*.safetensors | head -1)
truncate -s -64 "$shard"
expect_error "truncated shard" "$(basename "$shard")" --model "$tmp/small.json" --weights "$tmp/ckpt"

# gpt-oss-style MXFP4 experts with biases, hidden 160 and inter 96 (padded to 256 and 128 at load
# time): both protocols, with and without redundant experts, within 2^-8 of the float64 oracle.
# Messages carry the padded row: align16(256 + 4 * 2 + 4 + 8 * 4) = 304 B; combine vectors 2 * 256.
cat > "$tmp/oss.json" << 'J'
{"name": "small-oss", "hidden_size": 160, "num_layers": 2, "num_moe_layers": 2,
 "moe_intermediate_size": 96, "num_routed_experts": 16, "num_experts_per_token": 4,
 "num_shared_experts": 0, "shared_intermediate_size": 0,
 "total_params": 1e7, "active_params": 1e6, "weight_bytes_per_param": 0.53, "kv_bytes_per_token": 1024,
 "router": {"scoring": "topk_softmax", "num_groups": 1, "topk_groups": 1, "routed_scaling_factor": 1.0,
            "normalize_topk": true, "logit_bias": true},
 "expert_format": "mxfp4", "activation": {"kind": "clamped_swiglu", "alpha": 1.702, "limit": 1.0}, "expert_bias": true}
J
for proto in low-latency normal; do
  for extra in "" "--redundant 8 --routing hot:2:6"; do
    name="gpt-oss-style $proto${extra:+ $extra}"
    # shellcheck disable=SC2086
    if "$MOEKIT" run --model "$tmp/oss.json" --ep 4 --batch 30 --layers 2 --protocol $proto $extra --check --json \
        > "$tmp/oss-run.json" 2> "$tmp/stderr"; then
      json_check "$name: every token-expert pair received once" "$tmp/oss-run.json" \
        "sum(r['recv_rows'] for r in j['ranks']) == 30 * 4 * 2"
      json_check "$name: dispatch bytes = messages x 304, combine 512 per message" "$tmp/oss-run.json" \
        "all(r['dispatch_bytes'] == 304 * r['dispatch_messages'] for r in j['ranks']) and sum(r['combine_bytes'] for r in j['ranks']) == 512 * sum(r['dispatch_messages'] for r in j['ranks'])"
      json_check "$name: output within 2^-8 of the float64 oracle" "$tmp/oss-run.json" \
        "all(0 < e <= 2 ** -8 for e in j['error_vs_oracle'])"
    else
      fail "$name: exit $?"; cat "$tmp/stderr"
    fi
  done
done
if "$MOEKIT" run --model "$tmp/oss.json" --ep 2 --batch 8 --check > "$tmp/oss.txt" 2> "$tmp/stderr"; then
  if grep -qF "routing: the model's router (topk_softmax, top-4)" "$tmp/oss.txt" && grep -qF "(bound 0.00391: 2^-8" "$tmp/oss.txt"; then
    pass "gpt-oss-style table names the router and the bound"
  else
    fail "gpt-oss-style table"; cat "$tmp/oss.txt"
  fi
else
  fail "gpt-oss-style run: exit $?"; cat "$tmp/stderr"
fi
# MXFP4 experts move no weights while serving: --rebalance is refused before anything is written.
expect_error "gpt-oss-style --rebalance refused" "its experts are MXFP4" --model "$tmp/oss.json" --ep 4 \
  --redundant 4 --rebalance --steps 4
# A subset of its experts cannot be generated (one tensor holds them all); the shard refuses a NaN scale.
"$MOEKIT" run --model "$tmp/oss.json" --ep 2 --batch 8 --save-weights "$tmp/oss-ckpt" > /dev/null 2>&1
python3 - "$tmp/oss-ckpt" << 'P'
import json, os, struct, sys
d = sys.argv[1]
name = "model.layers.0.mlp.experts.down_proj_scales"
f = os.path.join(d, json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"][name])
with open(f, "r+b") as fh:
    n = struct.unpack("<Q", fh.read(8))[0]
    begin = json.loads(fh.read(n))[name]["data_offsets"][0]
    fh.seek(8 + n + begin + 3)
    fh.write(b"\xff")
P
expect_error "NaN scale byte" "down_proj_scales" --model "$tmp/oss.json" --weights "$tmp/oss-ckpt"
expect_error "NaN scale byte named" "expert 0 row 1 block 0 holds the e8m0 byte 255" --model "$tmp/oss.json" --weights "$tmp/oss-ckpt"
# --check names its bound and the section of the project's docs that derives it.
"$MOEKIT" run --model "$tmp/small.json" --ep 2 --batch 8 --check > "$tmp/check.txt" 2> "$tmp/stderr"
grep -qF "(bound 0.003: docs/design.md §Numerics and their bounds)" "$tmp/check.txt" &&
  pass "--check cites its bound's section" || { fail "--check cites its bound's section"; cat "$tmp/check.txt" "$tmp/stderr"; }

# The options of one mode are refused without it, rather than read and ignored.
expect_error "--window without --rebalance" "--window requires --rebalance" --model tiny-moe --window 0
expect_error "--copy-gbps without --rebalance" "--copy-gbps requires --rebalance" --model tiny-moe --copy-gbps -5
expect_error "--save-weights with --weights" "excludes --save-weights" --model tiny-moe --weights "$tmp" --save-weights "$tmp/x"

finish "run CLI"
