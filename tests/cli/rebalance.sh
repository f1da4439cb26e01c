#!/usr/bin/env bash
# `moekit simulate --routing drift:H:R:PERIOD --save-trace` and `moekit run --rebalance` end to
# end on the CPU backend: the trace's hot block moves every PERIOD steps; the loop rebalances
# after the drift and the imbalance drops; every decision moves the fewest-moves placement's
# replicas, never more than a fresh one; the output stays within the oracle's bound through the
# moves (--check); --lag makes runs reproducible; scripts/plot-rebalance draws the JSON without
# letting any of its text into gnuplot; bad input exits 2 naming the value.
# Usage: bash tests/cli/rebalance.sh <path-to-moekit> <source-dir>
set -u
source "$(dirname "$0")/lib.bash"
SRC=$2

# d = 256, 16 experts, top-4: each step well under a second on the CPU (tests/cli/data/small-moe.json).
cp "$2/tests/cli/data/small-moe.json" "$tmp/small.json"

# --- the drifting trace: hot experts (s // 15) * 2 + {0, 1} mod 16 at step s ---
run_ok "simulate drift trace" "$tmp/sim.json" simulate --model "$tmp/small.json" --ranks 4 --batch 128 --trials 2 \
  --layers 2 --steps 45 --routing drift:2:6:15 --save-trace "$tmp/drift.json" --json
