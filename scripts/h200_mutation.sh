#!/usr/bin/env bash
# The GPU mutation campaign (docs/mutation.md): kernels/ and the runner, each mutant against its gates on the H200
# (gates/mutation.toml, suites "flash" and "runner"), WORKERS mutants at a time on the one GPU
# (cosmic-ray's http distributor, a copy of the tree each). A device call lasts at most 10 minutes, so a campaign may
# run over several calls: each goes on with the sessions the last one left (carried in .device/mutation) and hands
# them back in $OUT/mutation.tgz; unpack that into .device/mutation before the next call.
#   carry: .device/wheels (cosmic-ray and its dependencies as cp312 wheels: `pip download cosmic-ray==8.7.0
#          --only-binary=:all: --python-version 3.12 ...` here; yattag, sdist only, built with `pip wheel yattag`),
#          .device/fa_built (flash-attn built by an earlier call) or .device/flash_attn (the sdist and its build
#          script, built here first: about 2 minutes; the build comes back as $OUT/fa_built.tgz),
#          .device/mutation (the sessions so far; absent on the first call)
#   MODULES: the modules of this call (default: every module of the two suites); MINUTES (8): the campaign's cap;
#   WORKERS (12): mutants at a time (a suite with worker_gib in gates/mutation.toml is capped at what the GPU's
#   memory holds: the runner suite at 8); THREADS: torch threads a worker (default: the cores shared); RETEST=1: run
#   the survivors again (after a gap was closed) and the runs that ran out of device memory (no verdict), then, in
#   the time left, the mutants never run
#   ALSO=1: after the GPU campaign, its modules' survivors against their second suite (gates/mutation.toml [also]:
#   the CPU gate run, GPU hidden; `run --also`), CPU_WORKERS at a time, ALSO_MINUTES (3) at most; a kill there
#   counts in the report, named
#   CPU_MODULES: CPU suites' modules (the bookkeeping) run beside the GPU campaign on the host's spare cores, with
#   the GPU hidden (so the gates serve the CPU, as CI does), CPU_WORKERS (4) mutants at a time, one thread each
set -eu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .device/mutation
export PYTHONUNBUFFERED=1
python -m pip install -q --no-index --find-links .device/wheels "cosmic-ray==8.7.0" coverage > "$OUT/pip.log" 2>&1
if ls .device/fa_built/ext/*.so > /dev/null 2>&1; then
  export STEPGATE_FLASH_ATTN_PATH=$PWD/.device/fa_built/src:$PWD/.device/fa_built/ext
else
  t=$(date +%s)
  python3 .device/flash_attn/build_flash_attn.py .device/flash_attn/flash_attn-2.8.3.post2.tar.gz --arch 90 \
    --workdir /tmp/fa > "$OUT/flash_build.log" 2>&1
  echo "flash-attn build rc=$? in $(( $(date +%s) - t ))s" >> "$OUT/flash_build.log"
  tar czhf "$OUT/fa_built.tgz" -C /tmp/fa ext src/flash_attn
  export STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext
fi
# the smoke gate's CUDA golden is made on the machine (none is committed: scripts/h200_session.sh does the same), and
# with it the served record where none is committed (gates/served.py; it comes back in $OUT to be committed); the
# GPU suites run the trained small model, as the GPU gate suite does
served=golden/qwen2-small-trained/smoke-cpu/served-cuda-float16.json
if [ -f "$served" ]; then
  python -m gates.golden regen --model small-trained --workload smoke-cpu --reference hf --device cuda \
    --dtype float16 > "$OUT/golden.log" 2>&1
else
  python -m pytest -q -p no:cacheprovider gates/test_smoke.py::test_smoke --regen-golden --device cuda \
    --model small-trained --dtype float16 > "$OUT/golden.log" 2>&1 || echo "served regen rc=$?" >> "$OUT/golden.log"
  cp "$served" "$OUT/" 2>> "$OUT/golden.log" || true
  # and the random small model's at fp32 on torch and flex, as the GPU workflow's second gate run serves them
  python -m pytest -q -p no:cacheprovider gates/test_smoke.py::test_smoke --regen-golden --device cuda \
    --dtype float32 --backend torch,flex >> "$OUT/golden.log" 2>&1 || echo "served fp32 regen rc=$?" >> "$OUT/golden.log"
  cp golden/qwen2-small/smoke-cpu/served-cuda-float32.json "$OUT/" 2>> "$OUT/golden.log" || true
fi
args=()
for m in ${MODULES:-}; do args+=(--module "$m"); done
[ ${#args[@]} -gt 0 ] || args=(--suite flash --suite runner)
resume=()
ls .device/mutation/*.sqlite > /dev/null 2>&1 && resume=(--resume)
[ "${RETEST:-0}" = 1 ] && resume+=(--retest)
cpu_pid=
if [ -n "${CPU_MODULES:-}" ]; then
  cpu_args=()
  for m in $CPU_MODULES; do cpu_args+=(--module "$m"); done
  CUDA_VISIBLE_DEVICES= python -m gates.mutation run "${cpu_args[@]}" "${resume[@]}" --workers "${CPU_WORKERS:-4}" \
    --threads 1 --max-minutes "${MINUTES:-8}" --work .device/mutation --markdown "$OUT/mutation-report-cpu.md" \
    --out "$OUT/mutation-report-cpu.json" > "$OUT/campaign-cpu.log" 2>&1 &
  cpu_pid=$!
fi
threads=()
[ -n "${THREADS:-}" ] && threads=(--threads "$THREADS")
python -m gates.mutation run "${args[@]}" "${resume[@]}" --workers "${WORKERS:-12}" "${threads[@]}" \
  --max-minutes "${MINUTES:-8}" --work .device/mutation --markdown "$OUT/mutation-report.md" \
  --out "$OUT/mutation-report.json" > "$OUT/campaign.log" 2>&1 || echo "campaign rc=$?" >> "$OUT/campaign.log"
[ -z "$cpu_pid" ] || wait "$cpu_pid" || echo "cpu campaign rc=$?" >> "$OUT/campaign-cpu.log"
if [ "${ALSO:-0}" = 1 ]; then
  CUDA_VISIBLE_DEVICES= python -m gates.mutation run "${args[@]}" --also --workers "${CPU_WORKERS:-4}" --threads 1 \
    --max-minutes "${ALSO_MINUTES:-3}" --work .device/mutation --markdown "$OUT/mutation-report.md" \
    --out "$OUT/mutation-report.json" > "$OUT/campaign-also.log" 2>&1 || echo "also rc=$?" >> "$OUT/campaign-also.log"
fi
tar czf "$OUT/mutation.tgz" -C .device/mutation --exclude '*.tree' --exclude '*.tree.*' .
tail -5 "$OUT/campaign.log"
[ -z "$cpu_pid" ] || tail -5 "$OUT/campaign-cpu.log"
