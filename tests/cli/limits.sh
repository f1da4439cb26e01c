#!/usr/bin/env bash
# Hostile numbers through the command line: integer flags near their type's limit, counts that
# would allocate without bound, inputs whose results overflow, JSON nested 200,000 deep, and
# values of the wrong type. Each must exit 2 with a message naming the flag, or the file and the
# field: no crash, no wrapped number, no NaN with exit 0. The files are written here.
# Usage: bash tests/cli/limits.sh <path-to-moekit> <source-dir>
set -u
SRC=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$(dirname "$0")/lib.bash"

# expect_exit2 NAME FRAGMENT ARGS...: exit status exactly 2 (moekit's own check, not a signal).
expect_exit2() {
  local name=$1 fragment=$2
  shift 2
  "$MOEKIT" "$@" > "$tmp/stdout" 2> "$tmp/stderr"
  local rc=$?
  if [ $rc -ne 2 ]; then fail "$name: exit $rc, expected 2"; head -c 600 "$tmp/stderr"; return; fi
  if ! grep -qF -- "$fragment" "$tmp/stderr"; then fail "$name: stderr lacks '$fragment'"; head -c 600 "$tmp/stderr"; return; fi
  pass "$name"
}

# --- integer flags: range-checked in their type, sums without overflow ---
echo '{"layers": [[1, 2, 3, 4]]}' > "$tmp/l4.json"
expect_exit2 "run --first-layer INT_MAX" "--first-layer 2147483647 --layers 1: expected layers inside the model's 4" \
  run --first-layer 2147483647
expect_exit2 "run --layers INT_MAX" "--first-layer 1 --layers 2147483647: expected layers inside" \
  run --first-layer 1 --layers 2147483647
expect_exit2 "run --redundant INT_MAX" "--redundant 2147483647: expected >= 0 with E + redundant = 2147483711" \
  run --redundant 2147483647
expect_exit2 "simulate --trials INT64_MAX" "--trials = 9223372036854775807 must be <= 4194304" \
  simulate --trials 9223372036854775807
expect_exit2 "simulate --steps INT64_MAX" "--steps = 9223372036854775807 must be >= 1 and <= 4194304" \
  simulate --batch 8 --trials 4 --steps 9223372036854775807 --save-trace "$tmp/t.json"
expect_exit2 "plan --batch INT64_MAX" "batch 9223372036854775807 must be <= 9007199254740992" \
  plan --batch 9223372036854775807
expect_exit2 "plan --context INT64_MAX" "--context = 9223372036854775807 must be <= 1073741824" \
  plan --context 9223372036854775807
for cmd in "simulate --trials 2" "run" "eplb --load $tmp/l4.json --slots 4 --groups 1 --nodes 1 --gpus 1"; do
  # shellcheck disable=SC2086
  expect_error "${cmd%% *} --seed -1 (CLI11 would wrap it to 2^64 - 1)" "is not an integer in [0, 18446744073709551615]" $cmd --seed -1
  # shellcheck disable=SC2086
  expect_error "${cmd%% *} --seed 2^64 (CLI11 would saturate it)" "is not an integer in [0, 18446744073709551615]" \
    $cmd --seed 18446744073709551616
done
expect_exit2 "simulate --threads 1000000" "threads = 1000000 must be <= 1024" simulate --threads 1000000 --trials 2

# --- sizes from flags: bounded before anything is allocated ---
expect_exit2 "eplb --slots 200000000" "num_slots = 200000000 exceeds the limit of 262144" \
  eplb --load "$tmp/l4.json" --slots 200000000 --groups 1 --nodes 1 --gpus 1
expect_exit2 "simulate --experts INT_MAX" "--experts = 2147483647 must be <= 65536" simulate --experts 2147483647 --topk 1
expect_exit2 "run --batch 3e9" "--batch 3000000000: expected >= 1 and <= 16777216" run --batch 3000000000
expect_exit2 "run --batch 2^24: more memory than the machine" "more than this machine's" run --batch 16777216
echo '{"format": "moekit-trace", "num_experts": 2000000000, "topk": 1, "num_ranks": 1, "layers": [[[[0]]]]}' > "$tmp/big.json"
expect_exit2 "trace declaring 2e9 experts" "trace '$tmp/big.json': field 'num_experts' = 2000000000 must be <= 65536" \
  eplb --trace "$tmp/big.json" --slots 8 --groups 1 --nodes 1 --gpus 1
