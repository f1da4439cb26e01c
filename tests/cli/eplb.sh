#!/usr/bin/env bash
# `moekit eplb` end to end: the reference example (docs/eplb.md §The reference example) through JSON
# and CSV, --current and --trace, and every bad-input case: exit status 2, an error naming the
# value, and --out untouched.
# Usage: bash tests/cli/eplb.sh <path-to-moekit> <source-dir>
set -u
source "$(dirname "$0")/lib.bash"

# expect_error NAME FRAGMENT ARGS...: exit 2, FRAGMENT on stderr, the --out file unchanged.
expect_error() {
  local name=$1 fragment=$2
  shift 2
  echo sentinel > "$tmp/keep.json"
  "$MOEKIT" eplb "$@" --out "$tmp/keep.json" > "$tmp/stdout" 2> "$tmp/stderr"
  local rc=$?
  if [ $rc -ne 2 ]; then fail "$name: exit $rc, expected 2"; cat "$tmp/stderr"; return; fi
  if ! grep -qF -- "$fragment" "$tmp/stderr"; then fail "$name: stderr lacks '$fragment'"; cat "$tmp/stderr"; return; fi
  if [ "$(cat "$tmp/keep.json")" != sentinel ]; then fail "$name: --out was written"; return; fi
  pass "$name"
}

# json_check NAME FILE PYTHON-EXPRESSION over j
json_check() {
  if python3 -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($3) else 1)" "$2"; then pass "$1"
  else fail "$1"; fi
}

cat > "$tmp/ex.json" << 'J'
{"layers": [[ 90, 132,  40,  61, 104, 165,  39,   4,  73,  56, 183,  86],
            [ 20, 107, 104,  64,  19, 197, 187, 157, 172,  86,  16,  27]]}
J
printf '# the reference EPLB example\n90,132,40,61,104,165,39,4,73,56,183,86\n\n20,107,104,64,19,197,187,157,172,86,16,27\n' > "$tmp/ex.csv"
TOPO=(--slots 16 --groups 4 --nodes 2 --gpus 8)
WANT='[[5,6,5,7,8,4,3,4,10,9,10,2,0,1,11,1],[7,10,6,8,6,11,8,9,2,4,5,1,5,0,3,1]]'

# --- good input ---
if "$MOEKIT" eplb --load "$tmp/ex.json" "${TOPO[@]}" --out "$tmp/p.json" > "$tmp/table" 2> "$tmp/stderr"; then
  pass "example runs"
else
  fail "example runs"; cat "$tmp/stderr"
fi
json_check "example phy2log" "$tmp/p.json" "j['phy2log'] == $WANT"
json_check "example balancedness" "$tmp/p.json" \
  "[round(x, 3) for x in j['balancedness_after']] == [0.828, 0.805] and j['policy'] == 'hierarchical'"
json_check "example per-GPU loads" "$tmp/p.json" \
  "j['gpu_loads_after'][0] == [121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152]"
json_check "log2phy agrees with phy2log" "$tmp/p.json" \
  "all(j['phy2log'][l][s] == e for l in range(2) for e in range(12) for s in j['log2phy'][l][e] if s >= 0)"
grep -q "balancedness (mean over layers)" "$tmp/table" && pass "table and summary printed" || fail "table and summary printed"

"$MOEKIT" eplb --load "$tmp/ex.csv" "${TOPO[@]}" --json > "$tmp/csv.json" 2> "$tmp/stderr" || fail "csv runs"
json_check "CSV gives the same placement (--json on stdout)" "$tmp/csv.json" "j['phy2log'] == $WANT"

"$MOEKIT" eplb --load "$tmp/ex.json" "${TOPO[@]}" --current "$tmp/p.json" --model deepseek-v3 --json \
  > "$tmp/again.json" 2> "$tmp/stderr" || fail "--current runs"
json_check "--current with unchanged loads moves nothing" "$tmp/again.json" \
  "j['replicas_moved'] == 0 and j['bytes_moved'] == 0 and j['phy2log'] == $WANT"

cat > "$tmp/trace.json" << 'J'
{"format": "moekit-trace", "num_experts": 8, "topk": 2, "num_ranks": 2,
 "layers": [[[[0,1],[0,2],[0,1],[3,4]], [[0,1],[5,6],[0,7],[0,1]]]]}
