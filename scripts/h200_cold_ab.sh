#!/usr/bin/env bash
# The GPU gate suite from an empty compile cache, the tree before (.device/base) and this tree, in one call on one
# host (issue 37's cold-suite figures; session 40 saw 5-25% drift between calls, so both sides run in the same one).
#   ORDER="base head" (default) or "head base"; PART: h200_s22's part, gates (serial, default) or gates_n4; GATES_S:
#   each run's limit (default 280 s). Bytecode is compiled first, untimed (scripts/h200_s22.sh's PYC step: as pip leaves it).
# carry: .device/fa_built, .device/base (made with `git archive BASE | tar x -C .device/base`, its golden/models a
# link to ../../../golden/models). Everything comes back as $OUT/cold.tgz; the summary lines print last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/head" "$OUT/base"
export PYTHONPYCACHEPREFIX=/tmp/pyc
FA=$PWD/.device/fa_built
export STEPGATE_FLASH_ATTN_PATH=$FA/src:$FA/ext
mkdir -p .device/base/.device && ln -sfn "$FA" .device/base/.device/fa_built
OUT=$OUT/head PARTS=pyc PYTHONPATH=$PWD bash scripts/h200_s22.sh > /dev/null 2>&1      # the bytecode alone
for side in ${ORDER:-base head}; do
  dir=$PWD; [ "$side" = base ] && dir=$PWD/.device/base
  (cd "$dir" && OUT=$OUT/$side PARTS=${PART:-gates} GATES_S=${GATES_S:-280} BUDGET_S=$(( ${GATES_S:-280} + 20 )) \
     PYTHONPATH=$dir bash scripts/h200_s22.sh > "$OUT/$side/driver.log" 2>&1)
done
tar czf "$OUT/cold.tgz" -C "$OUT" head base
for side in ${ORDER:-base head}; do
  echo "== $side"; cat "$OUT/$side/logs/status.txt"
  grep -E "engines built|candidate runs|builds by configuration|workers \(|[0-9]+ passed" "$OUT/$side/logs/${PART:-gates}.log" | cut -c1-400
  python3 -m scripts.probes.durations_by_file "$OUT/$side/logs/${PART:-gates}.log" | head -16
done
rm -rf "${OUT:?}/head" "${OUT:?}/base"      # a call brings back 8 files at most: the archive holds them
