#!/usr/bin/env bash
# One device call on the H200, parts chosen by name (PARTS="a b c"; they run in the order given, under one deadline,
# so a slow part cannot starve the summary). Logs, results and goldens come back in $OUT.
#   carry: .device/flash_attn (the flash-attn sdist and its build script)
# Parts:
#   train       train the fp16-robust small model (scripts/train_small_model.py) into golden/models/qwen2-small-trained
#   regen_small regenerate the trained small model's (SMALL=) fp16 GPU goldens (hf, chunked, fused, flash), printing what moved
#   gates_small token, poison, page-safety, prefill-share and graph gates on the small model, every backend
#   planted_gpu captured decode graphs vs eager, padding, and the planted stale block table (tests/test_graph_buffers.py)
#   profile     scripts/profile_decode.py on the 1.5B shape: where a pure decode step's time goes, graphs on/off
#   steps_15b   step-timing benchmarks + ratio gates on the GPU (small and 1.5B), baseline saved per machine
#   slowdown    the same with a planted slowdown, compared against that baseline, and the alert report
#   bench_200   engine.bench flash: closed mixed 32 and 200 (128 new tokens), graphs on, peer beside it
#   bench_eager the same closed runs with graphs off
#   chunks      scripts/chunk_sweep.py: open-loop capacity and token gaps per chunk budget 512..4096 (1.5B, flash)
#   disturb     the disturbance benchmark (1.5B, flash) at chunk budgets 512 and 4096
#   regen_15b / gates_15b   1.5B-shape goldens and token gates
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" logs results
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
M15=qwen2.5-1.5b-random
declare -a SUMMARY
part() {   # part NAME MAX_SECONDS CMD...
  local name=$1 max=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) - 20 ))
  (( left < max )) && max=$left
  if (( max < 10 )); then SUMMARY+=("$name: not run (deadline)"); return; fi
  local t0=$(date +%s)
  # SIGINT first: pytest then prints its summary (and the gate summary) and the benches write what they measured
  timeout -s INT -k 30 "$max" "$@" > "logs/$name.log" 2>&1
  local rc=$?
  SUMMARY+=("$name: rc=$rc in $(( $(date +%s) - t0 ))s (limit $max)")
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > logs/gpu.txt 2>&1
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> logs/gpu.txt 2>&1
( python3 .device/flash_attn/build_flash_attn.py .device/flash_attn/flash_attn-2.8.3.post2.tar.gz --arch 90 \
    --workdir /tmp/fa > logs/flash_build.log 2>&1; echo $? > logs/flash_build.rc ) &