J
"$MOEKIT" eplb --trace "$tmp/trace.json" --slots 8 --groups 1 --nodes 1 --gpus 4 --json > "$tmp/t.json" \
  2> "$tmp/stderr" || { fail "--trace runs"; cat "$tmp/stderr"; }
json_check "--trace reports both loads" "$tmp/t.json" \
  "sum(j['dual']['gemm_rows'][0]) == 16 and sum(j['dual']['counts_gemm_rows'][0]) == 16 and j['dual']['worst_imbalance'] <= j['dual']['counts_worst_imbalance']"

# --- bad input: nothing written ---
echo '{"layers": [[1, -3, 2, 4]]}' > "$tmp/neg.json"
echo '1,nan,2,4' > "$tmp/nan.csv"
echo '{"layers": [[1, null, 2, 4]]}' > "$tmp/null.json"
echo '1,,2,4' > "$tmp/hole.csv"
echo '1,2,3,' > "$tmp/trail.csv"
echo '{"layers": [[1, 2, 3, 4], [1, 2, 3]]}' > "$tmp/ragged.json"
printf '1,2,3,4\n1,2,3\n' > "$tmp/ragged.csv"
echo '{"layers": [[1, 2, NaN, 4]]}' > "$tmp/nan.json"
echo '{"layers": [[1, 2, "x", 4]]}' > "$tmp/str.json"
echo '{"layer": [[1, 2, 3, 4]]}' > "$tmp/nolayers.json"
echo '1,2,abc,4' > "$tmp/word.csv"
: > "$tmp/empty.csv"
echo '{"layers": [[1, 2, 3, 4]]}' > "$tmp/ok4.json"
expect_error "negative load" "layer 0 expert 1 is -3" --load "$tmp/neg.json" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "NaN load (CSV)" "layer 0 expert 1 is nan" --load "$tmp/nan.csv" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "NaN load (JSON)" "malformed JSON" --load "$tmp/nan.json" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "missing load (null)" "layer 0 expert 1 is null" --load "$tmp/null.json" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "missing load (CSV hole)" "layer 0 expert 1 is missing" --load "$tmp/hole.csv" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "missing load (CSV trailing comma)" "layer 0 expert 3 is missing" --load "$tmp/trail.csv" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "non-numeric load (JSON)" "layer 0 expert 2 is \"x\"" --load "$tmp/str.json" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "non-numeric load (CSV)" "layer 0 expert 2 is 'abc'" --load "$tmp/word.csv" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "no layers key" "expected {\"layers\"" --load "$tmp/nolayers.json" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "empty file" "is empty" --load "$tmp/empty.csv" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "ragged rows (JSON)" "layer 1 has 3 loads but layer 0 has 4" --load "$tmp/ragged.json" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "ragged rows (CSV)" "layer 1 has 3 loads but layer 0 has 4" --load "$tmp/ragged.csv" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "slots not a multiple of GPUs" "num_slots = 6 must be a positive multiple of num_gpus = 4" --load "$tmp/ok4.json" --slots 6 --groups 1 --nodes 1 --gpus 4
expect_error "slots below experts" "num_slots = 2 is below the 4 experts" --load "$tmp/ok4.json" --slots 2 --groups 1 --nodes 1 --gpus 2
expect_error "groups not dividing experts" "num_groups = 3 must divide the 4 experts" --load "$tmp/ok4.json" --slots 4 --groups 3 --nodes 1 --gpus 2
expect_error "GPUs not divisible by nodes" "num_gpus = 3 is not divisible by num_nodes = 2" --load "$tmp/ok4.json" --slots 6 --groups 1 --nodes 2 --gpus 3
expect_error "missing load file" "cannot open load file" --load "$tmp/nope.json" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "both --load and --trace" "exactly one of --load" --load "$tmp/ok4.json" --trace "$tmp/trace.json" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "neither --load nor --trace" "exactly one of --load" --slots 4 --groups 1 --nodes 1 --gpus 2
expect_error "--current of another shape" "--current" --load "$tmp/ex.json" --slots 24 --groups 4 --nodes 2 --gpus 8 --current "$tmp/p.json"
expect_error "unknown model" "deepseek-v9" --load "$tmp/ex.json" "${TOPO[@]}" --current "$tmp/p.json" --model deepseek-v9
expect_error "tolerance out of range" "--tolerance 2" --load "$tmp/ex.json" "${TOPO[@]}" --current "$tmp/p.json" --tolerance 2
echo '{"format": "moekit-trace", "num_experts": 8, "topk": 2, "num_ranks": 2, "layers": [[[[0,9],[0,2]]]]}' > "$tmp/badtrace.json"
expect_error "trace expert id out of range" "expert id 9 is not an integer in [0, 8)" --trace "$tmp/badtrace.json" --slots 8 --groups 1 --nodes 1 --gpus 4
echo '{"num_experts": 12, "num_groups": 4, "num_nodes": 2, "num_gpus": 8, "phy2log": [[0,1,2,3,4,5,6,7,8,9,10,10,10,10,10,10],[0,1,2,3,4,5,6,7,8,9,10,11,0,0,0,0]]}' > "$tmp/hole_placement.json"
expect_error "--current missing an expert" "layer 0 expert 11 has no replica" --load "$tmp/ex.json" "${TOPO[@]}" --current "$tmp/hole_placement.json"

