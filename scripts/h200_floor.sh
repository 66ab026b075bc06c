#!/usr/bin/env bash
# Issue 37 on one H200 (docs/RESULTS.md, session 16): the decode's combine under the GPU gates, where a step's time
# goes, and the gate suite from a cold machine. PARTS (default: all, in this order):
#   tests     tests/test_triton_decode.py natively on the GPU
#   probe     scripts/probes/skinny_gemm.py: the 1.5B shape's projections, a Triton skinny GEMM's tilings vs cuBLAS
#   psteps    bench/profile_steps.py at 32 rows (pure decode, loaded at chunk 512)
#   served    the smoke golden and served records of the GPU gate runs rewritten (after an intended change of what
#             is served); they come back in $OUT/served/ to be committed
#   gates     the whole GPU gate suite, serial, from an empty compile cache (a fresh CI runner)
#   gates_n4  the same with -n 4, from an empty compile cache again
#   graphs    the graph and smoke gates of the flash configuration alone (the check after a capture failure)
#   c512 nano32 steps   scripts/h200_loaded.sh's parts of those names (closed 200 beside nano-vllm, the step timings)
# carry: .device/fa_built (flash-attn built by an earlier call), .device/nano-vllm (for nano32)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs" "$OUT/served"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
M15=qwen2.5-1.5b-random
export STEPGATE_FLASH_ATTN_PATH=$PWD/.device/fa_built/src:$PWD/.device/fa_built/ext
want() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
part() {   # part NAME MAX_SECONDS CMD...: its exit status and time go to status.txt
  local name=$1 max=$2; shift 2
  want "$name" || return 0
  local left=$(( DEADLINE - $(date +%s) ))
  (( left < max )) && max=$left
  if (( max < 15 )); then echo "$name: not run (deadline)" >> "$OUT/logs/status.txt"; return; fi
  local t0=$(date +%s)
  timeout -s INT -k 15 "$max" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - t0 ))s (limit ${max}s)" >> "$OUT/logs/status.txt"
}
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1 2>/dev/null; } > "$OUT/logs/env.log"
part tests 120 python3 -m pytest tests/test_triton_decode.py -q -p no:cacheprovider -rfEs
part probe 120 python3 -m scripts.probes.skinny_gemm --out "$OUT/probe.json"
part psteps 90 python3 -m bench.profile_steps --model $M15 --rows 32 --kinds pure-decode,loaded --steps 30 \
  --out "$OUT/psteps.json"
if want served; then
  part served 150 bash -c "python3 -m gates.golden regen --model small-trained --workload smoke-cpu --reference hf \
    --device cuda --dtype float16 && python3 -m pytest -q -p no:cacheprovider gates/test_smoke.py::test_smoke \
    --regen-golden --device cuda --model small-trained --dtype float16 && python3 -m pytest -q -p no:cacheprovider \
    gates/test_smoke.py::test_smoke --regen-golden --device cuda --dtype float32 --backend torch,flex"
  cp golden/qwen2-small-trained/smoke-cpu/served-cuda-float16.json golden/qwen2-small/smoke-cpu/served-cuda-float32.json \
    "$OUT/served/" 2>> "$OUT/logs/status.txt"
fi
gates() {   # gates NAME ARGS...: the GPU gate suite from an empty compile cache
  local name=$1; shift
  rm -rf /tmp/sg-cache-$name
  part "$name" 330 env STEPGATE_COMPILE_CACHE=/tmp/sg-cache-$name python3 -m pytest gates/ --device cuda \
    --model small-trained -p no:cacheprovider -q -rfEs --durations=30 "$@"
}
gates gates
gates gates_n4 -n 4
part graphs 240 python3 -m pytest gates/test_graphs.py gates/test_smoke.py --device cuda --model small-trained \
  -p no:cacheprovider -q -rfEs -k flash
LOADED=""
for p in c512 nano32 steps; do want $p && LOADED="$LOADED $p"; done
if [ -n "$LOADED" ]; then   # nanoprep: nano-vllm's model files and compile cache, before its timed cold pass
  left=$(( DEADLINE - $(date +%s) - 10 ))
  if (( left > 60 )); then
    OUT="$OUT/loaded" PARTS="nanoprep$LOADED" BUDGET_S=$left bash scripts/h200_loaded.sh > "$OUT/logs/loaded.log" 2>&1
    echo "loaded ($LOADED): rc=$?" >> "$OUT/logs/status.txt"
  else
    echo "loaded ($LOADED): not run (deadline)" >> "$OUT/logs/status.txt"
  fi
fi
cat "$OUT/logs/status.txt"
# one archive back: a call returns a limited count of files
tar czf "$OUT/floor.tgz" -C "$OUT" logs served loaded $(cd "$OUT" && ls *.json 2>/dev/null) 2>/dev/null
grep -hE "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT"/logs/tests.log "$OUT"/logs/gates*.log "$OUT"/logs/graphs.log \
  2>/dev/null | tail -20
grep -A12 "fastest per shape" "$OUT/logs/probe.log" 2>/dev/null
grep -E "^(pure-decode|loaded):|^  [a-z]" "$OUT/logs/psteps.log" 2>/dev/null | head -6