BUILD=$!
export STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext
built=0
need_flash() { if (( built == 0 )); then wait $BUILD; built=1; fi; }
GATE_OPTS=(--device cuda -q -p no:cacheprovider -rs)
for p in ${PARTS:-train}; do
  case $p in
    train) part train 240 bash -c "python3 scripts/train_small_model.py --device cuda --seconds ${TRAIN_S:-110} \
             --out .device/trained && cp .device/trained/* golden/models/qwen2-small-trained/ && mkdir -p $OUT/trained \
             && cp .device/trained/* $OUT/trained/" ;;
    regen_small) need_flash; part regen_small 200 python3 -m gates.golden regen --model ${SMALL:-small-trained} --device cuda --dtype float16 \
             --reference hf --reference chunked --reference fused --reference flash ;;
    gates_small) need_flash; part gates_small 300 python3 -m pytest gates/test_tokens.py gates/test_page_safety.py \
             gates/test_prefill_share.py gates/test_graphs.py --model ${SMALL:-small-trained} "${GATE_OPTS[@]}" --gate-summary logs/gate_summary_small.json ;;
    gates_rest) need_flash; part gates_rest 150 python3 -m pytest gates/test_page_safety.py gates/test_prefill_share.py \
             gates/test_graphs.py tests/test_graph_buffers.py --model ${SMALL:-small-trained} "${GATE_OPTS[@]}" \
             -k "not cpu-emulated" --gate-summary logs/gate_summary_rest.json ;;
    planted_gpu) need_flash; part planted_gpu 200 python3 -m pytest tests/test_graph_buffers.py "${GATE_OPTS[@]}" ;;
    profile) need_flash; part profile 120 python3 scripts/profile_decode.py --model $M15 --device cuda --steps 50 \
             --out results/profile ;;
    steps_15b) need_flash; part steps_15b 200 env STEPGATE_BENCH_ROUNDS=${ROUNDS:-20} python3 -m pytest \
             gates/test_step_timings.py "${GATE_OPTS[@]}" -k "${STEPS_K:-pure-decode or graphed or cheaper}" \
             --benchmark-autosave --benchmark-storage=file://golden/benchmarks/h200 --benchmark-columns=median,iqr,rounds ;;
    slowdown) need_flash; part slowdown 150 bash -c "env STEPGATE_BENCH_ROUNDS=${ROUNDS:-20} STEPGATE_PLANT_SLOWDOWN_MS=1 \
             python3 -m pytest gates/test_step_timings.py --device cuda -q -p no:cacheprovider -k 'pure-decode' \
             --benchmark-autosave --benchmark-storage=file://golden/benchmarks/h200 --benchmark-compare \
             --benchmark-compare-fail=median:10% --benchmark-columns=median,rounds; echo pytest rc=\$?; \
             python3 -m gates.alert --storage golden/benchmarks/h200 --markdown results/alert-planted.md; echo alert rc=\$?" ;;
    bench_200) need_flash; part bench_200 260 python3 -m engine.bench --model $M15 --device cuda --engine flash \
             --out results/graphs --no-progress --closed --peer --batches 32,200 --uniform "" --new-tokens 128 \
             --warmups ${WARM:-1} --reps ${REPS:-3} --peer-warmups ${PEER_WARM:-1} --peer-reps 1 ;;
    bench_eager) need_flash; part bench_eager 120 python3 -m engine.bench --model $M15 --device cuda --engine flash \
             --cuda-graphs off --out results/eager --no-progress --closed --batches 32,200 --uniform "" \
             --new-tokens 128 --warmups 1 --reps 3 ;;
    chunks) need_flash; part chunks 240 python3 scripts/chunk_sweep.py --model $M15 --device cuda --engine flash \
             --chunks 512,1024,2048,4096 --arrivals ${ARRIVALS:-200} --rate 200 --new-tokens 128 --out results/chunk-sweep ;;
    disturb) need_flash; part disturb 200 python3 -m engine.disturbance --model $M15 --device cuda --engine flash \
             --chunk-tokens 512,4096 --out results/disturbance ;;
    regen_15b) need_flash; part regen_15b 150 python3 -m gates.golden regen --model $M15 --workload mixed-gate \
             --device cuda --dtype float16 --reference hf --reference fused --reference flash ;;
    gates_15b) need_flash; part gates_15b 150 python3 -m pytest gates/test_tokens.py gates/test_graphs.py --model $M15 \
             "${GATE_OPTS[@]}" -k "against_hf and mixed or predecessor or graphs_on_vs_off and mixed" \
             --gate-summary logs/gate_summary_15b.json ;;
    *) SUMMARY+=("$p: unknown part") ;;
  esac
done
tar czf "$OUT/goldens.tgz" $(find golden -path '*cuda*' -type f) golden/benchmarks 2>/dev/null
tar czf "$OUT/results.tgz" results logs 2>/dev/null
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
for f in logs/gates_small.log logs/planted_gpu.log logs/gates_15b.log logs/steps_15b.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "passed|failed|Error" "$f" | tail -3; }; done
[ -f logs/train.log ] && { echo "== train"; tail -15 logs/train.log; }
[ -f logs/profile.log ] && tail -4 logs/profile.log
grep -h "closed\|peer " logs/bench_*.log 2>/dev/null | tail -8
grep -h "^|" logs/chunks.log 2>/dev/null | tail -6
