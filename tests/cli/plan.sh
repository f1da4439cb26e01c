#!/usr/bin/env bash
# `moekit plan` end to end: the default table, --json on the embedded default and on custom spec
# files written here (every figure checked against hand arithmetic), --eplb-gain, --plot and
# scripts/plot-plan, and every bad flag: a non-zero exit and an error naming the value.
# Usage: bash tests/cli/plan.sh <path-to-moekit> <source-dir>
set -u
SRC=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$(dirname "$0")/lib.bash"

# --- the embedded default: deepseek-v3 on 8 x h200, B = 1 … 1024 ---
run_ok "default table" "$tmp/table" plan
if grep -q "operating point B = 999" "$tmp/table" && grep -q "bound by memory" "$tmp/table" &&
   grep -q "dominant" "$tmp/table" && grep -q "(ms)" "$tmp/table"; then pass "table names the binding constraint, units, dominant term"
else fail "table names the binding constraint, units, dominant term"; cat "$tmp/table"; fi
run_ok "default json" "$tmp/d.json" plan --json
# B_mem = (8·141e9·0.85 − 671e9)/(70272·4096) = 287.8e9/287,834,112 = 999.88; knee 3738.48
json_check "default: batches 1..1024" "$tmp/d.json" "[r['batch'] for r in j['rows']] == [2**i for i in range(11)]"
json_check "default: operating point and binding" "$tmp/d.json" \
  "j['operating_point'] == 999 and j['binding'] == 'memory' and close(j['batch_mem'], 999.8814872922359) and close(j['knee_batch'], 3738.4825450450453) and 'batch_sla' not in j"

# --- custom spec files ---
cat > "$tmp/toy-moe.json" << 'J'
{"name": "toy-moe", "hidden_size": 1000, "num_layers": 10, "num_moe_layers": 10, "moe_intermediate_size": 500,
 "num_routed_experts": 64, "num_experts_per_token": 4, "num_shared_experts": 1, "shared_intermediate_size": 500,
 "total_params": 1.2e9, "active_params": 0.2e9, "weight_bytes_per_param": 2, "kv_bytes_per_token": 10000,
 "router": {"scoring": "softmax", "num_groups": 1, "topk_groups": 1, "routed_scaling_factor": 1.0, "normalize_topk": true}}
J
cat > "$tmp/toy-gpu.json" << 'J'
{"name": "toy-gpu", "hbm_bytes": 100e9, "hbm_bandwidth": 2e12, "fp8_flops": 1000e12, "bf16_flops": 500e12,
 "nvlink_bandwidth": 400e9, "nvlink_latency_us": 2.0, "network_bandwidth": 40e9, "network_latency_us": 8.0,
 "gpus_per_node": 4}
J
cat > "$tmp/toy-dense.json" << 'J'
{"name": "toy-dense", "hidden_size": 1000, "num_layers": 10, "num_moe_layers": 0, "moe_intermediate_size": 0,
 "num_routed_experts": 0, "num_experts_per_token": 0, "num_shared_experts": 0, "shared_intermediate_size": 0,
 "total_params": 1e9, "active_params": 1e9, "weight_bytes_per_param": 2, "kv_bytes_per_token": 1000}
J
run_ok "custom specs: json" "$tmp/c.json" plan --model "$tmp/toy-moe.json" --gpu "$tmp/toy-gpu.json" --ep 4 \
  --batch 1,16,256 --tpot-sla 20.00005ms --json
# routed = 10·64·3·1000·500·2 B = 1.92e9; other = 1.2e9·2 − 1.92e9 = 0.48e9
json_check "custom: weight bytes" "$tmp/c.json" \
  "close(j['rows'][0]['routed_weight_bytes'], 1.92e9) and close(j['rows'][0]['other_weight_bytes'], 0.48e9)"
