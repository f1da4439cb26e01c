#!/usr/bin/env bash
# Files the commands read and write: a FIFO, a directory or a symlink loop given as an input is an
# error naming it (never a hang); --out and --save-trace replace their file whole, never truncate
# it in place; SIGINT and SIGTERM remove `moekit run`'s temporary checkpoint; an interrupted
# --save-weights leaves a directory that is refused, not read as a mix of two runs.
# Usage: bash tests/cli/files.sh <path-to-moekit> <source-dir>
set -u
source "$(dirname "$0")/lib.bash"

# expect_error_in NAME SECONDS FRAGMENT ARGS...: exit 2 within SECONDS with FRAGMENT on stderr.
expect_error_in() {
  local name=$1 secs=$2 fragment=$3
  shift 3
  timeout "$secs" "$MOEKIT" "$@" > "$tmp/stdout" 2> "$tmp/stderr"
  local rc=$?
  if [ $rc -eq 124 ]; then fail "$name: still running after $secs s (blocked)"; return; fi
  if [ $rc -ne 2 ]; then fail "$name: exit $rc, expected 2"; cat "$tmp/stderr"; return; fi
  if ! grep -qF -- "$fragment" "$tmp/stderr"; then fail "$name: stderr lacks '$fragment'"; cat "$tmp/stderr"; return; fi
  pass "$name"
}

TOPO=(--slots 8 --groups 1 --nodes 1 --gpus 2)
mkfifo "$tmp/fifo.json" "$tmp/fifo.safetensors"
mkdir "$tmp/dir.json"
ln -s loop_b "$tmp/loop_a"
ln -s loop_a "$tmp/loop_b"

# --- inputs that are not regular files ----------------------------------------------------------
expect_error_in "FIFO as --weights" 20 "'$tmp/fifo.safetensors': is a FIFO (named pipe), not a regular file" \
  run --weights "$tmp/fifo.safetensors"
mkdir "$tmp/ckpt"
printf '{"weight_map": {"model.layers.0.mlp.gate.weight": "../fifo.safetensors"}}' > "$tmp/ckpt/model.safetensors.index.json"
expect_error_in "index.json with a bad name" 20 "must be a file name in the same directory" run --weights "$tmp/ckpt"
mkfifo "$tmp/ckpt/shard.safetensors"
printf '{"weight_map": {"model.layers.0.mlp.experts.0.gate_proj.weight": "shard.safetensors"}}' > "$tmp/ckpt/model.safetensors.index.json"
expect_error_in "index.json naming a FIFO" 20 "shard.safetensors': is a FIFO" run --weights "$tmp/ckpt"
rm "$tmp/ckpt/model.safetensors.index.json" && mkfifo "$tmp/ckpt/model.safetensors.index.json"
expect_error_in "index.json as a FIFO" 20 "cannot open checkpoint index" run --weights "$tmp/ckpt"
rm "$tmp/ckpt/model.safetensors.index.json" && mkdir "$tmp/ckpt/model.safetensors.index.json"
expect_error_in "index.json as a directory" 20 "model.safetensors.index.json': is a directory, not a regular file" \
  run --weights "$tmp/ckpt"
expect_error_in "symlink loop as --weights" 20 "'$tmp/loop_a': too many levels of symbolic links (a symlink loop)" \
  run --weights "$tmp/loop_a"
expect_error_in "directory as --trace" 20 "cannot open trace file '$tmp/dir.json': is a directory, not a regular file" \
  eplb --trace "$tmp/dir.json" "${TOPO[@]}"
expect_error_in "FIFO as --trace" 20 "cannot open trace file '$tmp/fifo.json': is a FIFO" eplb --trace "$tmp/fifo.json" "${TOPO[@]}"
expect_error_in "FIFO as --load" 20 "cannot open load file '$tmp/fifo.json': is a FIFO" eplb --load "$tmp/fifo.json" "${TOPO[@]}"
printf '{"layers": [[1, 2, 3, 4]]}' > "$tmp/load.json"
expect_error_in "directory as --current" 20 "cannot open placement file '$tmp/dir.json': is a directory" \
  eplb --load "$tmp/load.json" --slots 4 --groups 1 --nodes 1 --gpus 2 --current "$tmp/dir.json"
expect_error_in "FIFO as --model" 20 "cannot open spec file '$tmp/fifo.json': is a FIFO" plan --model "$tmp/fifo.json"
expect_error_in "symlink loop as --gpu" 20 "symlink loop" plan --gpu "$tmp/loop_a/x.json"

# --- outputs replaced whole ---------------------------------------------------------------------
# A hard link to the old file shows whether it was rewritten in place (the link would change too).
echo old > "$tmp/p.json"
ln "$tmp/p.json" "$tmp/p_link.json"
if "$MOEKIT" eplb --load "$tmp/load.json" --slots 4 --groups 1 --nodes 1 --gpus 2 --out "$tmp/p.json" > /dev/null 2> "$tmp/stderr" &&
   [ "$(cat "$tmp/p_link.json")" = old ] && grep -q moekit-placement "$tmp/p.json" && [ ! -e "$tmp/p.json.tmp" ]; then
  pass "eplb --out replaces the file, never truncates it in place"
