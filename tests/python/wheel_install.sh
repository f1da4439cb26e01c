#!/usr/bin/env bash
# The package as a user gets it: the wheel built CPU-only by pip from pyproject.toml, installed into
# a fresh virtual environment, and the NumPy tests of python/tests run against the installed module
# from a folder outside the source tree. A file the wheel leaves out, a wrong install path or a
# missing dependency fails here, not on a user's machine.
#   1. BUILD_DIR/pip-tools: a virtual environment holding exactly pyproject.toml's build
#      requirements (scikit-build-core, nanobind), kept between runs, so that
#   2. `pip wheel --no-build-isolation` with its CMake build in BUILD_DIR/pip-wheel recompiles only
#      what changed since the last run (pip's own isolation would rebuild everything every time);
#   3. a new virtual environment: `pip install` of that wheel (which brings numpy) and pytest;
#   4. `import moekit` must come from that environment, built without CUDA; pytest python/tests.
# Needs PyPI, as scripts/setup does; MOEKIT_SKIP_PYTHON=1 skips it (exit 77: ctest reports a skip).
# Usage: tests/python/wheel_install.sh PYTHON SOURCE_DIR BUILD_DIR
set -uo pipefail
py=$1
src=$(cd "$2" && pwd)
build=$3
if [ "${MOEKIT_SKIP_PYTHON:-}" = 1 ]; then
  echo "python_wheel: skipped (MOEKIT_SKIP_PYTHON=1)"
  exit 77
fi
mkdir -p "$build"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() {  # step WHAT COMMAND...: runs it; on failure says what failed and stops
  if ! "${@:2}"; then
    echo "python_wheel: FAILED: $1"
    exit 1
  fi
}
pip_q() { "$1" -m pip install -q --disable-pip-version-check "${@:2}"; }

t0=$(date +%s)
tools=$build/pip-tools
if [ ! -x "$tools/bin/python" ]; then
  step "$py -m venv (on Debian: apt-get install python3-venv)" "$py" -m venv "$tools"
fi
requires=$("$tools/bin/python" - "$src/pyproject.toml" << 'P'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"^\[build-system\]\s*\n(.*?)(?=^\[)", text, re.S | re.M).group(1)
print("\n".join(re.findall(r'"([^"]+)"', re.search(r"requires\s*=\s*\[(.*?)\]", block, re.S).group(1))))
P
)
step "reading [build-system] requires from pyproject.toml" test -n "$requires"
mapfile -t requires <<< "$requires"
step "pip install ${requires[*]} (the build requirements)" pip_q "$tools/bin/python" "${requires[@]}"
step "pip wheel (CPU only)" env MOEKIT_WITH_CUDA=OFF CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  "$tools/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$work/dist" \
  --config-settings=build-dir="$build/pip-wheel" "$src"
t1=$(date +%s)

step "$py -m venv" "$py" -m venv "$work/venv"
vpy=$work/venv/bin/python
step "pip install of the wheel" pip_q "$vpy" "$work"/dist/moekit-*.whl
step "pip install pytest" pip_q "$vpy" pytest
cd "$work"
step "import moekit from the new environment" env -u PYTHONPATH "$vpy" -c "
import sys, moekit
assert moekit.__file__.startswith(sys.prefix), f'moekit imported from {moekit.__file__}, not from {sys.prefix}'
assert not moekit.with_cuda, 'built with CUDA although MOEKIT_WITH_CUDA=OFF'
print('python_wheel: moekit from', moekit.__file__)"
step "the NumPy tests against the installed module" env -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 \
  "$vpy" -m pytest -q -p no:cacheprovider "$src/python/tests"
echo "python_wheel: passed (wheel $((t1 - t0)) s, install and tests $(($(date +%s) - t1)) s)"