# B = 16 on P = 4: coverage = 1 − (60/64)^16 = 0.643926; step bytes/GPU = (C·1.92e9 + 0.48e9)/4,
# weight read = that / 2e12 s; compute = 2·0.2e9·16/(4·1e15) s = 0.0016 ms
json_code "custom: coverage, weight read, compute at B=16" "$tmp/c.json" "
r = j['rows'][1]; C = 1 - (60/64)**16
ok = (r['batch'] == 16 and close(r['coverage'], C, 1e-12) and abs(C - 0.643926) < 1e-6 and
close(r['step_weight_bytes_per_gpu'], (C*1.92e9 + 0.48e9)/4) and close(r['weight_read_ms'], (C*1.92e9 + 0.48e9)/4/2e12*1e3) and
close(r['compute_ms'], 0.0016) and close(r['floor_ms'], r['weight_read_ms']) and r['dominant'] == 'weights')"
# dedup = 4·(1 − (3/4)^4) = 4·(1 − 81/256) = 2.734375; dispatch = 4 tokens·2.734375·1000 B = 10937.5;
# combine = 4·4·1000·2 = 32000; pre-reduced = 4·2.734375·1000·2 = 21875; M_e = 16·4/64 = 1
json_code "custom: all-to-all bytes at B=16" "$tmp/c.json" "
r = j['rows'][1]
ok = (r['dedup_targets'] == 2.734375 and r['dispatch_bytes_per_gpu'] == 10937.5 and r['combine_bytes_per_gpu'] == 32000 and
r['combine_bytes_prereduced_per_gpu'] == 21875 and r['expected_rows_per_expert'] == 1)"
# comm = 10 layers·[(10937.5 + 21875)·3/4 / 400e9 + 2·2 µs] = 10·(61.5234375 ns + 4 µs) = 0.040615234375 ms (NVLink: P = 4 <= 4)
json_check "custom: comm over NVLink at B=16" "$tmp/c.json" \
  "j['comm_link'] == 'nvlink' and close(j['rows'][1]['comm_ms'], 0.040615234375)"
# CV_e = sqrt((1 − 1/16)/(16·4/64)) = sqrt(0.9375) = 0.968246; S₀ = 1 + sqrt(2 ln 4)·0.968246/sqrt(16)
json_check "custom: CV_e and statistical S0 at B=16" "$tmp/c.json" \
  "close(j['rows'][1]['cv_expert'], math.sqrt(0.9375)) and close(j['rows'][1]['imbalance_stat'], 1 + math.sqrt(2*math.log(4))*math.sqrt(0.9375)/4)"
# Ridge = 1e15/2e12 = 500; knee = 500·1.2e9·2/(2·0.2e9) = 3000; BM* = 500·2/2 = 500;
# B_mem = (4·100e9·0.85 − 2.4e9)/(10000·4096) = 337.6e9/40.96e6 = 8242.1875;
# B_SLA: weights never exceed 2.4e9/4/2e12 = 0.3 ms, compute = 1e-4·B ms <= 20.00005 ⇔ B <= 200000.5
json_check "custom: knee, BM*, B_mem, B_SLA, operating point" "$tmp/c.json" "
close(j['ridge'], 500) and close(j['knee_batch'], 3000) and close(j['bm_star'], 500) and
close(j['batch_mem'], 8242.1875) and j['batch_sla'] == 200000 and j['operating_point'] == 3000 and j['binding'] == 'knee'"
# Padding at M_e = 3000·4/64 = 187.5: BM8 24·8/187.5 = 1.024; BM128 2·128/187.5 = 1.365333; padding
# to M_max = 64 does not apply above 64 rows (null); at M_e = 5 BM16 3.2
json_code "custom: padding" "$tmp/c.json" "
p = {x['bm']: x for x in j['padding']}
ok = (sorted(p) == [8, 16, 32, 64, 128] and p[8]['expected_m'] == 187.5 and close(p[8]['waste_expected'], 1.024) and
close(p[128]['waste_expected'], 256/187.5) and p[64]['waste_pad_to_m_max'] is None and close(p[16]['waste_m5'], 3.2) and
close(p[64]['waste_pad_to_m_max_m5'], 12.8))"
run_ok "custom specs: bf16, EP8 across nodes" "$tmp/c8.json" plan --model "$tmp/toy-moe.json" --gpu "$tmp/toy-gpu.json" \
  --ep 8 --batch 64 --dtype bf16 --context 1000 --mem-fraction 0.5 --json