else
  fail "eplb --out replaces the file, never truncates it in place"; cat "$tmp/stderr"
fi
echo old > "$tmp/t.json"
ln "$tmp/t.json" "$tmp/t_link.json"
if "$MOEKIT" simulate --experts 16 --topk 2 --ranks 2 --batch 4 --trials 3 --save-trace "$tmp/t.json" > /dev/null 2> "$tmp/stderr" &&
   [ "$(cat "$tmp/t_link.json")" = old ] && grep -q moekit-trace "$tmp/t.json" && [ ! -e "$tmp/t.json.tmp" ]; then
  pass "simulate --save-trace replaces the file, never truncates it in place"
else
  fail "simulate --save-trace replaces the file, never truncates it in place"; cat "$tmp/stderr"
fi
# A FIFO left where the .tmp goes is replaced, not written into (that would block).
mkfifo "$tmp/p.json.tmp"
if timeout 20 "$MOEKIT" eplb --load "$tmp/load.json" --slots 4 --groups 1 --nodes 1 --gpus 2 --out "$tmp/p.json" > /dev/null 2>&1 &&
   [ ! -e "$tmp/p.json.tmp" ]; then
  pass "a stale FIFO at <out>.tmp is replaced"
else
  fail "a stale FIFO at <out>.tmp is replaced"
fi

# --- SIGINT and SIGTERM -------------------------------------------------------------------------
# `moekit run` writes tiny-moe's first 2 layers (103 MB) of random weights to a temporary directory;
# the signal comes as soon as the directory holds a file being written.
# wait_for GLOB PID: waits (up to 60 s) until a path matches GLOB, or the process has ended.
wait_for() {
  local i
  for i in $(seq 1200); do
    # shellcheck disable=SC2086
    compgen -G "$1" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || return 1
    sleep 0.05
  done
  return 1
}
set -m  # background jobs keep SIGINT (a non-interactive shell would start them ignoring it)
for sig in TERM INT; do
  td="$tmp/tmpdir_$sig"
  mkdir "$td"
  TMPDIR="$td" "$MOEKIT" run --model tiny-moe --layers 2 > /dev/null 2> "$tmp/stderr_$sig" &
  pid=$!
  if wait_for "$td/moekit-run-*/*.tmp" $pid; then
    kill -s "$sig" $pid
    wait $pid
    rc=$?
    want=$((128 + $(kill -l "$sig")))
    if [ $rc -eq $want ] && [ -z "$(ls -A "$td")" ]; then
      pass "SIG$sig during run: exit $rc and the temporary checkpoint is gone"
    else
      fail "SIG$sig during run: exit $rc (expected $want), left: $(ls -A "$td")"; cat "$tmp/stderr_$sig"
    fi
  else
    wait $pid
    fail "SIG$sig during run: no file was being written in $td (the run ended first?)"
  fi
done

# --- an interrupted --save-weights --------------------------------------------------------------
# The second run removes the first run's index and shards, is stopped while writing its one
# shard, and the directory, now without a checkpoint, is refused rather than read.
# Only a directory of the generator's own files is written again: one holding anything else (a
# real checkpoint's shards have the same names) is refused before anything in it changes.
run_ok "save weights" "$tmp/r1.txt" run --model tiny-moe --layers 2 --save-weights "$tmp/w" --seed 1
mkdir "$tmp/real"
"$MOEKIT" run --model tiny-moe --layers 2 --save-weights "$tmp/real" --seed 1 > /dev/null 2>&1
python3 - "$tmp/real" << 'P'
import json, os, struct, sys
d = sys.argv[1]
for name in os.listdir(d):  # the same shards, as a checkpoint written by someone else
    if name.endswith(".safetensors"):
        with open(os.path.join(d, name), "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            header["__metadata__"]["generator"] = "someone else"
            text = json.dumps(header, separators=(",", ":")).encode()
            assert len(text) <= n, "the new header is longer than the old one"
            f.seek(8); f.write(text.ljust(n))
P
before=$(cd "$tmp/real" && ls -l --time-style=full-iso | md5sum)
expect_error "--save-weights over a checkpoint moekit did not write" "written by 'someone else'" run --model tiny-moe --layers 2 --save-weights "$tmp/real"
expect_error "--save-weights over a file moekit did not write" "which moekit's generator did not write" run --model tiny-moe --layers 2 --save-weights "$tmp"
if [ "$(cd "$tmp/real" && ls -l --time-style=full-iso | md5sum)" = "$before" ]; then pass "the refused directory is untouched"
else fail "the refused directory changed"; fi
"$MOEKIT" run --model tiny-moe --layers 2 --save-weights "$tmp/w" --seed 2 > /dev/null 2>&1 &
pid=$!
if wait_for "$tmp/w/*.tmp" $pid; then
  kill -s TERM $pid
  wait $pid
  expect_error_in "an interrupted --save-weights is refused" 60 "holds neither model.safetensors.index.json nor" run --model tiny-moe --layers 2 --weights "$tmp/w"
  if compgen -G "$tmp/w/*.tmp" > /dev/null; then fail "the interrupted shard's .tmp is left"; else pass "the interrupted shard's .tmp is removed"; fi
else
  wait $pid
  fail "an interrupted --save-weights: no file was being written"
fi
set +m

finish "cli files"
