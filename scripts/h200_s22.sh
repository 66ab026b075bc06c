#!/usr/bin/env bash
# Issue 37 on one H200 (sessions 21-22): a change measured against the tree before it, the GPU gate suite from an empty
# compile cache, and the serving figures beside nano-vllm. PARTS (default: all, in this order):
#   tests    tests/test_triton_decode.py, test_mlp_kernel.py and test_linear_kernel.py natively on the GPU (runs while flash-attn builds, if it must)
#   pdlchain scripts/probes/pdl_chain.py: the pure decode step's 28-layer chain at 32 rows in one graph, with and
#            without programmatic dependent launch (kernels/pdl_kernels.py), cuBLAS or split-K projections
#   readfloor  scripts/probes/read_floor.py at 32 rows: each kernel of the pure decode layer against a read of its
#            bytes (session 38: the attention the largest gap), the number any decode change is measured by
#   sweep    scripts/probes/triton_sweep.py at 32 and 200 rows: the served decode against its programs a
#            multiprocessor and warps (session 39: after make_items; session 38's split by equal shares was here)
#   pdlgate  gates/test_graphs.py's PDL gate (the captured steps with PDL against without, small-trained)
#   pdlplant the same run with the plant pdl-no-wait, which must fail it (rc 1, the failure naming PDL)
#   gputests tests/test_graph_buffers.py, test_step_graphs.py and test_overlap.py on the GPU (captured steps)
#   flashgates  the flash configuration's kernel, token, graph, smoke, page safety and request gates (-n 4, from an
#            empty compile cache)
#   blas     scripts/probes/blas_choice.py: the projections under cuBLAS / cuBLASLt, two weight layouts
#   ab       gates.ab, head (this tree) against BASE_TREE (.device/base: the tree before), pure decode and loaded,
#            5 process pairs: the change's figure, both sides in this call
#   psteps   bench/profile_steps.py at 32 rows (pure decode, loaded): where the device time goes now
#   psteps512  bench/profile_steps.py's loaded step at 160 decode rows and chunk 16384: ONE 16k chunk after 16k cached
#            positions (session 33, H100: 77% flash-attn), not the 512-row closed run's prefill steps, which carry
#            several whole prompts (scripts/h200_loaded.sh's ptrace512 profiles those)
#   gateup544  scripts/probes/gate_up_silu.py at a loaded step's 544 rows, wgmma tiles (BLOCK_M 64, 128) against
#            cuBLAS's GEMM + the SiLU-mul kernel (47.5 + 9.2 us a layer on an H100 in session 33)
#   serialk  scripts/probes/splitk_gemm.py --kernel serial: kernels/linear.py's split-K kernel (its last program of a
#            tile adds the splits) for q/k/v, o and down at 8 and 32 rows against cuBLAS, o and down with their norm
#   lingates linab  a copy of this tree with the split-K linear kernel (kernels/linear.py) the default on CUDA
#            (/tmp/linflip): its kernel, smoke, token, graph and page safety gates (flash, -n 4), and gates.ab of its pure
#            decode step against this tree (EngineConfig.linear_kernel's default decided by the figure)
#   pdllinab pdlab pdlgates  gates.ab of a copy of this tree with programmatic dependent launch (EngineConfig.pdl)
#            and the split-K projections the defaults (/tmp/pdllinflip), pure decode; of a copy with PDL alone
#            (/tmp/pdlflip), pure decode and loaded; the first copy's kernel, smoke, token, graph and page safety gates
#            (flash, -n 4)
#   gateupbig  the same at a prefill step's 4,096 and 16,384 rows (8 layers' weights): the SiLU-mul fused into the
#            GEMM saves writing and reading back the gate/up output, if the Triton GEMM comes near cuBLAS's there
#   ptrace512  scripts/probes/profile_trace.py: the 512-row closed run's own steps (prefill steps with several whole
#            prompts), each profiled alone, top kernels by step kind
#   steps    gates/test_step_timings.py on the 1.5B shape, flash, captured and eager (the step bench's figures)
#   fprefill scripts/probes/flash_prefill.py: a chunk's paged attention as the captured loaded step runs it (varlen,
#            64-row pieces, one split) against with_kvcache's pieces by num_splits, at fitted and 128-page tables
#            (session 27's question: does splitting the loaded step's prefill pay, and only with a width ladder?)
#   gates    the GPU gate suite, serial, from an empty compile cache (a fresh CI runner), every test's durations
#            (scripts/probes/durations_by_file.py sums them by file and phase)
#   gates_n4 the same with -n 4, from an empty compile cache again
#   gates_mps gates_n4_mps gates_n8_mps  serial, -n 4 and -n 8, first, under NVIDIA MPS (started here, stopped at the
#            end): the workers' and the prewarm's processes share one GPU context instead of time-slicing it
#   gatesprof  the serial one under cProfile (the whole process: where the suite's host time goes, by function;
#            the top lines by own and cumulative time go to its log's end, the profile to $OUT/gatesprof.prof)
#   gates_noprewarm  the serial one with --no-prewarm (the FlexAttention prewarm's own figure, gates/prewarm.py)
#   eagerprof  scripts/probes/gate_run_profile.py: each lineage configuration's gate run (small-trained, mixed-cpu,
#            poison mode) under cProfile: where the eager reference engines' host time goes (session 23's next step)
#   nanoprep c512 nano32 r512 nano512   scripts/h200_loaded.sh's parts of those names (closed 200 beside nano-vllm
#            in this call), run after steps when named in PARTS
#   pass32 pass512   closed mixed 200 served twice on one engine, the second pass timed (the prefix cache warm): 32
#            rows at chunk 512, 512 rows at chunk 16384 (nano-vllm's warm passes come with nano32 / nano512)
#   open     the open-loop capacity at chunk 512 (flash; s5's command, fewer rates and arrivals; OPEN_RATES: session
#            22's 6,9,12,18 did not saturate it at 20.4 req/s served)
#   disturb  the short prompt's first token behind a 32k prompt at prefill share 0.5, chunk 512 (bench.disturbance)
# carry: .device/fa_built (flash-attn built by an earlier call; else .device/flash_attn, built here in the
# background and brought back as $OUT/fa_built.tgz), .device/base (the base tree of ab), .device/nano-vllm. Parts run
# in the order above; for another order, invoke it once per group of parts (each with its own BUDGET_S): a later
# invocation in the same call finds flash-attn built in /tmp/fa.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
M15=qwen2.5-1.5b-random
if ls .device/fa_built/ext/*.so > /dev/null 2>&1; then
  FA=$PWD/.device/fa_built; BUILD=""
elif ls /tmp/fa/ext/*.so > /dev/null 2>&1; then    # built by an earlier invocation in this call
  FA=/tmp/fa; BUILD=""
else      # build flash-attn (about 2 minutes) beside the parts that do not need it; its files come back for later calls
  FA=/tmp/fa
  ( python3 .device/flash_attn/build_flash_attn.py .device/flash_attn/flash_attn-2.8.3.post2.tar.gz --arch 90 \
      --workdir /tmp/fa > "$OUT/logs/flash_build.log" 2>&1; echo "flash_build: rc=$?" >> "$OUT/logs/status.txt"
    tar czhf "$OUT/fa_built.tgz" -C /tmp/fa ext src/flash_attn ) &
  BUILD=$!
fi
export STEPGATE_FLASH_ATTN_PATH=$FA/src:$FA/ext
need_flash() { [ -n "$BUILD" ] && { wait "$BUILD"; BUILD=""; }; return 0; }
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
# Bytecode, as `pip install` leaves it on a CI runner: the device's venv has none and its processes write none, so
# every process (each xdist worker and prewarm process too) compiled some 2,500 modules from source, about 10 s
# (session 41's profile of the serial suite: 9.7 s in compile() under imports). PYC=0: as before. Compiled once a
# call, untimed, into PYTHONPYCACHEPREFIX (a base tree run after this one in the call reads the same).
if [ "${PYC:-1}" = 1 ]; then
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pyc}
  if [ ! -f "$PYTHONPYCACHEPREFIX/.done" ]; then
    t0=$(date +%s)
    python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
      /usr/lib/python3*/ . > "$OUT/logs/pyc.log" 2>&1
    echo "pyc: rc=$? in $(( $(date +%s) - t0 ))s into $PYTHONPYCACHEPREFIX" >> "$OUT/logs/status.txt"
    touch "$PYTHONPYCACHEPREFIX/.done"
  fi