# bf16: Ridge = 5e14/2e12 = 250, knee = 250·6 = 1500; EP8 > 4 GPUs per node: network 40e9 B/s, 8 µs.
# B_mem = (8·100e9·0.5 − 2.4e9)/(10000·1000) = 397.6e9/1e7 = 39760.
# B = 64 on P = 8: 8 tokens/GPU, dedup = 8(1 − (7/8)^4) = 3.3105469; comm = 10·[8·dedup·1000·3·7/8/40e9 + 16 µs]
json_code "custom: bf16 knee, network comm, B_mem" "$tmp/c8.json" "
d = 8*(1 - (7/8)**4)
ok = (close(j['knee_batch'], 1500) and j['comm_link'] == 'network' and close(j['batch_mem'], 39760) and
close(j['rows'][0]['comm_ms'], 10*(8*d*1000*3*7/8/40e9 + 16e-6)*1e3) and j['operating_point'] == 1500)"
run_ok "custom dense spec: json" "$tmp/dense.json" plan --model "$tmp/toy-dense.json" --gpu "$tmp/toy-gpu.json" \
  --ep 3 --batch 1,100 --json
# Dense: coverage 1, weight read 1e9·2/3/2e12 s = 0.333333 ms whatever B, MoE-only figures null.
json_check "custom dense: coverage 1, MoE fields null" "$tmp/dense.json" "
all(r['coverage'] == 1 and r['dedup_targets'] is None and r['comm_ms'] is None and r['imbalance_stat'] is None and
    close(r['weight_read_ms'], 1e9*2/3/2e12*1e3) for r in j['rows']) and j['padding'] is None and j['is_moe'] is False"
run_ok "custom dense spec: table" "$tmp/dense.txt" plan --model "$tmp/toy-dense.json" --gpu "$tmp/toy-gpu.json" --ep 3 --batch 1,100

# --- speculative decoding (--mtp N --accept L) ---
# N = 0 is today's plan: every key of the planner's JSON from before --mtp existed (saved in
# tests/cli/data/plan-before-mtp.json with its arguments) but the prose `notes` has the same value, without
# --mtp and with --mtp 0.
python3 -c "
import json, sys
for name, case in json.load(open(sys.argv[1]))['cases'].items():
    print(name + '\t' + '\t'.join(a.replace('TOY', sys.argv[2]) for a in case['args']))" \
  "$SRC/tests/cli/data/plan-before-mtp.json" "$tmp" > "$tmp/cases"
while IFS=$'\t' read -r name args; do
  IFS=$'\t' read -r -a argv <<< "$args"
  run_ok "mtp 0 = before --mtp: $name runs" "$tmp/now.json" plan "${argv[@]}"
  run_ok "mtp 0 = before --mtp: $name runs with --mtp 0" "$tmp/now0.json" plan "${argv[@]}" --mtp 0
  for f in now now0; do
    json_code "mtp 0 = before --mtp: $name, every key the same ($f)" "$tmp/$f.json" "
def same(old, new, path):
    if isinstance(old, dict):
        # notes is prose, and has grown a line about MTP
        return isinstance(new, dict) and all(k in new and same(v, new[k], path + '.' + k) for k, v in old.items() if k != 'notes')
    if isinstance(old, list):
        if not isinstance(new, list) or len(old) != len(new): print('  differs at', path); return False
        return all(same(a, b, path) for a, b in zip(old, new))
    if old != new or type(old) != type(new): print('  differs at', path, old, new)
    return old == new and type(old) == type(new)
gold = json.load(open('$SRC/tests/cli/data/plan-before-mtp.json'))['cases']['$name']['json']
ok = same(gold, j, '') and j['mtp'] == 0 and all(r['no_mtp'] is None and r['tpot_ms'] == r['floor_ms'] for r in j['rows'])"
  done
done < "$tmp/cases"
[ "$(wc -l < "$tmp/cases")" -eq 4 ] && pass "mtp 0: four saved plans compared" || fail "mtp 0: four saved plans compared"
# And the table: the same bytes with --mtp 0 as without.
"$MOEKIT" plan --tpot-sla 15ms > "$tmp/t0" && "$MOEKIT" plan --tpot-sla 15ms --mtp 0 > "$tmp/t0b" && cmp -s "$tmp/t0" "$tmp/t0b" &&
  pass "mtp 0: the same table" || fail "mtp 0: the same table"

