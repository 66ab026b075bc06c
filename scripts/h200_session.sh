#!/usr/bin/env bash
# One device call on a machine of one or two H200s: a list of parts per GPU, the two lists side by side, under one
# deadline. Files back in $OUT: gpu0.tgz / gpu1.tgz (every log of that list), results.tgz (the benches'
# results/ folder), goldens.tgz (the smoke workload's GPU goldens), compile-cache.tgz, summary.txt; the summary is
# printed last.
#   carry: .device/fa_built (flash-attn built by ../shared/tools/flash_attn/build_flash_attn.py, unpacked from an
#          earlier call's fa_built.tgz), .device/nano-vllm (the peer: ../shared/peers/nano-vllm) and, if there is
#          one, .device/compile-cache.tgz (an earlier call's compile cache)
#   GPU0_PARTS / GPU1_PARTS: the parts, in order; BUDGET_S (570): the deadline for everything
# Parts:
#   smoke_golden  the smoke workload's hf golden for the trained small model on CUDA (fp16), for the smoke gate
#   gates         the whole GPU gate suite, serial (small-trained, every backend); repeatable: gates gates gates
#   gates_n4      the same with pytest-xdist, 4 workers on this GPU (the serial gates deselected: gates_serial)
#   gates_serial  the serial gates alone (step timings: `-m serial`), as the README's parallel recipe runs them
#   loaded        scripts/h200_loaded.sh (captured loaded steps, the serving bench, nano-vllm beside it)
#   prefix        scripts/h200_prefix.sh (prefix cache on/off, repeated mixed 200, shared prefixes)
#   tp            scripts/h200_tp.sh (both GPUs: tp 2 gates, tp 1 vs tp 2 decode step and closed 200)
#   py:FILE       python3 FILE (an investigation script carried in an ignored folder, e.g. .device/)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
export STEPGATE_FLASH_ATTN_PATH=$PWD/.device/fa_built/src:$PWD/.device/fa_built/ext
export STEPGATE_COMPILE_CACHE=/tmp/stepgate-compile-cache
# the compile cache of an earlier call, as a CI runner keeps it between runs (carry .device/compile-cache.tgz: the
# compile-cache.tgz this script leaves in $OUT); without it the first gate run compiles everything (173 s vs 110 s)
[ -f .device/compile-cache.tgz ] && tar xzf .device/compile-cache.tgz -C /tmp

run_list() {   # run_list GPU PARTS...: each part under what is left of the deadline, logs in /tmp/gpuN/
  local gpu=$1; shift
  local dir=/tmp/gpu$gpu n=0; mkdir -p "$dir"
  for p in "$@"; do
    n=$((n + 1))
    local left=$(( DEADLINE - $(date +%s) - 25 )) t0=$(date +%s) log="$dir/$n-${p##*/}.log"
    if (( left < 30 )); then echo "gpu$gpu $p: not run (deadline)" >> "$dir/status.txt"; continue; fi
    case $p in
      smoke_golden) cmd=(python3 -m gates.golden regen --model small-trained --workload smoke-cpu --reference hf
                         --device cuda --dtype float16) ;;
      gates) cmd=(python3 -m pytest gates/ --device cuda --model small-trained -p no:cacheprovider -q -rfEs
                  --durations=25 --gate-summary "$dir/$n-summary.json") ;;
      gates_n4) cmd=(python3 -m pytest gates/ --device cuda --model small-trained -p no:cacheprovider -q -rfEs
                     -n 4 --gate-summary "$dir/$n-summary.json") ;;
      gates_serial) cmd=(python3 -m pytest gates/ --device cuda --model small-trained -p no:cacheprovider -q -rfEs
                         -m "serial and not slow" --gate-summary "$dir/$n-summary.json") ;;
      loaded) cmd=(env OUT="$dir/loaded" BUDGET_S=$(( left - 10 )) bash scripts/h200_loaded.sh) ;;
      prefix) cmd=(env OUT="$dir/prefix" BUDGET_S=$(( left - 10 )) bash scripts/h200_prefix.sh) ;;
      tp) cmd=(env OUT="$dir/tp" BUDGET_S=$(( left - 10 )) bash scripts/h200_tp.sh) ;;
      py:*) cmd=(python3 "${p#py:}") ;;
      *) echo "gpu$gpu $p: unknown part" >> "$dir/status.txt"; continue ;;
    esac
    if [ "$p" = tp ]; then
      timeout -s INT -k 20 "$left" "${cmd[@]}" > "$log" 2>&1
    else
      CUDA_VISIBLE_DEVICES=$gpu timeout -s INT -k 20 "$left" "${cmd[@]}" > "$log" 2>&1
    fi
    local rc=$?
    echo "gpu$gpu $p: rc=$rc in $(( $(date +%s) - t0 ))s; $(grep -hE '[0-9]+ (passed|failed)' "$log" | tail -1)" \
      >> "$dir/status.txt"
  done
}

{ nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  git log --oneline -1 2>/dev/null; } > "$OUT/summary.txt" 2>&1
run_list 0 ${GPU0_PARTS:-} &
[ -n "${GPU1_PARTS:-}" ] && run_list 1 ${GPU1_PARTS} &
wait
for g in 0 1; do
  [ -d /tmp/gpu$g ] || continue
  cat /tmp/gpu$g/status.txt >> "$OUT/summary.txt"
  tar czf "$OUT/gpu$g.tgz" -C /tmp gpu$g 2>/dev/null
done
tar czf "$OUT/results.tgz" results 2>/dev/null
tar czf "$OUT/goldens.tgz" $(find golden -type f -path '*smoke*cuda*') 2>/dev/null
tar czf "$OUT/compile-cache.tgz" -C /tmp stepgate-compile-cache 2>/dev/null
cat "$OUT/summary.txt"
for g in 0 1; do
  for f in /tmp/gpu$g/*-gates*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^(FAILED|ERROR)" "$f" | head -5; }; done
  for f in /tmp/gpu$g/*/table.md /tmp/gpu$g/*/table.txt; do [ -f "$f" ] && { echo "== $f"; tail -30 "$f"; }; done
done