fi
part tests 150 python3 -m pytest tests/test_triton_decode.py tests/test_mlp_kernel.py tests/test_linear_kernel.py -q -p no:cacheprovider -rfEs
need_flash
part pdlchain 150 python3 -m scripts.probes.pdl_chain --out "$OUT/pdlchain.json"
part readfloor 150 python3 -m scripts.probes.read_floor --out "$OUT/readfloor.json"
part sweep 200 bash -c "for r in 32 200; do python3 -m scripts.probes.triton_sweep --rows \$r \
  --chunks 256 --blocks 64 --warps 4,8 --stages 3 --programs-per-sm 2,3,4 --out $OUT/sweep\$r.json || exit 1; done"
part pdlgate 150 python3 -m pytest gates/test_graphs.py -k pdl --device cuda --model small-trained -p no:cacheprovider \
  -q -rfEs
part pdlplant 150 python3 -m pytest gates/test_graphs.py -k pdl --device cuda --model small-trained \
  -p no:cacheprovider -q -rfEs -p tests.plants --plant pdl-no-wait
part gputests 200 python3 -m pytest tests/test_graph_buffers.py tests/test_step_graphs.py tests/test_overlap.py \
  --device cuda -q -p no:cacheprovider -rfEs
rm -rf /tmp/sg-cache-flashgates
part flashgates 150 env STEPGATE_COMPILE_CACHE=/tmp/sg-cache-flashgates python3 -m pytest gates/test_kernels.py \
  gates/test_tokens.py gates/test_graphs.py gates/test_smoke.py gates/test_page_safety.py gates/test_requests.py \
  --device cuda --model small-trained -k flash -n 4 -p no:cacheprovider -q -rfEs
