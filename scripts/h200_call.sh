#!/usr/bin/env bash
# One device call on the H200, parts chosen by name (PARTS="a b c"; they run in the order given, under one deadline,
# so a slow part cannot starve the summary). Logs, results and goldens come back in $OUT.
#   carry: .device (flash_attn/: the flash-attn sdist and its build script; fa_built/: a build an earlier call brought
#          back as $OUT/fa_built.tgz, unpacked there with `mkdir -p .device/fa_built && tar xzf fa_built.tgz -C .device/fa_built`)
#   CHUNK (512): the chunk budget of bench_200, peer_200, open_flash
# Parts:
#   train       train the fp16-robust small model (scripts/train_small_model.py) into golden/models/qwen2-small-trained
#   regen_small regenerate the trained small model's (SMALL=) fp16 GPU goldens (hf, chunked, fused, flash), printing what moved
#   gates_small token, poison, page-safety, prefill-share and graph gates on the small model, every backend
#   gates_graphs the graph gates (captured vs eager, stale table, graphs on vs off) on the small model
#   gates_share  the prefill-share gates on the GPU
#   planted_gpu captured decode graphs vs eager, padding, and the planted stale block table (tests/test_graph_buffers.py)
#   profile     scripts/probes/profile_decode.py on the 1.5B shape: where a pure decode step's time goes, graphs on/off
#   steps_15b   step-timing benchmarks + ratio gates on the GPU (small and 1.5B), baseline saved per machine
#   slowdown    the same with a planted slowdown, compared against that baseline, and the alert report
#   bench_200   bench.serving flash: closed mixed 32 and 200 (128 new tokens), graphs on, peer beside it
#   splits      scripts/probes/flash_splits.py: flash decode per layer inside a CUDA graph by num_splits
#   closed_200  bench.serving flash: closed mixed 32 and 200 (128 new tokens) at chunk $CHUNK, no peer
#   peer_200    bench.serving flash closed 200 (128 new tokens) at chunk $CHUNK, the peer beside it (its warm-up: 8 requests)
#   open_eager  chunked and fused (EAGER_ENGINES), one part each: closed 8/32/64 and an open sweep (EAGER_RATES, EAGER_ARRIVALS)
#   open_flash  flash: closed 8/32/64 + uniform 256, the open sweep (RATES, ARRIVALS) and the capped-pool control, at chunk $CHUNK
#   bench_eager the same closed runs with graphs off
#   peer32      closed mixed 32 (128 new tokens) per engine (PEER_ENGINES), the peer beside each, at chunk $CHUNK
#   uniform_eager  chunked and fused: the closed uniform 256 control, no warm-up, one run (eager steps are slow here)
#   chunks      bench/chunk_sweep.py: open-loop capacity and token gaps per chunk budget 512..4096 (1.5B, flash)
#   disturb     the disturbance benchmark (1.5B, flash) at chunk budgets 512 and 4096, DISTURB_RUNS times
#   regen_15b / gates_15b   1.5B-shape goldens and token gates
set -u
# PARTS_GPU1 (a machine of two GPUs): those parts run at the same time on the second GPU, from a copy of the tree,
# their files in $OUT/gpu1; the parts in PARTS run on the first. Host work is light next to 32 cores.
if [ -n "${PARTS_GPU1:-}" ]; then
  rm -rf /tmp/gpu1tree && cp -a . /tmp/gpu1tree && mkdir -p "${OUT:-/tmp/out}/gpu1"
  ( cd /tmp/gpu1tree && CUDA_VISIBLE_DEVICES=1 OUT="${OUT:-/tmp/out}/gpu1" PARTS="$PARTS_GPU1" PARTS_GPU1= \
      bash scripts/h200_call.sh > /tmp/gpu1.log 2>&1 ) &
  GPU1=$!
  export CUDA_VISIBLE_DEVICES=0