# MTP-3, L = 2.5 on the toy specs, P = 4, B = 16: T = 16·4 = 64 tokens; C = 1 − (60/64)^64;
# weight read = (C·1.92e9 + 0.48e9)/4/2e12 s; compute = 2·0.2e9·64/(4·1e15) s = 0.0064 ms;
# TPOT = floor/2.5; tok/s per sequence 1000/TPOT, total 16× that; M_e = 64·4/64 = 4;
# dispatch = (64/4)·2.734375·1000 B = 43750. Without MTP, the B = 16 figures above (T = 16).
run_ok "mtp: toy json" "$tmp/m.json" plan --model "$tmp/toy-moe.json" --gpu "$tmp/toy-gpu.json" --ep 4 \
  --batch 1,16,256 --tpot-sla 20.00005ms --mtp 3 --accept 2.5 --json
json_code "mtp: step of B x (N + 1) tokens at B=16" "$tmp/m.json" "
r = j['rows'][1]; C = 1 - (60/64)**64; wr = (C*1.92e9 + 0.48e9)/4/2e12*1e3
ok = (j['mtp'] == 3 and j['accept_length'] == 2.5 and j['accept_length_is_bound'] is False and
r['batch'] == 16 and r['mtp_tokens_per_step'] == 64 and r['accept_length'] == 2.5 and close(r['coverage'], C, 1e-12) and
r['tokens_per_gpu'] == 16 and r['expected_rows_per_expert'] == 4 and r['dispatch_bytes_per_gpu'] == 43750 and
close(r['weight_read_ms'], wr) and close(r['compute_ms'], 0.0064) and close(r['floor_ms'], wr) and
close(r['tpot_ms'], wr/2.5) and close(r['tokens_per_s_per_seq'], 2.5e3/wr) and close(r['tokens_per_s'], 16*2.5e3/wr))"
json_code "mtp: the same B without MTP, next to it" "$tmp/m.json" "
r = j['rows'][1]; C = 1 - (60/64)**16; wr = (C*1.92e9 + 0.48e9)/4/2e12*1e3
ok = (close(r['tpot_ms_no_mtp'], wr) and close(r['tokens_per_s_per_seq_no_mtp'], 1e3/wr) and
close(r['tokens_per_s_no_mtp'], 16e3/wr) and close(r['mtp_speedup'], wr/r['tpot_ms']) and
r['no_mtp']['mtp_tokens_per_step'] == 16 and close(r['no_mtp']['coverage'], C, 1e-12) and r['no_mtp']['dispatch_bytes_per_gpu'] == 10937.5)"
# Knee in sequences: 3000 tokens / 4 = 750. B_mem as without MTP, 8242.1875 (KV of B sequences).
# B_SLA: TPOT = compute/2.5 = 1e-4·4B/2.5 ms = 1.6e-4·B <= 20.00005 ⇔ B <= 125000.3: 125000.
# Operating point 750 (knee); its step has 3000 tokens, M_e = 3000·4/64 = 187.5.
json_check "mtp: knee, B_mem, B_SLA from TPOT, operating point, padding M_e" "$tmp/m.json" "
close(j['knee_batch'], 750) and close(j['batch_mem'], 8242.1875) and j['batch_sla'] == 125000 and
j['operating_point'] == 750 and j['binding'] == 'knee' and j['padding'][0]['expected_m'] == 187.5"
run_ok "mtp: default accept json" "$tmp/m4.json" plan --model qwen3.5-397b-a17b --batch 8 --mtp 3 --json
json_check "mtp: L defaults to N + 1, flagged as the bound" "$tmp/m4.json" \
  "j['accept_length'] == 4 and j['accept_length_is_bound'] is True and close(j['rows'][0]['tpot_ms'], j['rows'][0]['floor_ms']/4)"
