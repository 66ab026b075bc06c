#!/usr/bin/env bash
# The GPU mutation campaign (docs/mutation.md): kernels/ and the runner, each mutant against the gates on the H200
# (gates/mutation.toml, suites "kernels" and "runner"). A device call lasts at most 10 minutes, so the campaign runs
# over several calls: each goes on with the sessions the last one left (carried in .device/mutation) and hands them
# back in $OUT/mutation.tgz; unpack that into .device/mutation before the next call.
#   carry: .device/wheels (cosmic-ray and its dependencies: `pip download "cosmic-ray>=8.4,<9" -d .device/wheels` on
#          a machine with an index; the H200 reaches none), .device/fa_built (flash-attn, as for h200_session.sh),
#          .device/mutation (the sessions so far; absent on the first call)
#   MODULES: the modules of this call (default: every module of the kernels and runner suites); MINUTES (8): the cap
set -eu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .device/mutation
export PYTHONUNBUFFERED=1 STEPGATE_FLASH_ATTN_PATH=$PWD/.device/fa_built/src:$PWD/.device/fa_built/ext
pip install -q --no-index --find-links .device/wheels "cosmic-ray>=8.4,<9"
args=()
for m in ${MODULES:-}; do args+=(--module "$m"); done
[ ${#args[@]} -gt 0 ] || args=(--suite kernels --suite runner)
resume=()
ls .device/mutation/*.sqlite > /dev/null 2>&1 && resume=(--resume)
python -m gates.mutation run "${args[@]}" "${resume[@]}" --max-minutes "${MINUTES:-8}" --work .device/mutation \
  --markdown "$OUT/mutation-report.md" --out "$OUT/mutation-report.json"
tar czf "$OUT/mutation.tgz" -C .device/mutation --exclude '*.tree' .