fi
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
# flash-attn: a build brought back by an earlier call (.device/fa_built, from $OUT/fa_built.tgz) saves its 2 minutes
if ls .device/fa_built/ext/*.so > /dev/null 2>&1; then
  FA=.device/fa_built; built=1; echo "flash-attn: prebuilt (.device/fa_built)" > logs/flash_build.log
else
  FA=/tmp/fa; built=0
  ( python3 .device/flash_attn/build_flash_attn.py .device/flash_attn/flash_attn-2.8.3.post2.tar.gz --arch 90 \
      --workdir /tmp/fa > logs/flash_build.log 2>&1; echo $? > logs/flash_build.rc; \
    tar czhf "$OUT/fa_built.tgz" -C /tmp/fa ext src/flash_attn 2>> logs/flash_build.log ) &
  BUILD=$!
fi
export STEPGATE_FLASH_ATTN_PATH=$PWD/$FA/src:$PWD/$FA/ext
[ "$FA" = /tmp/fa ] && export STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext
need_flash() { if (( built == 0 )); then wait $BUILD; built=1; fi; }
CHUNK=${CHUNK:-512}
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
    gates_graphs) need_flash; part gates_graphs 150 python3 -m pytest tests/test_graph_buffers.py gates/test_graphs.py \
             --model ${SMALL:-small-trained} "${GATE_OPTS[@]}" -k "not cpu-emulated" --gate-summary logs/gate_summary_graphs.json ;;
    gates_share) need_flash; part gates_share 200 python3 -m pytest gates/test_prefill_share.py --model ${SMALL:-small-trained} \
             "${GATE_OPTS[@]}" --gate-summary logs/gate_summary_share.json ;;
    planted_gpu) need_flash; part planted_gpu 200 python3 -m pytest tests/test_graph_buffers.py "${GATE_OPTS[@]}" ;;
    profile) need_flash; part profile 120 python3 -m scripts.probes.profile_decode --model $M15 --device cuda --steps 50 \
             --out results/profile ;;
    steps_15b) need_flash; part steps_15b 200 env STEPGATE_BENCH_ROUNDS=${ROUNDS:-20} python3 -m pytest \
             gates/test_step_timings.py "${GATE_OPTS[@]}" -k "${STEPS_K:-pure-decode or graphed or cheaper}" \
             --benchmark-autosave --benchmark-storage=file://golden/benchmarks/h200 --benchmark-columns=median,iqr,rounds ;;
    slowdown) need_flash; part slowdown 150 bash -c "env STEPGATE_BENCH_ROUNDS=${ROUNDS:-20} STEPGATE_PLANT_SLOWDOWN_MS=${PLANT_MS:-2} \
             python3 -m pytest gates/test_step_timings.py --device cuda -q -p no:cacheprovider -k '${SLOW_K:-pure-decode}' \
             --benchmark-storage=file://golden/benchmarks/h200 --benchmark-compare --benchmark-json=results/planted.json \
             --benchmark-compare-fail=median:10% --benchmark-columns=median,rounds; echo pytest rc=\$?; \
             python3 -m gates.alert --baseline \$(ls golden/benchmarks/h200/*/*.json | tail -1) --current results/planted.json \
             --markdown results/alert-planted.md; echo alert rc=\$?" ;;
    bench_200) need_flash; part bench_200 260 python3 -m bench.serving --model $M15 --device cuda --engine flash \
             --out results/graphs --no-progress --closed --peer --batches 32,200 --uniform "" --new-tokens 128 \
             --chunk-tokens $CHUNK \
             --warmups ${WARM:-1} --reps ${REPS:-3} --peer-warmups ${PEER_WARM:-1} --peer-reps 1 ;;
    splits) need_flash; part splits 90 python3 -m scripts.probes.flash_splits --out results/flash_splits.json ;;
    closed_200) need_flash; part closed_200 120 python3 -m bench.serving --model $M15 --device cuda --engine flash \
             --out results/closed200-c$CHUNK --no-progress --closed --batches 32,200 --uniform "" --new-tokens 128 \
             --chunk-tokens $CHUNK --warmups 1 --reps ${REPS:-2} ;;
    peer_200) need_flash; part peer_200 300 python3 -m bench.serving --model $M15 --device cuda --engine flash \
             --out results/peer200 --no-progress --closed --peer --batches 200 --uniform "" --new-tokens 128 \
             --chunk-tokens $CHUNK --warmups 1 --reps ${REPS:-2} --peer-warmups 1 --peer-warmup-requests 8 --peer-reps 1 ;;
    open_eager) for e in ${EAGER_ENGINES:-chunked fused}; do
             part open_$e ${EAGER_S:-240} python3 -m bench.serving --model $M15 --device cuda --engine $e \
             --out results/open-eager --append --no-progress --closed --open --no-capped --batches ${EAGER_BATCHES:-8,32,64} \
             --uniform '' --new-tokens 128 --chunk-tokens $CHUNK --warmups 1 --reps 1 \
             --arrivals ${EAGER_ARRIVALS:-100} --rates ${EAGER_RATES:-2,4,8}; done ;;
    open_flash) need_flash; part open_flash ${OPEN_S:-480} python3 -m bench.serving --model $M15 --device cuda --engine flash \
             --out results/open-flash-c$CHUNK --no-progress --closed --open --batches 8,32,64 --uniform 256 --new-tokens 128 \
             --chunk-tokens $CHUNK --warmups 1 --reps 2 --arrivals ${ARRIVALS:-200} ${RATES:+--rates $RATES} --max-rates 5 ;;
    peer32) for e in ${PEER_ENGINES:-flash fused chunked}; do
             part peer32_$e ${PEER32_S:-150} python3 -m bench.serving --model $M15 --device cuda --engine $e \
             --out results/peer32-c$CHUNK --append --no-progress --closed --peer --batches 32 --uniform '' --new-tokens 128 \
             --chunk-tokens $CHUNK --warmups 1 --reps 2 --peer-warmups 1 --peer-warmup-requests 8 --peer-reps 1; done ;;
    uniform_eager) for e in ${EAGER_ENGINES:-chunked fused}; do
             part uniform_$e ${UNIFORM_S:-120} python3 -m bench.serving --model $M15 --device cuda --engine $e \
             --out results/uniform-eager --append --no-progress --closed --batches '' --uniform 256 --new-tokens 128 \
             --chunk-tokens $CHUNK --warmups 0 --reps 1; done ;;
    bench_eager) need_flash; part bench_eager 120 python3 -m bench.serving --model $M15 --device cuda --engine flash \
             --cuda-graphs off --out results/eager --no-progress --closed --batches 32,200 --uniform "" \
             --new-tokens 128 --warmups 1 --reps 3 ;;
    chunks) need_flash; part chunks 240 python3 -m bench.chunk_sweep --model $M15 --device cuda --engine flash \
             --chunks ${CHUNKS:-512,1024,2048,4096} --arrivals ${ARRIVALS:-200} --rate 200 --new-tokens 128 --out results/chunk-sweep${CHUNKS:+-${CHUNKS//,/-}} ;;
    disturb) need_flash; for i in $(seq 1 ${DISTURB_RUNS:-1}); do
             part disturb_$i 200 python3 -m bench.disturbance --model $M15 --device cuda --engine flash \
             --chunk-tokens 512,4096 --out results/disturbance-$i; done ;;
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
[ -n "${GPU1:-}" ] && { wait $GPU1; echo "== gpu1"; cat /tmp/gpu1.log; }
for f in logs/gates_small.log logs/planted_gpu.log logs/gates_15b.log logs/steps_15b.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "passed|failed|Error" "$f" | tail -3; }; done
[ -f logs/train.log ] && { echo "== train"; tail -15 logs/train.log; }
[ -f logs/profile.log ] && tail -4 logs/profile.log
[ -f logs/splits.log ] && tail -18 logs/splits.log
grep -h "closed\|peer " logs/bench_*.log logs/closed_200.log logs/peer_200.log 2>/dev/null | tail -10
grep -h "^|" logs/chunks.log 2>/dev/null | tail -6
grep -h "closed \|open \|capped \|stopped rising\|^peer " logs/open_*.log logs/peer32_*.log logs/uniform_*.log 2>/dev/null | tail -40
for f in logs/disturb_*.log; do [ -f "$f" ] && { echo "== $f"; grep -A9 "^chunk " "$f"; grep "not a near tie" "$f"; }; done