part blas 90 python3 -m scripts.probes.blas_choice --rows 1,32,64 --out "$OUT/blas.json"
part ab ${AB_S:-170} python3 -m gates.ab --base-tree .device/base --device cuda --kinds ${AB_KINDS:-pure-decode,loaded} \
  --deadline $(( ${AB_S:-170} - 10 )) --out "$OUT/ab" --no-plot
part psteps 90 python3 -m bench.profile_steps --model $M15 --rows 32 --kinds pure-decode,loaded --steps 30 \
  --out "$OUT/psteps.json"
part psteps512 150 python3 -m bench.profile_steps --model $M15 --rows 160 --chunk 16384 --kinds loaded --steps 10 \
  --out "$OUT/psteps512.json"
flip() {   # flip DIR SED_EXPR...: a copy of this tree at DIR with engine/config.py edited by each expression (a
  # default turned on), for the A/B of a default against this tree and that copy's gates in one call
  local dir=$1; shift
  [ -d "$dir" ] && return 0
  mkdir -p "$dir" && tar -c --exclude=./.device . | tar -x -C "$dir"
  for e in "$@"; do
    cp "$dir/engine/config.py" /tmp/config.before && sed -i "$e" "$dir/engine/config.py"
    cmp -s /tmp/config.before "$dir/engine/config.py" && echo "flip $dir: '$e' changed nothing" >> "$OUT/logs/status.txt"
  done
}
LIN='s/"linear_kernel": False/"linear_kernel": True/'
PDL='s/^PDL_DEFAULT = False/PDL_DEFAULT = True/'
# /tmp/linflip: the split-K linear kernel the default on CUDA (LAYER_KERNELS); /tmp/pdlflip: programmatic dependent
# launch (PDL_DEFAULT); /tmp/pdllinflip: both
if want lingates || want linab; then flip /tmp/linflip "$LIN"; fi
if want pdlab; then flip /tmp/pdlflip "$PDL"; fi
if want pdllinab || want pdlgates; then flip /tmp/pdllinflip "$LIN" "$PDL"; fi
part pdllinab ${AB_S:-170} python3 -m gates.ab --base-tree "$PWD" --head-tree /tmp/pdllinflip --device cuda \
  --kinds pure-decode --deadline $(( ${AB_S:-170} - 10 )) --out "$OUT/pdllinab" --no-plot
part pdlab ${AB_S:-170} python3 -m gates.ab --base-tree "$PWD" --head-tree /tmp/pdlflip --device cuda \
  --kinds pure-decode,loaded --deadline $(( ${AB_S:-170} - 10 )) --out "$OUT/pdlab" --no-plot
rm -rf /tmp/sg-cache-pdlgates
part pdlgates 150 bash -c "cd /tmp/pdllinflip && STEPGATE_COMPILE_CACHE=/tmp/sg-cache-pdlgates python3 -m pytest \
  gates/test_linear.py gates/test_smoke.py gates/test_tokens.py gates/test_graphs.py gates/test_page_safety.py \
  --device cuda --model small-trained -k 'flash or linear' -n 4 -p no:cacheprovider -q -rfEs"
part linab ${AB_S:-170} python3 -m gates.ab --base-tree "$PWD" --head-tree /tmp/linflip --device cuda \
  --kinds pure-decode --deadline $(( ${AB_S:-170} - 10 )) --out "$OUT/linab" --no-plot
