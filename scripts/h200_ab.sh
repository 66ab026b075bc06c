#!/usr/bin/env bash
# Issue 36 on one H200, one device call (under 10 minutes): the same-job A/B's A/A noise and its sensitivity with
# several process pairs a run (a process has a speed of its own: docs/ab.md), or head against a given base tree.
# Everything lands under $OUT (tar it whole); a short table is printed last and kept as $OUT/table.md.
#   1. ab-noise  scripts/ab_noise.py: RUNS A/A runs (this checkout against itself: must never alert) and RUNS runs
#                with head's pure decode step planted PLANT slower (a busy-wait of that share of each step: must
#                alert every time), alternating, on the pure decode step of the flash configuration on the 1.5B
#                shape, each run over PROCS process pairs (all alive at once; SUCCESSIVE=1: one after another)
#                under its own deadline; each run's ab.md/ab.json/ab.png and every process's log under
#                $OUT/ab-noise/NN-*. With BASE_TREE=DIR (e.g. .device/base, carried: the engine before a
#                refactor): head against that tree (kind ab) alternating with A/A (KINDS, default ab,aa).
#   2. refresh   (REFRESH=1; off by default: refreshed at 9ad79ad) python -m gates.ab refresh-baseline: the 1.5B
#                shape's flash step timings saved as golden/benchmarks/h200's next file, copied to $OUT/baseline/
#                (commit it from there: it goes into golden/benchmarks/h200/Linux-CPython-3.12-64bit/)
#   3. full      (FULL=1) one A/A run of every step kind of the flash configuration (the default
#                `python -m gates.ab --device cuda`): how long the step timings of one configuration take
# The plan's time (defaults): one run = the pairs' start together (one pair took 35-45 s to start at 9ad79ad, its
# runs 44-55 s with 100 rounds; three pairs starting at once, guessed 50-70 s) + 100 rounds a side (about 8 s) =
# about 70 s; 2 x RUNS=3 runs = about 420 s of the 540 s left after the flash-attn check. A run that would not fit
# its deadline (RUN_S) in what is left is not started, and the table says so. SUCCESSIVE=1 costs a start a pair:
# about 3 x 45 s a run, so set RUNS=2 with it.
#   carry: .device (fa_built/: flash-attn built by an earlier call, as scripts/h200_call.sh; else flash_attn/: the
#          sdist and build_flash_attn.py, built here in about 2 minutes; base/: the base tree for BASE_TREE)
#   knobs: BUDGET_S (560: the whole call), RUNS (3 of each kind), PROCS (5 process pairs a run: gates.ab's cuda default), PLANT (0.05),
#          RUN_S (150: one A/B run's deadline), KINDS (aa,planted; with BASE_TREE ab,aa), BASE_TREE (unset),
#          SUCCESSIVE (0), REFRESH (0), REFRESH_K (the refresh's pytest -k), COMMIT (the commit to name in the
#          baseline where this copy has no .git), FULL (0)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs" "$OUT/baseline"
: > "$OUT/logs/status.txt"
START=$(date +%s)
DEADLINE=$(( START + ${BUDGET_S:-560} ))
M15=qwen2.5-1.5b-random
RUNS=${RUNS:-3}
RUN_S=${RUN_S:-150}
PROCS=${PROCS:-5}
left() { echo $(( DEADLINE - $(date +%s) )); }
part() {   # part NAME MAX_SECONDS CMD...: SIGINT first at the limit; its status line goes to status.txt as it ends
  local name=$1 max=$2; shift 2
  local l; l=$(left)
  (( l - 10 < max )) && max=$(( l - 10 ))
  if (( max < 20 )); then echo "$name: not run (deadline)" >> "$OUT/logs/status.txt"; return; fi
  local t0; t0=$(date +%s)
  timeout -s INT -k 20 "$max" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - t0 ))s (limit ${max}s)" >> "$OUT/logs/status.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1 2>/dev/null || echo "no .git here (COMMIT=${COMMIT:-unset})"; } > "$OUT/logs/env.log" 2>&1

