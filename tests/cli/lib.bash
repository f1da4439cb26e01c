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

# finish NAME: prints 'NAME: N passed, N failed' and exits non-zero on any failure.
finish() {
  echo "$1: $passed passed, $failures failed"
  [ "$failures" -eq 0 ] || exit 1
  exit 0
}