rm -rf /tmp/sg-cache-lingates
part lingates 150 bash -c "cd /tmp/linflip && STEPGATE_COMPILE_CACHE=/tmp/sg-cache-lingates python3 -m pytest \
  gates/test_linear.py gates/test_smoke.py gates/test_tokens.py gates/test_graphs.py gates/test_page_safety.py \
  --device cuda --model small-trained -k 'flash or linear' -n 4 -p no:cacheprovider -q -rfEs"
part gateup544 150 python3 -m scripts.probes.gate_up_silu --rows 544 --block-m 64,128 --block-n 64,128 --block-k 64 \
  --group-m 4,16 --warps 4,8 --stages 3,4 --out "$OUT/gateup544.json"
# splits 3-6 around one wave of programs on 132 multiprocessors (the default tiling gives q/k/v 160, o and down 144)
part serialk 200 python3 -m scripts.probes.splitk_gemm --kernel serial --rows 32,8 --splits 3,4,5,6,8 --block-n 32,64 \
  --block-k 64,128 --warps 4 --stages 3,4 --out "$OUT/serialk.json"
part gateupbig 200 python3 -m scripts.probes.gate_up_silu --rows 4096,16384 --layers 8 --reps 10 --block-m 128 \
  --block-n 64,128 --block-k 64 --group-m 8 --warps 8 --stages 3,4 --out "$OUT/gateupbig.json"
part ptrace512 200 python3 -m scripts.probes.profile_trace --model $M15 --rows 512 --chunk 16384 --steps 24 \
  --out "$OUT/ptrace512.json"
part fprefill 60 python3 -m scripts.probes.flash_prefill --width fit --out "$OUT/fprefill-fit.json"
want fprefill && timeout 60 python3 -m scripts.probes.flash_prefill --width 128 --histories 0,2048,4096 --splits 1,4,8,16 \
  --out "$OUT/fprefill-w128.json" > "$OUT/logs/fprefill-w128.log" 2>&1
part steps 120 python3 -m pytest gates/test_step_timings.py --device cuda --model $M15 -k "flash and not fused" \
  -p no:cacheprovider -q --benchmark-json="$OUT/steps.json" --benchmark-columns=median,iqr,rounds
LOADED=""
for p in c512 nano32 r512 nano512; do want $p && LOADED="$LOADED $p"; done
if [ -n "$LOADED" ]; then   # nanoprep: nano-vllm's model files and compile cache, before its timed cold pass
  left=$(( DEADLINE - $(date +%s) - ${AFTER_LOADED_S:-10} ))
  OUT="$OUT/loaded" PARTS="nanoprep$LOADED" BUDGET_S=$left bash scripts/h200_loaded.sh > "$OUT/logs/loaded.log" 2>&1
  echo "loaded ($LOADED): rc=$?" >> "$OUT/logs/status.txt"
fi
serve() {  # serve NAME MAX_SECONDS ARGS...: bench.serving flash on the 1.5B shape, results in $OUT/serve/NAME
  part "$1" "$2" python3 -m bench.serving --model $M15 --device cuda --engine flash --out "$OUT/serve/$1" \
    --no-progress "${@:3}"
}
serve pass32 110 --closed --batches 200 --uniform "" --new-tokens 128 --chunk-tokens 512 --passes 2 --warmups 0 --reps 2
serve pass512 110 --closed --batches 200 --uniform "" --new-tokens 128 --chunk-tokens 16384 --max-batch 512 \
  --passes 2 --warmups 0 --reps 2
serve open 200 --closed --open --batches 32 --uniform "" --new-tokens 128 --chunk-tokens 512 --warmups 0 --reps 1 \
  --arrivals 100 --rates ${OPEN_RATES:-20,26,32,40} --max-rates 4
part disturb 150 python3 -m bench.disturbance --model $M15 --device cuda --dtype float16 --chunk-tokens 512 \
  --shares 1,0.5 --alone-reps 1 --out "$OUT/serve/disturb" --no-progress
