#!/usr/bin/env bash
# One H200 call for "gate what you serve" (issue 32): flash-attn built (or carried in .device/fa_built), then
#   triton      tests/test_triton_decode.py natively on the GPU
#   append      the gate run with a planted error in the Triton decode's fused append (tests/plants.py append-value):
#               which gate fails first, and how many seconds after the run's start
#   gates       the whole GPU gate suite, serial, the served defaults (small-trained, every backend): the census
#               table and the coverage gate in its summary (gates.md)
#   regen       the small models' CUDA goldens regenerated, so their meta records the served configuration
# Files back in $OUT: served.tgz (every log and summary), fa_built.tgz where it was built here, goldens.tgz, and
# status.txt, printed last. PARTS picks the parts (default: triton append gates); BUDGET_S (570) the deadline.
#   carry: .device/flash_attn (a copy of ../shared/tools/flash_attn) or .device/fa_built (an earlier build)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD   # -p tests.plants imports tests/
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
L=/tmp/served; mkdir -p $L
T0=$(date +%s); DEADLINE=$(( T0 + ${BUDGET_S:-570} ))
export STEPGATE_COMPILE_CACHE=/tmp/stepgate-compile-cache
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__)"; git log --oneline -1 2>/dev/null; } > $L/status.txt 2>&1
if ls .device/fa_built/ext/*.so > /dev/null 2>&1; then
  export STEPGATE_FLASH_ATTN_PATH=$PWD/.device/fa_built/src:$PWD/.device/fa_built/ext
  echo "flash-attn: carried build" >> $L/status.txt
else
  t=$(date +%s)
  python3 .device/flash_attn/build_flash_attn.py .device/flash_attn/flash_attn-2.8.3.post2.tar.gz --arch 90 \
    --workdir /tmp/fa > $L/flash_build.log 2>&1
  echo "flash-attn build rc=$? in $(( $(date +%s) - t ))s" >> $L/status.txt
  tar czhf "$OUT/fa_built.tgz" -C /tmp/fa ext src/flash_attn 2>> $L/flash_build.log
  export STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext
fi
G=(--device cuda --model small-trained -p no:cacheprovider -q -rfEs)

part() {   # part NAME MAX_SECONDS CMD...: under what is left of the deadline; SIGINT first, so pytest summarises
  local name=$1 max=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) - 20 )) t=$(date +%s)
  (( left < max )) && max=$left
  if (( max < 20 )); then echo "$name: not run (deadline)" >> $L/status.txt; return; fi
  timeout -s INT -k 15 "$max" "$@" > "$L/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - t ))s: $(grep -hE '[0-9]+ (passed|failed)' "$L/$name.log" | tail -1)" \
    >> $L/status.txt
}

for p in ${PARTS:-triton append gates}; do
  case $p in
    triton) part triton 120 python3 -m pytest tests/test_triton_decode.py --device cuda -q -p no:cacheprovider -rs ;;
    append)
      date +%s.%N > $L/append.start
      part append 200 python3 -m pytest gates/ "${G[@]}" -x -p tests.plants --plant append-value \
        --plant-record $L/append_first_failure.json --gate-summary $L/append.json --gate-summary-md $L/append.md
      python3 - $L >> $L/status.txt <<'PY'
import json, os, sys
L = sys.argv[1]
p = f"{L}/append_first_failure.json"
if os.path.exists(p):
    r = json.load(open(p))
    start = float(open(f"{L}/append.start").read())
    lines = [x for x in r["message"].splitlines() if "append" in x or "max error" in x]
    print(f"  append-value: first failing gate {r['nodeid']}, {r['time'] - start:.1f} s after the run's launch "
          f"({r['cpu_s']:.1f} CPU s); {lines[0][:400] if lines else ''}")
else:
    print("  append-value: NOT CAUGHT (no failing report)")
PY
      ;;
    gates) part gates 330 python3 -m pytest gates/ "${G[@]}" --durations=15 --gate-summary $L/gates.json \
             --gate-summary-md $L/gates.md ;;
    regen) part regen 150 bash -c "python3 -m gates.golden regen --model small-trained --device cuda --dtype float16 \
             --reference chunked --reference fused --reference flash && python3 -m gates.golden regen --model small \
             --device cuda --dtype float16 --reference chunked --reference fused --reference flash"
           tar czf "$OUT/goldens.tgz" $(find golden -type f -name '*-cuda-*' -newer $L/status.txt) 2>/dev/null ;;
    *) echo "$p: unknown part" >> $L/status.txt ;;
  esac
done
tar czf "$OUT/served.tgz" -C /tmp served
cat $L/status.txt
[ -f $L/gates.md ] && sed -n '/### Path census/,/^### Failures\|^### Slowest/p' $L/gates.md | head -40
