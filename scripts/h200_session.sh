#!/usr/bin/env bash
# One device call on the H200 that makes the GPU goldens, runs the gates and the benchmarks, and brings back one
# archive. Parts run in priority order under one deadline, so a slow part cannot starve the summary.
#   carry: .device/flash_attn (the flash-attn sdist and its build script)
# It regenerates the GPU goldens on purpose (regen prints what moved against the committed ones); to gate against
# the committed goldens instead, drop the regen_* parts.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" logs
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
M15=qwen2.5-1.5b-random
declare -a SUMMARY
part() {   # part NAME MAX_SECONDS CMD...
  local name=$1 max=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) - 15 ))
  (( left < max )) && max=$left
  if (( max < 10 )); then SUMMARY+=("$name: not run (deadline)"); return; fi
  local t0=$(date +%s)
  timeout "$max" "$@" > "logs/$name.log" 2>&1
  local rc=$?
  SUMMARY+=("$name: rc=$rc in $(( $(date +%s) - t0 ))s (limit $max)")
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > logs/gpu.txt 2>&1
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> logs/gpu.txt 2>&1
# flash-attn builds on the CPUs while the GPU makes the torch-backend goldens
( python3 .device/flash_attn/build_flash_attn.py .device/flash_attn/flash_attn-2.8.3.post2.tar.gz --arch 90 \
    --workdir /tmp/fa > logs/flash_build.log 2>&1; echo $? > logs/flash_build.rc ) &
BUILD=$!
part regen_small 170 python3 -m gates.golden regen --device cuda --dtype float16 --reference hf --reference chunked --reference fused
part bench_fused_15b 120 python3 -m engine.bench --model $M15 --device cuda --engine fused --out results --no-progress \
    --closed --batches 32 --uniform "" --warmups 1 --reps 3
wait $BUILD
export STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext
part regen_small_flash 60 python3 -m gates.golden regen --device cuda --dtype float16 --reference flash
# token, poison and page-safety gates first: the kernel gates are the long tail and run last
part gates_small 170 python3 -m pytest gates/test_tokens.py gates/test_page_safety.py gates/test_prefill_share.py \
    --device cuda --backend torch,flash -q -p no:cacheprovider --gate-summary logs/gate_summary_small.json
part regen_15b 150 python3 -m gates.golden regen --model $M15 --workload mixed-gate --device cuda --dtype float16 \
    --reference hf --reference chunked --reference fused --reference flash
part gates_15b 120 python3 -m pytest gates/test_tokens.py --device cuda --model $M15 --backend torch,flash -q \
    -p no:cacheprovider -k "against_hf and mixed or predecessor" --gate-summary logs/gate_summary_15b.json
part bench_flash_15b 110 python3 -m engine.bench --model $M15 --device cuda --engine flash --out results --no-progress \
    --closed --peer --batches 32 --uniform "" --warmups 1 --reps 3
part kernel_bench 40 python3 scripts/kernel_bench.py --out results/kernel_bench.csv
part kernel_gates 150 python3 -m pytest gates/test_kernels.py tests/test_planted_kernels.py --device cuda -q -p no:cacheprovider
part step_timings 90 env STEPGATE_BENCH_ROUNDS=20 python3 -m pytest gates/test_step_timings.py --device cuda -q -rs \
    -p no:cacheprovider --benchmark-autosave --benchmark-storage=file://golden/benchmarks/h200 \
    --benchmark-columns=median,iqr,rounds
tar czf "$OUT/goldens.tgz" $(find golden -path '*cuda*' -o -path '*qwen2.5-1.5b-random*' -type f) golden/benchmarks 2>/dev/null
tar czf "$OUT/results.tgz" results logs 2>/dev/null
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
for f in logs/gates_small.log logs/gates_15b.log logs/kernel_gates.log; do echo "== $f"; tail -4 "$f"; done
grep -h "closed\|median\|ratio\|peer" logs/bench_*.log | tail -12
tail -12 logs/kernel_bench.log