json_code "trace: every step's two busiest experts are the phase's hot block" "$tmp/drift.json" "
from collections import Counter
ok = j['num_experts'] == 16 and len(j['layers']) == 2 and all(len(l) == 45 for l in j['layers'])
for layer in j['layers']:
    for s, step in enumerate(layer):
        top = {e for e, _ in Counter(e for tok in step for e in tok).most_common(2)}
        ok = ok and top == {(s // 15) * 2 % 16, (s // 15) * 2 % 16 + 1}"

# --- the loop over it, reproducible (--lag 1), output checked against the oracle every step ---
run_ok "run --rebalance --json" "$tmp/run.json" run --model "$tmp/small.json" --ep 4 --layers 2 --redundant 4 \
  --rebalance --trace "$tmp/drift.json" --window 5 --interval 5 --lag 1 --check --json
json_check "one row per step, every step within the oracle's bound" "$tmp/run.json" \
  "len(j['steps']) == 45 and j['steps_run'] == 45 and all(0 < e <= 3e-3 for s in j['steps'] for e in s['error_vs_oracle'])"
json_code "a rebalance follows each drift and the imbalance drops after it" "$tmp/run.json" "
st = j['steps']
sw = j['switched_steps']
ok = len(sw) >= 2 and all(s['switched'] == (s['step'] in sw) for s in st)
for drift in (15, 30):
    after = [s for s in sw if drift <= s < drift + 15]
    ok = ok and len(after) >= 1
    if after:
        before = [s['max_over_mean'] for s in st if drift <= s['step'] <= after[0]]
        settled = [s['max_over_mean'] for s in st if after[0] < s['step'] < drift + 15]
        ok = ok and len(settled) >= 2 and sum(settled) / len(settled) < sum(before) / len(before) - 0.1"
json_code "decisions: fewest moves, never more than fresh, bytes = moves x expert bytes" "$tmp/run.json" "
d = j['decisions']
eb = j['config']['expert_bytes']
reb = [x for x in d if x['verdict'] == 'rebalance']
ok = (eb == 3 * 256 * 128 + 3 * 2 * 1 * 4 and len(reb) == len(j['switched_steps']) and
      all(0 < x['replicas_moved'] <= x['fresh_replicas_moved'] for x in reb) and
      all(x['bytes_moved'] == x['replicas_moved'] * eb for x in reb) and
      all(x['ready_step'] == x['started_step'] + 1 for x in d) and
      all(x['end_to_end'] >= 1.02 for x in reb) and
      all(x['end_to_end'] < 1.02 for x in d if x['verdict'] == 'gain too small') and
      sum(x['replicas_moved'] for x in reb) == j['summary']['replicas_moved'] and
      sum(s['bytes_copied'] for s in j['steps']) == j['summary']['bytes_moved'] and
      j['summary']['replicas_moved'] * 2 < j['summary']['fresh_replicas_moved'])"
run_ok "same run again" "$tmp/run2.json" run --model "$tmp/small.json" --ep 4 --layers 2 --redundant 4 \
  --rebalance --trace "$tmp/drift.json" --window 5 --interval 5 --lag 1 --json
json_code "--lag 1: the same decisions and rows on a second run" "$tmp/run2.json" "
a = json.load(open('$tmp/run.json'))
strip = lambda d: {k: v for k, v in d.items() if k not in ('compute_s', 'mean_step_s', 'gain_per_step_s')}
ok = ([strip(x) for x in a['decisions']] == [strip(x) for x in j['decisions']] and
      [s['max_over_mean_layers'] for s in a['steps']] == [s['max_over_mean_layers'] for s in j['steps']])"

# Priced moves: copies at 1 kB/s never pay back, so nothing moves.
run_ok "run --rebalance, slow copies" "$tmp/slow.json" run --model "$tmp/small.json" --ep 4 --layers 2 --redundant 4 \
  --rebalance --trace "$tmp/drift.json" --window 5 --interval 5 --lag 1 --copy-gbps 1e-6 --json
json_check "slow copies: the gate refuses every plan for its cost" "$tmp/slow.json" \
  "j['summary']['rebalances'] == 0 and any(x['verdict'] == 'moves cost more' for x in j['decisions'])"

# The table, sampled routing (no --trace), and the loop with the asynchronous pick-up (--lag 0).
run_ok "run --rebalance table" "$tmp/run.txt" run --model "$tmp/small.json" --ep 2 --layers 1 --batch 32 --rebalance \
  --routing drift:2:8:6 --steps 12 --window 3 --interval 3
missing=""
for s in "max/mean" "time ms" "decision started" "switched (new placement from the next step)" "replicas moved" \
         "where fresh placements would have moved"; do
  grep -qF -- "$s" "$tmp/run.txt" || missing="$missing '$s'"
done
if [ -z "$missing" ]; then pass "table has every section"; else fail "table lacks$missing"; cat "$tmp/run.txt"; fi

# --- the plot: no text of the JSON or the command line reaches gnuplot ---
if command -v gnuplot > /dev/null; then
  python3 - "$tmp/run.json" "$tmp/evil.json" "$tmp" << 'P'
import json, sys
j = json.load(open(sys.argv[1]))
j['model'] = "x'; system('touch " + sys.argv[3] + "/pwned'); print '"
j['routing'] = '"\n!touch ' + sys.argv[3] + '/pwned2\n'
json.dump(j, open(sys.argv[2], 'w'))
P
  out="$tmp/it's \"here\".png"
  if "$SRC/scripts/plot-rebalance" "$tmp/evil.json" "$out" > /dev/null 2> "$tmp/stderr" && [ -s "$out" ] &&
     [ ! -e "$tmp/pwned" ] && [ ! -e "$tmp/pwned2" ]; then pass "plot: drawn, nothing of the input executed"
  else fail "plot: drawn, nothing of the input executed"; cat "$tmp/stderr"; fi
  echo '{"steps": 3}' > "$tmp/bad.json"
  if ! "$SRC/scripts/plot-rebalance" "$tmp/bad.json" "$tmp/bad.png" 2> "$tmp/stderr" &&
     grep -q "not the JSON of moekit run --rebalance --json" "$tmp/stderr"; then pass "plot: bad JSON named"
  else fail "plot: bad JSON named"; cat "$tmp/stderr"; fi
else
  echo "skip plot checks: gnuplot is not installed"
fi

# --- bad input ---
expect_run_error() {  # NAME FRAGMENT ARGS...: exit 2, FRAGMENT on stderr
  local name=$1 fragment=$2
  shift 2
  "$MOEKIT" "$@" > "$tmp/stdout" 2> "$tmp/stderr"
  local rc=$?
  if [ $rc -ne 2 ]; then fail "$name: exit $rc, expected 2"; cat "$tmp/stderr"; return; fi
  if ! grep -qF -- "$fragment" "$tmp/stderr"; then fail "$name: stderr lacks '$fragment'"; cat "$tmp/stderr"; return; fi
  pass "$name"
}
R=(run --model "$tmp/small.json" --ep 4 --rebalance)
expect_run_error "trace and steps" "--steps goes with a sampled routing" "${R[@]}" --layers 2 --trace "$tmp/drift.json" --steps 9
expect_run_error "trace layers" "has 2 layers: pass --layers 2" "${R[@]}" --trace "$tmp/drift.json"
expect_run_error "missing trace" "cannot open trace file" "${R[@]}" --trace "$tmp/none.json"
run_ok "trace of 8 experts" "$tmp/s8.json" simulate --experts 8 --topk 2 --ranks 4 --batch 8 --trials 2 --steps 2 --save-trace "$tmp/e8.json"
expect_run_error "trace of another model" "routes 8 experts top-2, the model small-moe has 16 experts top-4" "${R[@]}" --trace "$tmp/e8.json"
expect_run_error "window 0" "--window 0" "${R[@]}" --steps 3 --window 0
expect_run_error "interval 0" "interval_steps = 0 must be >= 1" "${R[@]}" --steps 3 --interval 0
expect_run_error "min gain" "min_gain = -1" "${R[@]}" --steps 3 --min-gain -1
expect_run_error "balanceable share" "balanceable_share = 2" "${R[@]}" --steps 3 --balanceable-share 2
expect_run_error "negative copy speed" "--copy-gbps -1" "${R[@]}" --steps 3 --copy-gbps -1
expect_run_error "steps 0" "--steps 0: expected 1 .. 4194304" "${R[@]}" --steps 0
expect_run_error "batch not a multiple of ep" "--batch 30 must be a multiple of --ep 4" "${R[@]}" --batch 30
expect_run_error "drift period 0" "PERIOD (steps between two drifts) must be >= 1" "${R[@]}" --routing drift:2:4:0
expect_run_error "drift malformed" "expected drift:H:R:PERIOD" "${R[@]}" --routing drift:2:4
expect_error "simulate: drift H > E" "H = 20 hot experts exceeds E = 16" simulate --model "$tmp/small.json" --ranks 4 --routing drift:20:4:5
[ ! -e "$tmp/none.json" ] && pass "failed runs write nothing" || fail "failed runs write nothing"

finish "rebalance CLI"
