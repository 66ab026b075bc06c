#!/usr/bin/env bash
# Issue 18 on one H200, one device call (under 8 minutes): captured loaded and chunk-only steps, their gates, and
# the "Must show" figures with nano-vllm beside them; the results table (scripts/probes/loaded_table.py) is printed last.
#   needs: STEPGATE_FLASH_ATTN_PATH (flash-attn's src:ext folders); nano-vllm's archive, xxhash wheel and
#          run_peer.py in .device/nano-vllm/ (else shared/peers/nano-vllm/ or ../shared/peers/nano-vllm/)
#   back under $OUT (3 files): table.md (the table and each part's exit status), table.json, results.tgz (every
#          log, bench summary/runs/steps, the step benchmarks' JSON, gate summaries, nano-vllm's rows, profiles)
#   knobs: BUDGET_S (460: the deadline for all parts), REPS (2: measured runs of c512; 1 for c8192),
#          REPS_R512 (1: measured runs of r512, whose figure moved most between calls),
#          PARTS (all: the parts below to run, by name)
# Phase 1, untimed, side by side on the GPU (nothing in it is a timing):
#   planted    tests/test_step_graphs.py and test_graph_buffers.py on the GPU (fp16): captured vs eager, stale
#              metadata sections caught, a poisoned over-read caught
#   gates15b   gates/test_graphs.py on the 1.5B shape, mixed-gate: captured vs uncaptured (decode + loaded + chunk-only)
#   overlap    tests/test_overlap.py (cuda mode: steps launched ahead emit the serial engine's tokens; planted wrong
#              token sources caught) and the overlap gate of gates/test_graphs.py, on the GPU
#   nanoprep   nano-vllm on one request: writes its random-weight model files and fills the compile cache, so
#              that its timed runs below start warm
# Phase 2, timed, one part at a time (each under `timeout`, SIGINT first so pytest and the benches write what they
# have, with its own limit cut to what is left before the deadline; a failing part does not stop the next):
#   c512       bench.serving flash, closed mixed 200, 128 new tokens, 32 rows, chunk 512, graphs on (the default)
#   nano32     nano-vllm, 32 sequences, 200 requests, 128 new tokens (cold pass, then warm)
#   c8192      the same as c512 at chunk 8192
#   c8192-serial   c8192 with --overlap off: no step launched ahead (the overlap's A/B, in the same call)
#   r512       the same at 512 rows and chunk 16384 (nano-vllm's batched-token budget); its limit allows for a
#              graph capture of 35 s an engine (session 21: 95 s cut the measured run)
#   nano512    nano-vllm, 512 sequences
#   profile    scripts/probes/profile_decode.py: where a 32-row pure decode step's time goes (host parts, device kernels)
#   steps      gates/test_step_timings.py on the 1.5B shape, flash: every step kind graphed and eager, ratio gates
#   c512eager  c512 with --cuda-graphs off (one run), for graphs on vs off in the same call
#   psteps     bench/profile_steps.py: each step kind's device time by kernel family at the step bench's state
#   psteps512  bench/profile_steps.py at 512 rows and a 16,384-position chunk (the worst case of r512's loaded step:
#              its chunk follows 16,383 cached positions)
#   ptrace512  scripts/probes/profile_trace.py: the r512 run's own steps (its second pass), each profiled alone, by family
#   c512-splitkv, c8192-splitkv, r512-splitkv   c512 / c8192 / r512 with --decode-kernel flash
#              (EngineConfig.decode_kernel: flash-attn's split-KV decode instead of the default Triton one: the
#              decode kernel's A/B against the parts above)
# Phase 1 also has (by name only, not in the default list):
#   triton     tests/test_triton_decode.py natively on the GPU, then the flash token, graph and page-safety gates
#              (their flash decode is the Triton kernel, the default)
# Phase 2 runs in this order: psteps, then the issue's figures (c512 nano32 c8192 c8192-serial r512 nano512), then
# what the deadline may cut (psteps-noappend psteps512 ptrace512 profile steps steps-noappend c512-eager).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
RES=results/h200-loaded
mkdir -p "$OUT" "$RES/logs"
: > "$RES/logs/status.txt"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-460} ))
M15=qwen2.5-1.5b-random
REPS=${REPS:-2}
REPS_R512=${REPS_R512:-1}
part() {   # part NAME MAX_SECONDS CMD...: its exit status goes to status.txt (parts may run in the background)
  local name=$1 max=$2; shift 2
  [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $name "* ]] || return 0
  local left=$(( DEADLINE - $(date +%s) ))
  (( left < max )) && max=$left
  if (( max < 15 )); then echo "$name: not run (deadline)" >> "$RES/logs/status.txt"; return; fi
  local t0=$(date +%s)
  timeout -s INT -k 20 "$max" "$@" > "$RES/logs/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - t0 ))s (limit ${max}s)" >> "$RES/logs/status.txt"
}
bench() {  # bench NAME MAX_SECONDS ARGS...: closed mixed 200, 128 new tokens, flash, results in $RES/NAME
  local name=$1 max=$2; shift 2
  part "$name" "$max" python3 -m bench.serving --model $M15 --device cuda --engine flash --out "$RES/$name" \
    --no-progress --closed --batches 200 --uniform "" --new-tokens 128 "$@"
}
nano() {   # nano NAME MAX_SECONDS SEQS REQUESTS NEW_TOKENS
  if [ -z "$NANO" ]; then echo "$1: not run (no nano-vllm here)" >> "$RES/logs/status.txt"; return; fi
  part "$1" "$2" env FLASH_ATTN_PATH="${STEPGATE_FLASH_ATTN_PATH:-}" python3 "$NANO/run_peer.py" \
    --max-num-seqs "$3" --requests "$4" --new-tokens "$5" --json "$RES/$1.json"
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "from kernels.flash_backend import _import_flash as f; m, why = f(); print('flash-attn', m.__version__ if m else why)"
  git log --oneline -1; } > "$RES/logs/env.log" 2>&1
NANO=""
for d in .device/nano-vllm shared/peers/nano-vllm ../shared/peers/nano-vllm; do
  [ -f "$d/run_peer.py" ] && ls "$d"/nano-vllm-*.tar.gz > /dev/null 2>&1 && { NANO=$d; break; }; done
if [ -n "$NANO" ]; then
  { mkdir -p /tmp/nanovllm && tar xzf "$NANO"/nano-vllm-*.tar.gz -C /tmp/nanovllm --strip-components=1 \
    && python3 -m pip install -q --no-index --no-deps --target /tmp/nanovllm-site "$NANO"/xxhash-*.whl; } \
    > "$RES/logs/nano_setup.log" 2>&1 || NANO=""
fi

part planted 120 python3 -m pytest tests/test_step_graphs.py tests/test_graph_buffers.py --device cuda -k "cuda" -q \
  -p no:cacheprovider -rs &
part gates15b 120 python3 -m pytest gates/test_graphs.py --device cuda --model $M15 -k "mixed" \
  -q -p no:cacheprovider -rs --gate-summary "$RES/gate_summary_15b.json" &
nano nanoprep 120 32 1 8 &
part overlap 150 python3 -m pytest tests/test_overlap.py gates/test_graphs.py --device cuda --model small-trained \
  -k "cuda or overlap" -q -p no:cacheprovider -rs &
[[ " ${PARTS:-} " == *" triton "* ]] && part triton 240 bash -c \
  "python3 -m pytest tests/test_triton_decode.py --device cuda -q -p no:cacheprovider -rs && python3 -m pytest \
  gates/test_tokens.py gates/test_graphs.py gates/test_page_safety.py --device cuda --model small-trained -k flash \
  -q -p no:cacheprovider -rs --gate-summary $RES/gate_summary_triton.json" &
wait

part psteps 60 python3 -m bench.profile_steps --model $M15 --rows 32 --out "$RES/profile_steps.json"
bench c512 100 --chunk-tokens 512 --warmups 1 --reps "$REPS"
nano nano32 80 32 200 128
bench c8192 80 --chunk-tokens 8192 --warmups 1 --reps 1
bench c8192-serial 80 --chunk-tokens 8192 --overlap off --warmups 1 --reps 1
bench r512 $(( 120 + 20 * REPS_R512 )) --chunk-tokens 16384 --max-batch 512 --warmups 1 --reps "$REPS_R512"
nano nano512 80 512 200 128
part psteps512 90 python3 -m bench.profile_steps --model $M15 --rows 512 --chunk 16384 --kinds loaded,chunk-only \
  --steps 10 --out "$RES/profile_steps_512.json"
part ptrace512 120 python3 -m scripts.probes.profile_trace --model $M15 --rows 512 --chunk 16384 --steps 40 \
  --out "$RES/profile_trace_512.json"
part profile 50 python3 -m scripts.probes.profile_decode --model $M15 --device cuda --steps 30 --out "$RES/profile"
part steps 80 env STEPGATE_BENCH_ROUNDS=20 python3 -m pytest gates/test_step_timings.py --device cuda \
  --model $M15 -k "(flash or graphed) and not flex" -q -p no:cacheprovider -rs \
  --benchmark-json "$RES/steps.json" --benchmark-columns=median,iqr,rounds
bench c512-eager 60 --chunk-tokens 512 --cuda-graphs off --warmups 0 --reps 1
bench c512-splitkv 100 --chunk-tokens 512 --decode-kernel flash --warmups 1 --reps 1
bench c8192-splitkv 80 --chunk-tokens 8192 --decode-kernel flash --warmups 1 --reps 1
bench r512-splitkv 90 --chunk-tokens 16384 --max-batch 512 --decode-kernel flash --warmups 1 --reps 1

python3 -m scripts.probes.loaded_table "$RES" --json "$OUT/table.json" > "$RES/table.md" 2> "$RES/logs/table.log"
{ echo; echo "parts:"; sed 's/^/  /' "$RES/logs/status.txt"
  for f in planted overlap triton gates15b steps steps-noappend; do
    [ -f "$RES/logs/$f.log" ] && echo "  $f: $(grep -E '[0-9]+ (passed|failed)' "$RES/logs/$f.log" | tail -1)"; done
  for f in c512 c8192 c8192-serial r512 c512-eager c512-splitkv c8192-splitkv r512-splitkv; do
    [ -f "$RES/logs/$f.log" ] && echo "  $f: $(grep -h 'stepgate: ' "$RES/logs/$f.log" | head -2 | tr '\n' ' ')"; done
  grep -h '"prefix_cache"' "$RES"/logs/nano*.log 2>/dev/null | sed 's/^/  /'
  [ -f "$RES/logs/profile.log" ] && tail -4 "$RES/logs/profile.log" | sed 's/^/  /'
  for j in steps steps_noappend; do   # the captured step medians, append on and off
    [ -f "$RES/$j.json" ] && python3 -c "import json, sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    print(f'  {sys.argv[2]}: {b[\"name\"]} {b[\"stats\"][\"median\"] * 1e3:.3f} ms')" "$RES/$j.json" "$j"; done
  for f in psteps psteps-noappend psteps512 psteps-splitkv ptrace512; do
    [ -f "$RES/logs/$f.log" ] && { echo "  $f:"; grep -E "wall|ms;" "$RES/logs/$f.log" | sed 's/^/    /'; }; done
} >> "$RES/table.md"
cp "$RES/table.md" "$OUT/table.md"
tar czf "$OUT/results.tgz" "$RES" 2>/dev/null
cat "$OUT/table.md"
