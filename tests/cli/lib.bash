# Sourced by tests/cli/*.sh (not itself a test): the moekit binary ($1), a temporary folder
# removed at exit, pass/fail counters and the closing line.
MOEKIT=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failures=0
pass() { echo "ok   $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failures=$((failures + 1)); }
command -v python3 > /dev/null || { echo "FAIL python3 is needed to read the JSON output"; exit 1; }

# stub NAME EXIT-STATUS OUTPUT: $tmp/NAME, an nvidia-smi that prints OUTPUT for a query (NVIDIA_SMI
# points the GPU scripts at it).
stub() {
  printf '#!/bin/sh\nprintf "%s\\n" "%s"\nexit %s\n' '%s' "$3" "$2" > "$tmp/$1"
  chmod +x "$tmp/$1"
}

# The common checks; a script may define its own variant after sourcing this file.
# expect_error NAME FRAGMENT ARGS...: a non-zero exit (2 for moekit's own checks) and FRAGMENT on stderr.
expect_error() {
  local name=$1 fragment=$2
  shift 2
  "$MOEKIT" "$@" > "$tmp/stdout" 2> "$tmp/stderr"
  local rc=$?
  if [ $rc -eq 0 ]; then fail "$name: exit 0, expected an error"; return; fi
  if ! grep -qF -- "$fragment" "$tmp/stderr"; then fail "$name: stderr lacks '$fragment'"; cat "$tmp/stderr"; return; fi
  pass "$name"
}

# json_check NAME FILE PYTHON-EXPRESSION over j (and close(a, b, rel) for floats);
# json_code NAME FILE PYTHON-CODE that sets ok.
json_code() {
  if python3 -c "
import json, math, sys
j = json.load(open(sys.argv[1]))
def close(a, b, rel=1e-9): return a is not None and abs(a - b) <= rel * abs(b) + 1e-15
ok = False
$3
sys.exit(0 if ok else 1)" "$2"; then pass "$1"
  else fail "$1"; fi
}
json_check() { json_code "$1" "$2" "ok = ($3)"; }

run_ok() {  # run_ok NAME OUTFILE ARGS...
  local name=$1 out=$2
  shift 2
  if "$MOEKIT" "$@" > "$out" 2> "$tmp/stderr"; then pass "$name"; else fail "$name"; cat "$tmp/stderr"; fi
}

# finish NAME: prints 'NAME: N passed, N failed' and exits non-zero on any failure.
finish() {
  echo "$1: $passed passed, $failures failed"
  [ "$failures" -eq 0 ] || exit 1
  exit 0
}