gates() {   # gates NAME ARGS...: the GPU gate suite from an empty compile cache, as on a fresh CI runner (CI=1: the
  # hypothesis profile CI loads, 40 examples; before session 24's third call these parts ran the 100 of 'dev')
  local name=$1; shift
  rm -rf /tmp/sg-cache-$name
  rm -rf /tmp/stepgate-prewarm-*
  part "$name" ${GATES_S:-330} env CI=1 STEPGATE_COMPILE_CACHE=/tmp/sg-cache-$name python3 -m pytest gates/ --device cuda \
    --model small-trained -p no:cacheprovider -q -rfEs --durations=0 --durations-min=0 "$@"
  if ls /tmp/stepgate-prewarm-*/prewarm-*.log > /dev/null 2>&1; then     # what the prewarm reached (no empty file:
    cat /tmp/stepgate-prewarm-*/prewarm-*.log > "$OUT/logs/$name-prewarm.log"   # a call brings back 8 at most)
  fi
}
mps() {    # mps on|off: NVIDIA's multi-process service, so that the processes of one run (xdist workers, the prewarm's)
  # share the GPU's one context instead of time-slicing it (session 24: a step ran 2.6 times slower under -n 4)
  if [ "$1" = on ]; then
    nvidia-cuda-mps-control -d > "$OUT/logs/mps.log" 2>&1 && echo "mps: on" >> "$OUT/logs/status.txt"
  else echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; fi
}
trap 'mps off' EXIT
if want gates_mps || want gates_n4_mps || want gates_n8_mps; then   # MPS first, then without, in one call: the same host
  if mps on; then
    gates gates_mps
    gates gates_n4_mps -n 4
    gates gates_n8_mps -n 8
    mps off
  else echo "mps: could not start ($(head -c 300 "$OUT/logs/mps.log"))" >> "$OUT/logs/status.txt"; fi
fi
gates gates
gates gates_n4 -n 4
if want gatesprof; then
  rm -rf /tmp/sg-cache-gatesprof /tmp/stepgate-prewarm-*
  part gatesprof ${GATES_S:-330} env CI=1 STEPGATE_COMPILE_CACHE=/tmp/sg-cache-gatesprof python3 -m cProfile \
    -o "$OUT/gatesprof.prof" -m pytest gates/ --device cuda --model small-trained -p no:cacheprovider -q -rfEs \
    --durations=0 --durations-min=0
  python3 -c "import pstats,sys; s=pstats.Stats('$OUT/gatesprof.prof'); s.sort_stats('tottime').print_stats(60); \
s.sort_stats('cumulative').print_stats(120)" > "$OUT/logs/gatesprof-top.log" 2>&1
fi
gates gates_noprewarm --no-prewarm
part eagerprof 150 python3 -m scripts.probes.gate_run_profile --device cuda --model small-trained
cat "$OUT/logs/status.txt"
need_flash
tar czf "$OUT/s22.tgz" -C "$OUT" logs $(cd "$OUT" && ls -d ab linab loaded serve *.json 2>/dev/null) 2>/dev/null
grep -hE "^(FAILED|ERROR)|[0-9]+ (passed|failed)|engines built" "$OUT"/logs/tests.log "$OUT"/logs/gputests.log \
  "$OUT"/logs/flashgates.log "$OUT"/logs/lingates.log "$OUT"/logs/gates*.log 2>/dev/null | tail -24
grep -A12 "us a call" "$OUT/logs/blas.log" 2>/dev/null | head -14
grep -E "verdict|ratio|pure-decode|loaded" "$OUT/ab/ab.md" "$OUT/linab/ab.md" 2>/dev/null | head -16
grep -E "^(pure-decode|loaded):|^  [a-z]" "$OUT/logs/psteps.log" 2>/dev/null | head -8
grep -A10 "^loaded:" "$OUT/logs/psteps512.log" 2>/dev/null | head -11
grep -A3 "^fastest" "$OUT/logs/gateup544.log" "$OUT/logs/gateupbig.log" 2>/dev/null
grep -A8 "^fastest" "$OUT/logs/serialk.log" 2>/dev/null
grep -vE "capturing|warn" "$OUT/logs/ptrace512.log" 2>/dev/null | tail -24
grep -E "test_step_time|test_decode_kernel" "$OUT/logs/steps.log" 2>/dev/null | head -12
cat "$OUT/logs/fprefill.log" "$OUT/logs/fprefill-w128.log" 2>/dev/null | grep -E "^ *[0-9]|history" | head -60
cat "$OUT/loaded/table.md" 2>/dev/null | head -40
for f in gates gates_n4 gates_mps gates_n4_mps gates_n8_mps; do [ -f "$OUT/logs/$f.log" ] && python3 -m scripts.probes.durations_by_file "$OUT/logs/$f.log" | head -24; done
for f in pass32 pass512 open disturb; do [ -f "$OUT/logs/$f.log" ] && { echo "-- $f"; tail -12 "$OUT/logs/$f.log"; }; done