# A missing required flag is CLI11's usage error (not 2), and nothing is written either.
echo sentinel > "$tmp/keep.json"
if "$MOEKIT" eplb --load "$tmp/ex.json" --slots 16 --nodes 2 --gpus 8 --out "$tmp/keep.json" > /dev/null 2>&1; then
  fail "missing --groups is rejected"
elif [ "$(cat "$tmp/keep.json")" != sentinel ]; then
  fail "missing --groups: --out was written"
else
  pass "missing --groups is rejected"
fi

# --- where the placement goes: checked before anything is read or printed ---------------------
ok=(--load "$tmp/ok4.json" --slots 4 --groups 1 --nodes 1 --gpus 2)
bad_out() {  # bad_out NAME FRAGMENT OUT: exit 2, FRAGMENT on stderr, nothing on stdout
  "$MOEKIT" eplb "${ok[@]}" --json --out "$3" > "$tmp/stdout" 2> "$tmp/stderr"
  local rc=$?
  if [ $rc -ne 2 ] || ! grep -qF -- "$2" "$tmp/stderr" || [ -s "$tmp/stdout" ]; then
    fail "$1: exit $rc, stdout $(wc -c < "$tmp/stdout") bytes"; cat "$tmp/stderr"
  else pass "$1"; fi
}
mkfifo "$tmp/fifo.json"
mkdir -p "$tmp/outdir"
bad_out "--out a FIFO is refused (a rename would replace the node)" "is a FIFO" "$tmp/fifo.json"
bad_out "--out a directory is refused before the work" "is a directory" "$tmp/outdir"
bad_out "--out in a missing folder is refused before the work" "does not exist" "$tmp/nope/p.json"
bad_out "--out the --load file is refused" "is the file --load" "$tmp/ok4.json"
if [ "$(cat "$tmp/ok4.json")" = '{"layers": [[1, 2, 3, 4]]}' ]; then pass "the --load file is untouched"
else fail "the --load file was replaced"; fi
echo old > "$tmp/target.json"
ln -s target.json "$tmp/link.json"
if "$MOEKIT" eplb "${ok[@]}" --out "$tmp/link.json" > /dev/null 2>&1 && [ -L "$tmp/link.json" ] &&
   python3 -c "import json,sys; json.load(open(sys.argv[1]))['phy2log']" "$tmp/target.json"; then
  pass "--out a symlink writes the file it names and keeps the link"
else fail "--out a symlink"; ls -l "$tmp/link.json" "$tmp/target.json"; fi
# The options of one mode are refused without it.
expect_error "--worst-layer without --current" "--worst-layer requires --current" "${ok[@]}" --worst-layer
expect_error "--tolerance without --current" "--tolerance requires --current" "${ok[@]}" --tolerance 0.1
expect_error "--seed without --trace" "--seed requires --trace" "${ok[@]}" --seed 3
# Values are decimal, given, and never the next option.
expect_error "octal-looking --gpus" "'010': write integers in decimal" --load "$tmp/ok4.json" --slots 4 --groups 1 --nodes 1 --gpus 010
expect_error "hexadecimal --slots" "'0x4': write numbers in decimal" --load "$tmp/ok4.json" --slots 0x4 --groups 1 --nodes 1 --gpus 2
expect_error "empty --tolerance" "--tolerance: an empty value" "${ok[@]}" --current "$tmp/ok4.json" --tolerance ""
expect_error "--load= swallowing the next option" "'--slots' is an option, not a value" --load= --slots 4 --groups 1 --nodes 1 --gpus 2

finish "eplb CLI"