run_ok "mtp: table" "$tmp/mt" plan --model qwen3.5-397b-a17b --batch 1,8,32 --mtp 3 --accept 3.1 --tpot-sla 1.5ms
if grep -q "MTP-3: each sequence verifies 4 tokens per step and advances by L = 3.1" "$tmp/mt" &&
   grep -q "^without MTP" "$tmp/mt" && grep -qE "^ +8 \| +1\.608! .* \| +1\.742! .* \| +1\.08x" "$tmp/mt" &&
   grep -q "largest B with TPOT = floor / L <= 1.5 ms" "$tmp/mt"; then pass "mtp: table with and without, SLA on TPOT"
else fail "mtp: table with and without, SLA on TPOT"; cat "$tmp/mt"; fi
run_ok "mtp: table, default L" "$tmp/mt4" plan --model qwen3.5-397b-a17b --batch 8 --mtp 3
grep -q "L = 4 on average (N + 1: the optimistic bound" "$tmp/mt4" && pass "mtp: table names the optimistic bound" ||
  { fail "mtp: table names the optimistic bound"; cat "$tmp/mt4"; }

# --- EPLB gain (docs/theory.md §EPLB gain): 1/(0.6/1.18 + 0.4) = 1.10; 1/(0.85/2.6 + 0.15) = 2.10 ---
run_ok "eplb gain 1.10" "$tmp/g1" plan --eplb-gain --f 0.6 --speedup 1.18
grep -q "= 1.101x" "$tmp/g1" && pass "eplb gain prints 1.101x" || { fail "eplb gain prints 1.101x"; cat "$tmp/g1"; }
run_ok "eplb gain 2.10 json" "$tmp/g2.json" plan --eplb-gain --f 0.85 --speedup 2.6 --json
json_check "eplb gain 2.10" "$tmp/g2.json" "round(j['eplb_gain'], 2) == 2.10"

