#!/usr/bin/env bash
# scripts/gpu-ab without a GPU or a build: the run step over a kit of stand-in executables (shell
# scripts that print which build they are), with nvidia-smi replaced by a stub (NVIDIA_SMI) and the
# kit by GPU_AB_KIT; and the staging step's checks of its arguments, which stop before it checks
# out or builds anything.
# Usage: bash tests/cli/gpu_ab.sh <path-to-moekit> <source-dir>
set -u
source "$(dirname "$0")/lib.bash"
src=$2
stub smi-h200 0 "NVIDIA H200, 9.0"

# A kit of three builds: each one's fake_bench names its build, writes it to the --json file and
# sleeps FAKE_SLEEP seconds.
mkdir -p "$tmp/kit"
for b in base new v1; do
  mkdir -p "$tmp/kit/$b"
  cat > "$tmp/kit/$b/fake_bench" <<EOS
#!/bin/sh
echo "build $b args \$*"
[ "\$1" = --json ] && echo '{"build": "$b"}' > "\$2"
sleep \${FAKE_SLEEP:-0}
EOS
  chmod +x "$tmp/kit/$b/fake_bench"
  echo "commit-of-$b" > "$tmp/kit/$b/COMMIT"
done
printf 'base\nnew\nv1\n' > "$tmp/kit/BUILDS"
tar cJf "$tmp/ab.tar.xz" -C "$tmp/kit" .

ab() {  # ab OUT-DIR ARGS...: scripts/gpu-ab's run step on the kit; stdout+stderr in OUT-DIR.txt
  local out=$1
  shift
  (cd "$src" && NVIDIA_SMI="$tmp/smi-h200" GPU_AB_KIT="$tmp/ab.tar.xz" OUT="$out" bash scripts/gpu-ab "$@") \
    > "$out.txt" 2>&1
}
# The order of the runs in ab.log: "base 1 new 1 ...".
order() { sed -n 's/^=== \([A-Za-z0-9_-]*\) \([0-9]*\): fake_bench.*/\1 \2/p' "$1/ab.log" | xargs; }

ab "$tmp/all" --rounds 2 --summary '^build' fake_bench --json FILE
rc=$?
if [ $rc -eq 0 ] && [ "$(order "$tmp/all")" = "base 1 new 1 v1 1 base 2 new 2 v1 2" ]; then
  pass "every staged build, round by round"
else
  fail "every staged build, round by round: exit $rc, order '$(order "$tmp/all")'"; cat "$tmp/all.txt"
fi
ok=1
for b in base new v1; do
  for i in 1 2; do
    grep -q "\"build\": \"$b\"" "$tmp/all/ab-$b-$i.json" 2> /dev/null || ok=0
    grep -q "^build $b args --json $tmp/all/ab-$b-$i.json\$" "$tmp/all/ab-$b-$i.log" 2> /dev/null || ok=0
  done
  grep -q "^$b: commit-of-$b\$" "$tmp/all/ab.log" || ok=0
done
[ "$(grep -c '^--- ' "$tmp/all/ab.log")" = 6 ] || ok=0
if [ $ok = 1 ]; then pass "FILE is each run's own JSON; the commits and the summary in ab.log"; else
  fail "FILE is each run's own JSON; the commits and the summary in ab.log"; cat "$tmp/all/ab.log"; fi

ab "$tmp/some" --rounds 1 --builds v1,base fake_bench
if [ $? -eq 0 ] && [ "$(order "$tmp/some")" = "v1 1 base 1" ]; then pass "--builds: those, in its order"; else
  fail "--builds: those, in its order: '$(order "$tmp/some")'"; cat "$tmp/some.txt"; fi

ab "$tmp/bad" --builds base,zz fake_bench
if [ $? -eq 2 ] && grep -qF "'zz' was not staged (staged: base new v1)" "$tmp/bad.txt"; then pass "--builds names an unstaged build"; else
  fail "--builds names an unstaged build"; cat "$tmp/bad.txt"; fi
ab "$tmp/bad2" absent_bench
if [ $? -eq 2 ] && grep -qF "'absent_bench' was not staged" "$tmp/bad2.txt"; then pass "an unstaged target is named"; else
  fail "an unstaged target is named"; cat "$tmp/bad2.txt"; fi

# --budget 5 with runs of 3 s: base runs, new is cut at the budget, v1 is skipped; exit status 1.
FAKE_SLEEP=3 ab "$tmp/budget" --rounds 1 --budget 5 fake_bench
rc=$?
if [ $rc -eq 1 ] && grep -q '^=== v1 1: skipped, the budget of 5 s is spent$' "$tmp/budget/ab.log" &&
  grep -q '^=== new 1: exit 124 (cut at the budget)' "$tmp/budget/ab.log"; then
  pass "--budget: the run at the limit is cut, the rest skipped"
else
  fail "--budget: the run at the limit is cut, the rest skipped (exit $rc)"; cat "$tmp/budget.txt"
fi

for a in "--rounds 0" "--budget x" "--builds ,"; do
  ab "$tmp/opt" $a fake_bench
  if [ $? -eq 2 ] && grep -qF "scripts/gpu-ab: ${a%% *} '${a#* }'" "$tmp/opt.txt"; then pass "gpu-ab $a is refused"; else
    fail "gpu-ab $a is refused"; cat "$tmp/opt.txt"; fi
done

# The staging step's checks, before any checkout or build (build-ab/ is not created when absent).
stage_stop() {  # stage_stop NAME FRAGMENT ARGS...
  local name=$1 fragment=$2
  shift 2
  local had=0
  [ -d "$src/build-ab" ] && had=1
  (cd "$src" && GPU_AB_KIT="$tmp/staged.tar.xz" bash scripts/gpu-ab --stage "$@") > "$tmp/stage.txt" 2>&1
  local rc=$?
  if [ $rc -ne 2 ] || ! grep -qF -- "$fragment" "$tmp/stage.txt"; then fail "$name (exit $rc)"; cat "$tmp/stage.txt"; return; fi
  if [ $had = 0 ] && [ -d "$src/build-ab" ]; then fail "$name: created build-ab/"; return; fi
  if [ -e "$tmp/staged.tar.xz" ]; then fail "$name: wrote a kit"; return; fi
  pass "$name"
}
stage_stop "--stage --build without NAME=" "--build 'HEAD', expected NAME=COMMIT or NAME=PATCH-FILE" --build HEAD HEAD moekit
stage_stop "--stage --build base=..." "'base' and 'new' are BASE's build and the working tree's" --build base=HEAD HEAD moekit
stage_stop "--stage --build twice" "--build a is given twice" --build a=HEAD --build a=HEAD HEAD moekit
if git -C "$src" rev-parse --git-dir > /dev/null 2>&1; then
  stage_stop "--stage --build of neither a commit nor a file" \
    "--build a=no-such-rev: 'no-such-rev' is neither a commit of this repository nor a patch file" \
    --build a=no-such-rev HEAD moekit
  stage_stop "--stage on a BASE that is not a commit" "'no-such-rev' is not a commit of this repository" no-such-rev moekit
fi
stage_stop "--stage without a target" "usage: scripts/gpu-ab" HEAD

finish "scripts/gpu-ab"