echo '{"num_experts": 2000000000, "num_groups": 1, "num_nodes": 1, "num_gpus": 1, "phy2log": [[0, 1, 2, 3]]}' > "$tmp/bigp.json"
expect_exit2 "placement declaring 2e9 experts" "placement '$tmp/bigp.json': field 'num_experts' = 2000000000 must be <= 65536" \
  eplb --load "$tmp/l4.json" --slots 4 --groups 1 --nodes 1 --gpus 1 --current "$tmp/bigp.json"

# --- finite inputs whose results would overflow ---
echo '{"layers": [[1e308, 1e308, 1e308, 1e308, 1e308, 1e308, 1e308, 1e308]]}' > "$tmp/huge.json"
expect_exit2 "eight loads of 1e308" "load of layer 0 expert 0 is 1e+308, expected a finite value in [0, 1e+18]" \
  eplb --load "$tmp/huge.json" --slots 8 --groups 1 --nodes 1 --gpus 8
grep -q nan "$tmp/stdout" && fail "eight loads of 1e308: NaN printed" || pass "eight loads of 1e308: no NaN printed"
"$MOEKIT" spec --gpu h200 > "$tmp/gpu.json"
python3 -c "
import json, sys
g = json.load(open(sys.argv[1])); g['hbm_bandwidth'] = 1e-320
json.dump(g, open(sys.argv[2], 'w'))" "$tmp/gpu.json" "$tmp/slow.json"
expect_exit2 "hbm_bandwidth 1e-320" "$tmp/slow.json: field 'hbm_bandwidth' = 1e-320 must be >= 1e+06" plan --gpu "$tmp/slow.json"

# --- messages name the file and the field ---
"$MOEKIT" spec --model tiny-moe | sed 's/"num_layers": 4/"num_layers": 1e999/' > "$tmp/overflow.json"
expect_exit2 "number overflow names file and field" \
  "$tmp/overflow.json: malformed JSON at num_layers: [json.exception.out_of_range.406] number overflow parsing '1e999'" \
  plan --model "$tmp/overflow.json"
echo '{"format": ["moekit-trace"], "num_experts": 8, "topk": 1, "num_ranks": 1, "layers": []}' > "$tmp/fmt.json"
expect_exit2 "trace format of the wrong type" "trace '$tmp/fmt.json': field 'format' = [\"moekit-trace\"] must be a string" \
  eplb --trace "$tmp/fmt.json" --slots 8 --groups 1 --nodes 1 --gpus 1

# --- JSON nested 200,000 levels deep (400 KB): an error naming the file, not SIGSEGV ---
deep=$(python3 -c "print('[' * 200000 + ']' * 200000)")
"$MOEKIT" spec --model tiny-moe > "$tmp/tiny.json"
python3 -c "
import sys
text = open(sys.argv[1]).read()
open(sys.argv[2], 'w').write(text.replace('\"hidden_size\": 1024', '\"hidden_size\": ' + '[' * 200000 + ']' * 200000))
" "$tmp/tiny.json" "$tmp/deep-model.json"
expect_exit2 "deep spec" "$tmp/deep-model.json: JSON nested deeper than 127 levels at hidden_size[0][0]" \
  plan --model "$tmp/deep-model.json"
echo "{\"layers\": [[1, $deep]]}" > "$tmp/deep-loads.json"
expect_exit2 "deep load file" "'$tmp/deep-loads.json': JSON nested deeper than 127 levels at layers[0][1][0]" \
  eplb --load "$tmp/deep-loads.json" --slots 8 --groups 1 --nodes 1 --gpus 1
echo "{\"format\": \"moekit-trace\", \"num_experts\": $deep}" > "$tmp/deep-trace.json"
expect_exit2 "deep trace" "trace '$tmp/deep-trace.json': JSON nested deeper than 127 levels at num_experts[0]" \
  eplb --trace "$tmp/deep-trace.json" --slots 8 --groups 1 --nodes 1 --gpus 1

finish "limits CLI"
