#!/usr/bin/env bash
# One device call on one H200 (under 6 minutes): the prefix cache (issue 19) against nano-vllm's warm pass.
#   carry: .device (nano-vllm/: the peer's archive, its xxhash wheel and run_peer.py, as in ../shared/peers/nano-vllm;
#          and the flash-attn build that STEPGATE_FLASH_ATTN_PATH names, "<src>:<ext>")
#   env: CHUNK (8192) our chunk budget; CHUNK512 ($CHUNK) ours512's (16384 is the peer's max_num_batched_tokens);
#        REPS (1) our measured runs per mode (the table shows their median); PARTS (all four) which of the parts below
#        run; BUDGET_S (340) the whole call's deadline; OUT ($OUT or /tmp/out)
# Parts, in this order, each under `timeout` and the deadline:
#   nv32, nv512  nano-vllm: 200 mixed prompts, 128 new tokens, twice on one engine at 32 / 512 sequences; its pass 2
#                hits its prefix cache (the "warm pass")
#   ours32       bench.serving flash, 32 rows, cache on and off: closed mixed 200 served twice on one engine (pass 2
#                timed, as the peer's warm pass), and the shared-prefix workload (200: one 1024-token system prompt,
#                repeats, next turns; pass 1 is its cold run: first token and throughput)
#   ours512      the mixed 200 twice at 512 rows, cache on and off (max model len 8192, the peer's)
#   gates        only with GATES=1, last: the prefix-cache gates on the GPU (small-trained, fp16, every backend)
# Files in $OUT (7, 8 with GATES=1): nv32.log nv512.log ours32.log ours512.log runs32.jsonl runs512.jsonl table.txt
# (gates.log); the table is printed last.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-340} ))
M15=qwen2.5-1.5b-random
CHUNK=${CHUNK:-8192}
declare -a SUMMARY
PARTS=${PARTS:-nv32 nv512 ours32 ours512}
part() {   # part NAME MAX_SECONDS CMD...: output to $OUT/NAME.log
  local name=$1 max=$2; shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  local left=$(( DEADLINE - $(date +%s) - 15 ))
  (( left < max )) && max=$left
  if (( max < 10 )); then SUMMARY+=("$name: not run (deadline)"); return; fi
  local t0=$(date +%s)
  # SIGINT first: the bench writes what it measured before it stops
  timeout -s INT -k 20 "$max" "$@" > "$OUT/$name.log" 2>&1
  SUMMARY+=("$name: rc=$? in $(( $(date +%s) - t0 ))s (limit $max)")
}

# the peer: unpacked and its one dependency installed once per machine (run_peer.py's docstring)
NV=.device/nano-vllm
[ -f $NV/run_peer.py ] || NV=shared/peers/nano-vllm
[ -f $NV/run_peer.py ] || NV=../shared/peers/nano-vllm
if [ ! -d /tmp/nanovllm/nanovllm ]; then
  mkdir -p /tmp/nanovllm && tar xzf $NV/nano-vllm-*.tar.gz -C /tmp/nanovllm --strip-components=1
  python3 -m pip install -q --no-index --no-deps --target /tmp/nanovllm-site $NV/xxhash-*.whl
fi
export FLASH_ATTN_PATH=${FLASH_ATTN_PATH:-${STEPGATE_FLASH_ATTN_PATH:-}}

part nv32 100 python3 $NV/run_peer.py --max-num-seqs 32 --requests 200 --new-tokens 128
part nv512 80 python3 $NV/run_peer.py --max-num-seqs 512 --requests 200 --new-tokens 128
BENCH=(python3 -m bench.serving --model $M15 --device cuda --engine flash --no-progress --closed --uniform ""
       --new-tokens 128 --prefix-cache on,off --passes 2 --warmups 0 --reps ${REPS:-1})
