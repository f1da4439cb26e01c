#!/usr/bin/env bash
# The GPU host's entry points on a machine without a usable GPU: `make test-gpu`, `make bench` and
# `scripts/gpu-check` stop before building or running anything, with the reason; scripts/gpu-host
# accepts a Hopper GPU. nvidia-smi is replaced by stubs (NVIDIA_SMI), so this runs anywhere. Also:
# every folder the scripts create is git-ignored.
# Usage: bash tests/cli/gpu_targets.sh <path-to-moekit> <source-dir>
set -u
source "$(dirname "$0")/lib.bash"
src=$2
# This test may itself run under make (make test -> ctest): the inner make must not inherit the
# outer one's job server.
unset MAKEFLAGS MFLAGS MAKELEVEL

stub smi-none 6 "No devices were found"
stub smi-ampere 0 "NVIDIA A100-SXM4-80GB, 8.0"
stub smi-h200 0 "NVIDIA H200, 9.0"

# expect_stop NAME FRAGMENT SMI COMMAND...: a non-zero exit, FRAGMENT on stderr, nothing built.
expect_stop() {
  local name=$1 fragment=$2 smi=$3
  shift 3
  rm -rf "$tmp/build"
  (cd "$src" && NVIDIA_SMI=$smi "$@") > "$tmp/stdout" 2> "$tmp/stderr"
  local rc=$?
  if [ $rc -eq 0 ]; then fail "$name: exit 0, expected a stop"; cat "$tmp/stdout"; return; fi
  if ! grep -qF -- "$fragment" "$tmp/stderr"; then fail "$name: stderr lacks '$fragment'"; cat "$tmp/stderr"; return; fi
  if [ -e "$tmp/build" ]; then fail "$name: built $tmp/build before stopping"; return; fi
  pass "$name"
}

for target in test-gpu bench; do
  expect_stop "make $target without nvidia-smi" "make $target: no GPU visible: $tmp/absent-smi is not installed" \
    "$tmp/absent-smi" make --no-print-directory "$target" BUILD="$tmp/build"
  expect_stop "make $target when nvidia-smi finds none" "make $target: no GPU visible: $tmp/smi-none reports none (No devices were found)" \
    "$tmp/smi-none" make --no-print-directory "$target" BUILD="$tmp/build"
  expect_stop "make $target on an sm_80 GPU" "no Hopper GPU: the GPU code is built for sm_90a" \
    "$tmp/smi-ampere" make --no-print-directory "$target" BUILD="$tmp/build"
  expect_stop "make $target with CUDA_VISIBLE_DEVICES empty" "CUDA_VISIBLE_DEVICES='' hides every GPU" \
    "$tmp/smi-h200" env CUDA_VISIBLE_DEVICES= make --no-print-directory "$target" BUILD="$tmp/build"
done
expect_stop "scripts/gpu-check without a GPU" "scripts/gpu-check: no GPU visible" \
  "$tmp/smi-none" env OUT="$tmp/out" bash scripts/gpu-check --only tests
expect_stop "scripts/test-gpu without a GPU" "make test-gpu: no GPU visible" "$tmp/smi-none" bash scripts/test-gpu "$tmp/build"
expect_stop "scripts/bench without a GPU" "make bench: no GPU visible" "$tmp/smi-none" bash scripts/bench "$tmp/build" "$tmp/bench-out"

# A Hopper GPU passes the check, which names it.
if out=$(NVIDIA_SMI="$tmp/smi-h200" bash "$src/scripts/gpu-host" "make test-gpu" 2>&1) &&
  [ "$out" = "make test-gpu: NVIDIA H200 (9.0)" ]; then
  pass "scripts/gpu-host accepts an H200"
else
  fail "scripts/gpu-host accepts an H200: '$out'"
fi
# On a Hopper host with a build folder made without CUDA, the run steps say so instead of running nothing.
mkdir -p "$tmp/cpu-build"
expect_stop "scripts/test-gpu on a build without CUDA" "holds no CUDA build" "$tmp/smi-h200" bash scripts/test-gpu "$tmp/cpu-build"
expect_stop "scripts/bench on a build without CUDA" "holds no CUDA build" "$tmp/smi-h200" bash scripts/bench "$tmp/cpu-build" "$tmp/bench-out"