# flash-attn: the build an earlier call brought back, else build it now (the flash configuration needs it)
if ls .device/fa_built/ext/*.so > /dev/null 2>&1; then
  export STEPGATE_FLASH_ATTN_PATH=$PWD/.device/fa_built/src:$PWD/.device/fa_built/ext
  echo "flash-attn: prebuilt (.device/fa_built)" >> "$OUT/logs/status.txt"
else
  part flash_build 200 bash -c "python3 .device/flash_attn/build_flash_attn.py \
    .device/flash_attn/flash_attn-2.8.3.post2.tar.gz --arch 90 --workdir /tmp/fa && \
    tar czhf $OUT/fa_built.tgz -C /tmp/fa ext src/flash_attn"
  export STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext
fi
python3 -c "from kernels.flash_backend import _import_flash as f; m, why = f(); print('flash-attn', m.__version__ if m else why)" \
  >> "$OUT/logs/env.log" 2>&1

# 1. A/A and planted (or head against BASE_TREE and A/A), alternating; what does not fit the budget is not started
noise_args=(--runs "$RUNS" --plant "${PLANT:-0.05}" --deadline "$RUN_S")
if [ -n "${BASE_TREE:-}" ]; then
  noise_args+=(--base-tree "$BASE_TREE" --kinds "${KINDS:-ab,aa}")
  # only the tree's own .git: a carried copy inside this checkout would otherwise name this checkout's commit
  { [ -e "$BASE_TREE/.git" ] && git -C "$BASE_TREE" log --oneline -1 || echo "base tree $BASE_TREE: no .git"; } \
    >> "$OUT/logs/env.log" 2>&1
else
  noise_args+=(--kinds "${KINDS:-aa,planted}")
fi
ab_args=(--device cuda --model $M15 --config flash --kinds pure-decode --processes "$PROCS")
[ "${SUCCESSIVE:-0}" = 1 ] && ab_args+=(--successive)
reserve=$(( ${REFRESH:-0} == 1 ? 110 : 0 ))
reserve=$(( reserve + (${FULL:-0} == 1 ? RUN_S + 30 : 15) ))
part ab-noise $(( $(left) - reserve )) python3 scripts/ab_noise.py "${noise_args[@]}" \
  --budget $(( $(left) - reserve - 20 )) --out "$OUT/ab-noise" -- "${ab_args[@]}"

# 2. the baseline refresh (history and dashboards; no alert reads it)
if [ "${REFRESH:-0}" = 1 ]; then
  commit_arg=()
  [ -n "${COMMIT:-}" ] && commit_arg=(--commit "$COMMIT")
  part refresh 110 python3 -m gates.ab refresh-baseline --storage golden/benchmarks/h200 --device cuda \
    --allow-dirty "${commit_arg[@]}" -k "${REFRESH_K:-test_step_time and qwen2.5-1.5b-random and flash}"
  grep -h "^new baseline: " "$OUT/logs/refresh.log" 2>/dev/null | sed 's/^new baseline: \([^ ]*\) .*/\1/' \
    | while read -r f; do cp "$f" "$OUT/baseline/"; done
fi

# 3. every step kind of one configuration, A/A, with the command's defaults
if [ "${FULL:-0}" = 1 ]; then
  part full $(( $(left) - 15 )) python3 -m gates.ab --base-tree . --device cuda --out "$OUT/full" \
    --deadline $(( $(left) - 40 ))
fi

{ echo "== status"; cat "$OUT/logs/status.txt"
  echo "== baseline refreshed"; ls "$OUT/baseline" 2>/dev/null; grep -h "^new baseline" "$OUT/logs/refresh.log" 2>/dev/null
  grep -hE "passed|failed|error" "$OUT/logs/refresh.log" 2>/dev/null | tail -n 2
  echo "== ${BASE_TREE:+head against $BASE_TREE, }A/A and planted ${PLANT:-0.05} (pure decode, flash, $M15, $PROCS process pairs a run)"
  cat "$OUT/ab-noise/noise.md" 2>/dev/null || grep -h "^|" "$OUT/logs/ab-noise.log"
  echo "== every step kind, A/A (the default command)"; grep -hE "^cuda-|no regression|regression\(s\)" "$OUT/logs/full.log" 2>/dev/null
  echo "== total $(( $(date +%s) - START ))s"; } > "$OUT/table.md"
cat "$OUT/table.md"