part ours32 $(( 150 * ${REPS:-1} )) "${BENCH[@]}" --chunk-tokens $CHUNK --out results/prefix32 --max-batch 32 \
  --batches 200 --shared 200
part ours512 $(( 110 * ${REPS:-1} )) "${BENCH[@]}" --chunk-tokens ${CHUNK512:-$CHUNK} --out results/prefix512 \
  --max-batch 512 --max-model-len 8192 --batches 200
[ "${GATES:-0}" = 1 ] && part gates 120 python3 -m pytest gates/test_prefix_cache.py --device cuda --model small-trained \
  -q -p no:cacheprovider -rs --gate-summary /tmp/gate_summary_prefix.json
cp results/prefix32/flash/runs.jsonl "$OUT/runs32.jsonl" 2>/dev/null
cp results/prefix512/flash/runs.jsonl "$OUT/runs512.jsonl" 2>/dev/null

python3 - "$OUT" "${SUMMARY[@]}" > "$OUT/table.txt" 2>&1 <<'EOF'
import json, os, sys
out, parts = sys.argv[1], sys.argv[2:]
def lines(name):
    p = os.path.join(out, name)
    return open(p).read().splitlines() if os.path.exists(p) else []
peer = {}
for rows in (32, 512):
    for l in lines(f"nv{rows}.log"):
        if l.startswith("{") and '"nano-vllm"' in l:
            r = json.loads(l)
            peer[(rows, r["prefix_cache"])] = r["wall_s"]
ours, reps = {}, {}
for rows in (32, 512):
    for l in lines(f"runs{rows}.jsonl"):
        r = json.loads(l)
        key = (rows, r["workload"].split("@")[0].split("-new")[0], r["prefix_cache"], r["pass_no"])
        reps.setdefault(key, []).append(r)
for key, rs in reps.items():   # the run whose time to last is the median (the lower middle one of an even count)
    ours[key] = sorted(rs, key=lambda r: r["time_to_last_s"])[(len(rs) - 1) // 2]
f = lambda x, nd=3: "-" if x is None else f"{x:.{nd}f}"
print("parts: " + "; ".join(parts))
print("\nRepeated mixed 200 (128 new tokens), second pass on one engine: time to last request, s")
print("| rows | ours cache on | ours cache off | nano-vllm warm (pass 2) | nano-vllm cold (pass 1) | ours on / nano warm "
      "| ours on: hit rate, pages saved |")
print("|---|---|---|---|---|---|---|")
for rows in (32, 512):
    on, off = ours.get((rows, "mixed", "on", 2)), ours.get((rows, "mixed", "off", 2))
    warm, cold = peer.get((rows, "warm")), peer.get((rows, "cold"))
    t_on = on and on["time_to_last_s"]
    print(f"| {rows} | {f(t_on)} | {f(off and off['time_to_last_s'])} | {f(warm)} | {f(cold)} | "
          f"{f(t_on / warm if t_on and warm else None)} | "
          f"{f(on and on['prefix_hit_rate'])}, {on['prefix_pages_saved'] if on else '-'} |")
print("\nShared-prefix workload (200 requests, 1024-token system prompt, 32 rows), pass 1 (cold engine)")
print("| cache | first token median, s | time to last, s | tokens/s | hit rate | pages saved | evictions |")
print("|---|---|---|---|---|---|---|")
for mode in ("on", "off"):
    r = ours.get((32, "shared", mode, 1))
    if r:
        print(f"| {mode} | {f(r['ttft_median_s'])} | {f(r['time_to_last_s'])} | {f(r['tokens_per_s'], 1)} | "
              f"{f(r['prefix_hit_rate'])} | {r['prefix_pages_saved']} | {r['prefix_evictions']} |")
    else:
        print(f"| {mode} | (no row: see ours32.log) |")
EOF
tail -n 4 "$OUT"/ours32.log "$OUT"/ours512.log "$OUT"/gates.log 2>/dev/null | grep -v "^$"
cat "$OUT/table.txt"