# On a Hopper host with a CUDA build, scripts/bench runs every benchmark in order, bench_rank twice
# (the second run, bench_rank_gpt_oss, with gpt-oss-120b on one rank), each with its JSON path.
# The build folder holds stubs that log their arguments.
mkdir -p "$tmp/fake-build"
touch "$tmp/fake-build/libmoekit_cuda.a"
for b in bench_gemm bench_gemm_mxfp4 bench_stream bench_wgmma bench_ep bench_ep_multi bench_layer bench_layer_multi bench_rank; do
  printf '#!/bin/sh\necho "%s $*" >> "%s"\n' "$b" "$tmp/bench-calls" > "$tmp/fake-build/$b"
  chmod +x "$tmp/fake-build/$b"
done
rm -f "$tmp/bench-calls"
if (cd "$src" && NVIDIA_SMI="$tmp/smi-h200" bash scripts/bench "$tmp/fake-build" "$tmp/bench-out") > "$tmp/bench-stdout" 2>&1 &&
  grep -qx "bench_rank --json $tmp/bench-out/bench_rank.json" "$tmp/bench-calls" &&
  grep -qx "bench_rank --model gpt-oss-120b --ranks 1 --batch 1,8,64,256,1024 --uniform --pipeline staged --json $tmp/bench-out/bench_rank_gpt_oss.json" "$tmp/bench-calls" &&
  [ "$(wc -l < "$tmp/bench-calls")" -eq 10 ] && grep -q '"benchmark": "bench_rank_gpt_oss", "exit": 0' "$tmp/bench-out/summary.json"; then
  pass "scripts/bench runs every benchmark, bench_rank a second time for gpt-oss-120b"
else
  fail "scripts/bench's runs"; cat "$tmp/bench-calls" "$tmp/bench-stdout"
fi
# With bench_rank's JSON (this stub writes one per run, the path after --json), the two plots.
if command -v gnuplot > /dev/null; then
  cat > "$tmp/fake-build/bench_rank" << 'STUB'
#!/bin/sh
while [ $# -gt 1 ]; do [ "$1" = --json ] && out=$2; shift; done
printf '{"rows": [{"model": "m", "pipeline": "fused", "routing": "uniform", "eplb": false, "batch": 8, "step_us": 9.0, "floor_us": 6.0, "ratio": 1.5, "clock_step_ratio": 1.4}, {"model": "m", "pipeline": "fused", "routing": "uniform", "eplb": false, "batch": 64, "step_us": 30.0, "floor_us": 25.0, "ratio": 1.2, "clock_step_ratio": 1.15}]}\n' > "$out"
STUB
  rm -rf "$tmp/bench-out"
  if (cd "$src" && NVIDIA_SMI="$tmp/smi-h200" bash scripts/bench "$tmp/fake-build" "$tmp/bench-out") > "$tmp/bench-stdout" 2>&1 &&
    [ -s "$tmp/bench-out/rank-step-vs-batch.png" ] && [ -s "$tmp/bench-out/rank-ratio-vs-batch.png" ]; then
    pass "scripts/bench draws the step and the step-over-floor plots from bench_rank's JSON"
  else
    fail "scripts/bench's plots"; cat "$tmp/bench-stdout"
  fi
else
  echo "skip scripts/bench's plots: gnuplot is not installed"
fi

# Every folder the scripts create is ignored by git (in a git checkout).
if git -C "$src" rev-parse --git-dir > /dev/null 2>&1; then
  for d in build build-gpu build-gpu-pymod build-pip demo-out bench-out .gpubin .gpupy .whl .anchors; do
    if git -C "$src" check-ignore -q "$d/x"; then pass "$d/ is git-ignored"; else fail "$d/ is not git-ignored"; fi
  done
fi

finish "GPU targets"