# --- plots ---
if command -v gnuplot > /dev/null; then
  run_ok "plot" "$tmp/p.json" plan --batch 1..1024 --tpot-sla 30ms --json --plot "$tmp/plots"
  for f in plan-floor.png plan-coverage.png; do
    if [ -s "$tmp/plots/$f" ] && [ "$(head -c 4 "$tmp/plots/$f" | tail -c 3)" = PNG ]; then pass "plot writes $f"
    else fail "plot writes $f"; fi
  done
  json_check "plot leaves --json stdout clean" "$tmp/p.json" "j['binding'] in ('knee', 'sla', 'memory')"
  rm -f "$tmp/plots"/*.png
  if bash "$SRC/scripts/plot-plan" "$tmp/plots" > /dev/null 2>&1 && [ -s "$tmp/plots/plan-floor.png" ]; then pass "scripts/plot-plan re-draws"
  else fail "scripts/plot-plan re-draws"; fi
else
  echo "skip plot checks: gnuplot is not installed"
fi
# --- a spec's name never runs a command: backquotes, $(...) and quotes in the model and GPU names
# reach plan.gp as inert characters (the script text is checked with or without gnuplot; the plots,
# and that no payload ran, where gnuplot is installed); a control character (a newline, ESC) in a
# name is refused by the spec reader, and plot-rank's JSON, which is no spec, keeps its newlines ---
python3 - "$tmp" << 'P'
import json, sys
tmp = sys.argv[1]
m = json.load(open(f"{tmp}/toy-moe.json"))
m["name"] = 'm`touch PWNED-backquote` $(touch PWNED-dollar) "q" \'s\' @m {x}; system "touch PWNED-system" #'
json.dump(m, open(f"{tmp}/evil-moe.json", "w"))
m["name"] = 'm\nsystem "touch PWNED-newline"\n#'
json.dump(m, open(f"{tmp}/ctl-moe.json", "w"))
g = json.load(open(f"{tmp}/toy-gpu.json"))
g["name"] = "g`touch PWNED-gpu`; system 'touch PWNED-gpu-system'; print \"\\\" `touch PWNED-escape`"
json.dump(g, open(f"{tmp}/evil-gpu.json", "w"))
g["name"] = "g\x1b[31mred"
json.dump(g, open(f"{tmp}/ctl-gpu.json", "w"))
rows = [{"model": "x`touch PWNED-rank`'\nsystem 'touch PWNED-rank-newline'\n", "routing": "uniform", "eplb": False,
         "batch": b, "step_us": 100.0 * b, "floor_us": 50.0 * b, "ratio": 2.0, "clock_step_ratio": 1.9}
        for b in (1, 8, 64)]
json.dump({"rows": rows}, open(f"{tmp}/evil-rank.json", "w"))
P
mkdir -p "$tmp/cwd"
expect_error "a newline in a model's name is refused" "holds the control character 0x0A" plan --model "$tmp/ctl-moe.json"
expect_error "ESC in a GPU's name is refused" "holds the control character 0x1B" plan --gpu "$tmp/ctl-gpu.json"
evil=(plan --model "$tmp/evil-moe.json" --gpu "$tmp/evil-gpu.json" --ep 4 --batch 1..64)
(cd "$tmp/cwd" && PATH=/nonexistent "$MOEKIT" "${evil[@]}" --plot "$tmp/evil-script" > /dev/null 2>&1)
(cd "$tmp/cwd" && PATH=/nonexistent "$MOEKIT" plan --model "$tmp/toy-moe.json" --gpu "$tmp/toy-gpu.json" --ep 4 \
  --batch 1..64 --plot "$tmp/plain-script" > /dev/null 2>&1)
gp="$tmp/evil-script/plan.gp"
if [ -f "$gp" ] && ! grep '^set title' "$gp" | grep -q '[`$@{}\\]' &&
   [ "$(wc -l < "$gp")" = "$(wc -l < "$tmp/plain-script/plan.gp")" ] &&
   [ "$(grep -c '^set title "[A-Za-z0-9 .,:()=+/_?-]*" noenhanced$' "$gp")" = 2 ] &&
   grep -q '^set title "m?touch PWNED-backquote? ?(touch PWNED-dollar) ?q? ?s? ?m ?x?? system ?touch' "$gp"; then
  pass "hostile spec names: plan.gp holds them as inert text, no line added"
else
  fail "hostile spec names: plan.gp holds them as inert text, no line added"; grep -n title "$gp"
fi
if command -v gnuplot > /dev/null; then
  (cd "$tmp/cwd" && "$MOEKIT" "${evil[@]}" --plot "$tmp/evil-plot" > /dev/null 2> "$tmp/stderr")
  rc=$?
  scripts=$(cd "$SRC/scripts" && pwd)
  (cd "$tmp/cwd" && bash "$scripts/plot-plan" "$tmp/evil-plot" > /dev/null 2>&1) || rc=$?
  (cd "$tmp/cwd" && python3 "$scripts/plot-rank" "$tmp/evil-rank.json" "$tmp/evil-rank.png" > /dev/null 2>&1) || rc=$?
  (cd "$tmp/cwd" && python3 "$scripts/plot-rank" --ratio "$tmp/evil-ratio.png" "$tmp/evil-rank.json" > /dev/null 2>&1) ||
    rc=$?
  if [ $rc -eq 0 ] && [ -s "$tmp/evil-plot/plan-floor.png" ] && [ -s "$tmp/evil-plot/plan-coverage.png" ] &&
     [ -s "$tmp/evil-rank.png" ] && [ -s "$tmp/evil-ratio.png" ]; then
    pass "hostile spec names: the plots still come out (plan --plot, plot-plan, plot-rank and its --ratio)"
  else fail "hostile spec names: the plots still come out (exit $rc)"; cat "$tmp/stderr"; fi
  if [ -z "$(find "$tmp" -name 'PWNED*')" ]; then pass "hostile spec names: no payload ran (plan --plot, plot-plan, plot-rank)"
  else fail "hostile spec names: no payload ran"; find "$tmp" -name 'PWNED*'; fi
else
  echo "skip hostile-name plot checks: gnuplot is not installed"
fi
# Without gnuplot on PATH: a clear error, and the data and script are still written.
PATH=/nonexistent "$MOEKIT" plan --plot "$tmp/noplot" > /dev/null 2> "$tmp/stderr"
rc=$?
if [ $rc -eq 2 ] && grep -q "gnuplot is not installed" "$tmp/stderr" && [ -f "$tmp/noplot/plan.gp" ]; then pass "plot without gnuplot: clear error"
else fail "plot without gnuplot: clear error (exit $rc)"; cat "$tmp/stderr"; fi
PATH=/nonexistent /bin/bash "$SRC/scripts/plot-plan" "$tmp/noplot" > /dev/null 2> "$tmp/stderr"
if [ $? -ne 0 ] && grep -q "gnuplot is not installed" "$tmp/stderr"; then pass "scripts/plot-plan without gnuplot: clear error"
else fail "scripts/plot-plan without gnuplot: clear error"; cat "$tmp/stderr"; fi
# scripts/plot-timeline --breakdown: a stage clock's pieces, from numbers set here; a fused run above
# fused_max_tokens tokens per rank is marked as run staged, and a hostile model name stays text.
python3 - "$tmp" << 'P'
import json, sys
st = lambda n, b, e: {"stage": n, "start_us": b, "end_us": e}
tl = lambda model, b, pipe: {"model": model, "pipeline": pipe, "batch": b, "layer": 0, "span_us": 0, "stages": [
    st("gate", 0, 1), st("dispatch send", 1.5, 8), st("dispatch receive", 2, 12), st("GEMM1", 10, 60),
    st("GEMM2", 40, 90), st("combine send", 85, 95), st("combine receive", 150, 154)]}
json.dump({"ranks": 8, "fused_max_tokens": 128,
           "timelines": [tl("m", 64, "fused"), tl("x`touch PWNED-tl`\nz", 2048, "fused")]},
          open(f"{sys.argv[1]}/tl.json", "w"))
P
(cd "$tmp/cwd" && python3 "$SRC/scripts/plot-timeline" --breakdown "$tmp/tl.json" > "$tmp/tl.txt" 2>&1)
# head 10, GEMMs 80 (10 -> 90), tail 5 (90 -> 95), c.recv 4, busy 95 + 4 = 99, streaming 80 / 99.
if grep -Eq '^m +fused +64 +10\.0 +80\.0 +5\.0 +4\.0 +99\.0 +81%$' "$tmp/tl.txt" &&
   grep -Eq ' staged\* +2048 ' "$tmp/tl.txt" && [ -z "$(find "$tmp" -name 'PWNED-tl*')" ] &&
   [ "$(wc -l < "$tmp/tl.txt")" -eq 3 ]; then pass "plot-timeline --breakdown: head, GEMMs, tail, receive, busy and share"
else fail "plot-timeline --breakdown"; cat "$tmp/tl.txt"; fi

# --- speed: 20 batch sizes, the whole command (informational; test_plan asserts the 50 ms) ---
start=$(date +%s%N)
"$MOEKIT" plan --batch 1..524288 --tpot-sla 30 --json > /dev/null
echo "info: moekit plan, 20 batch sizes, whole process: $(( ($(date +%s%N) - start) / 1000000 )) ms"

# --- bad flags ---
expect_error "ep 0" "--ep = 0 must be >= 1" plan --ep 0
expect_error "ep negative" "--ep = -4 must be >= 1" plan --ep -4
expect_error "ep not a number" "--ep" plan --ep abc
expect_error "ep not dividing E" "--ep = 7 must divide num_routed_experts = 256" plan --ep 7
expect_error "empty batch list" "--batch: an empty value" plan --batch ""
expect_error "batch 0" "batch 0 must be >= 1" plan --batch 0,8
expect_error "negative batch" "batch -3 must be >= 1" plan --batch=-3
expect_error "batch not a number" "'x' is not an integer" plan --batch 8,x
expect_error "backwards range" "runs backwards" plan --batch 64..8
expect_error "mem-fraction 0" "--mem-fraction = 0 must be in (0, 1]" plan --mem-fraction 0
expect_error "mem-fraction 1.5" "--mem-fraction = 1.5 must be in (0, 1]" plan --mem-fraction 1.5
expect_error "unknown dtype" "--dtype 'fp16' is unknown: expected fp8 or bf16" plan --dtype fp16
expect_error "bad sla" "--tpot-sla 'fast' is not a duration" plan --tpot-sla fast
expect_error "negative sla" "--tpot-sla '-3ms' must be > 0" plan --tpot-sla=-3ms
expect_error "context 0" "--context = 0 must be >= 1" plan --context 0
expect_error "unknown model" "unknown model 'nope'" plan --model nope
expect_error "missing spec file" "cannot open spec file" plan --gpu "$tmp/none.json"
echo '{"name": "bad-gpu", "hbm_bytes": 1e9}' > "$tmp/bad-gpu.json"
expect_error "invalid custom spec" "missing field 'hbm_bandwidth'" plan --gpu "$tmp/bad-gpu.json"
touch "$tmp/afile"
expect_error "plot dir under a file" "--plot '$tmp/afile/x': cannot create the directory" plan --plot "$tmp/afile/x"
[ ! -s "$tmp/stdout" ] && pass "plot dir error prints no table" || fail "plot dir error prints no table"
expect_error "mtp -1" "--mtp = -1 must be in [0, 64]" plan --mtp=-1
expect_error "mtp huge" "--mtp = 100 must be in [0, 64]" plan --mtp 100
expect_error "mtp beyond int" "--mtp = 99999999999999999999" plan --mtp 99999999999999999999
expect_error "mtp not a number" "--mtp = abc" plan --mtp abc
expect_error "mtp fractional" "--mtp = 2.5" plan --mtp 2.5
expect_error "accept 0" "--accept = 0 must be in [1, N + 1] = [1, 4] with --mtp 3" plan --mtp 3 --accept 0
expect_error "accept above N + 1" "--accept = 4.5 must be in [1, N + 1] = [1, 4] with --mtp 3" plan --mtp 3 --accept 4.5
expect_error "accept without mtp" "--accept = 2 must be in [1, N + 1] = [1, 1] with --mtp 0" plan --accept 2
expect_error "accept not a number" "--accept = abc" plan --mtp 3 --accept abc
expect_error "accept nan" "--accept = nan" plan --mtp 3 --accept nan
expect_error "accept huge" "--accept = inf" plan --mtp 3 --accept 1e400
expect_error "f without eplb-gain" "--f and --speedup go with --eplb-gain" plan --f 0.5
expect_error "eplb-gain without speedup" "--eplb-gain needs --speedup" plan --eplb-gain --f 0.6
expect_error "eplb-gain f out of range" "--f = 1.5 must be in [0, 1]" plan --eplb-gain --f 1.5 --speedup 2

# --- expert weight formats: FP8 and MXFP4 floors side by side ---
run_ok "gpt-oss-120b table" "$tmp/oss-table" plan --model gpt-oss-120b --ep 1 --batch 1,64,1024
if grep -q "MXFP4 0.531250 B/param" "$tmp/oss-table" && grep -q "FP8   1.000244 B/param" "$tmp/oss-table" &&
   grep -q "MXFP4/FP8" "$tmp/oss-table" && grep -qE "^ +1024 \|.*\| +0\.536x$" "$tmp/oss-table"; then
  pass "gpt-oss-120b: FP8 and MXFP4 floors side by side, 0.536x at full coverage"
else fail "gpt-oss-120b: FP8 and MXFP4 floors side by side"; cat "$tmp/oss-table"; fi
run_ok "gpt-oss-120b json" "$tmp/oss.json" plan --model gpt-oss-120b --ep 1 --batch 1,1024 --json
# routed = 36·128·3·2880² = 114,661,785,600 parameters; other = 116.8e9·0.53 − routed·0.53 bytes
json_code "gpt-oss-120b: routed bytes per format, floors by hand" "$tmp/oss.json" "
routed = 36 * 128 * 3 * 2880 ** 2; other = 116.8e9 * 0.53 - routed * 0.53; f = j['expert_formats']
ok = ([x['format'] for x in f] == ['fp8', 'mxfp4'] and close(f[0]['routed_weight_bytes'], routed * (1 + 4 / 16384)) and
close(f[1]['routed_weight_bytes'], routed * 0.53125) and
close(f[1]['rows'][1]['weight_read_ms'], (j['rows'][1]['coverage'] * routed * 0.53125 + other) / j['hbm_bandwidth'] * 1e3))"

finish "plan CLI"
