"""Per-layer decode attention time of every available decode kernel, beside its memory-bandwidth floor, and the
rows-vs-packed comparison that motivates splitting attention in a fused step.

Setup (defaults): 32 decode requests whose histories are the mixed workload's draw (engine/workload.py MIXED: prompt
lengths from {16, 64, 256, 1024, 4096}) plus decode progress drawn in [1, budget]; Qwen2.5-1.5B's attention heads
(12 query / 2 KV heads, head dim 128), fp16, 256-slot pages in shuffled order, on CUDA.

For each kernel:
- rows: the decode kernel, one query row per request (what a fused step sends it); flex is shown in both its decode
  layouts ('flex': a batch of rows, each against its own gathered history; 'flex-pkd': the rows as the queries of one
  call over all histories packed back to back);
- packed: the same 32 tokens sent as ONE prefill-style call, each a sequence of one query (what a kernel that tiles
  query rows gets if decode tokens stay packed with the chunks);
- floor: bytes of K and V the step must read (sum of histories x kv heads x head dim x 2 bytes x 2) divided by the
  device-to-device copy bandwidth measured here (bytes read + written by a large copy, per second);
- prepare: the per-step work shared by all layers (gather indices, block masks), once per step, not per layer.
Times are medians after warm-up: triton.testing.do_bench on CUDA (L2 flushed between runs) or CUDA events if Triton
is missing; time.perf_counter on CPU. The table comes last; --out writes the same rows as CSV.

    python -m bench.kernel_bench                             # CUDA, the setup above
    python -m bench.kernel_bench --device cpu --tiny         # a smoke run on CPU (tiny sizes, fp32)
    STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext python -m bench.kernel_bench --out results/kernels.csv
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys
import time

import torch

import kernels
from engine.dtypes import torch_dtype
from kernels import AttnBatch


def mixed_histories(n: int, seed: int) -> list[int]:
    """n decode histories: a prompt length drawn as the mixed workload draws it, plus decode progress in [1, budget]."""
    from engine.workload import MIXED
    rng = random.Random(seed)
    return [len(s.prompt) + rng.randint(1, s.budget) for s in MIXED.scaled(n).requests()]


def build_cache(hist, page_size, kv_heads, head_dim, dtype, device, seed):
    """A cache with each history in shuffled pages (plus as many spare pages), zero elsewhere; its block tables."""
    rng = random.Random(seed)
    need = [-(-h // page_size) for h in hist]
    N = 1 + 2 * sum(need)
    pages = rng.sample(range(1, N), sum(need))
    tables, i = [], 0
    for n in need:
        tables.append(pages[i:i + n])
        i += n
    g = torch.Generator(device="cpu").manual_seed(seed)
    kc = (torch.randn(N, page_size, kv_heads, head_dim, generator=g) * 0.5).to(device, dtype)
    vc = (torch.randn(N, page_size, kv_heads, head_dim, generator=g) * 0.5).to(device, dtype)
    kc[0] = 0
    vc[0] = 0
    return kc, vc, tables


def attn_batch(q_lens, kv_lens, tables, page_size, device) -> AttnBatch:
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return AttnBatch(list(q_lens), list(kv_lens), bt, torch.tensor(kv_lens, dtype=torch.int32, device=device),
                     torch.tensor(cu, dtype=torch.int32, device=device), page_size)


def timer(device: torch.device, rep_ms: int):
    """fn -> median milliseconds, after warm-up."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            def t_cuda(fn):
                fn()
                torch.cuda.synchronize(device)
                return float(do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))
            return t_cuda
        except ImportError:
            def t_events(fn):
                for _ in range(5):
                    fn()
                times = []
                for _ in range(50):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b))
                return statistics.median(times)
            return t_events

    def t_cpu(fn):
        fn()
        fn()
        times = []
        deadline = time.perf_counter() + rep_ms / 1000
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)
    return t_cpu


def copy_bandwidth(device: torch.device, measure, nbytes: int) -> float:
    """Bytes per second moved (read + written) by a device-to-device copy of nbytes."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms / 1000)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float16 (CUDA default) / bfloat16 / float32 (CPU default)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--histories", default=None, help="comma-separated history lengths (instead of the mixed draw)")
    ap.add_argument("--backends", default="all", help="comma-separated backends, or all available")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep-ms", type=int, default=200, help="timing budget per measurement (ms)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke run")
    ap.add_argument("--out", default=None, help="write the table's rows as CSV here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device is visible; use --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    if args.tiny:
        args.requests, args.heads, args.kv_heads, args.head_dim = min(args.requests, 8), 4, 2, 64
        args.page_size = 64 if args.page_size == 256 and device.type == "cpu" else args.page_size
    dtype = torch_dtype(args.dtype) if args.dtype else (torch.float16 if device.type == "cuda" else torch.float32)
    if args.histories:
        hist = [int(x) for x in args.histories.split(",")]
    else:
        hist = mixed_histories(args.requests, args.seed)
        if args.tiny:
            hist = [max(1, h // 16) for h in hist]
    B, H, KVH, D, P = len(hist), args.heads, args.kv_heads, args.head_dim, args.page_size
    scale = D ** -0.5
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * sum(hist) * KVH * D * elem

    measure = timer(device, args.rep_ms)
    bw = copy_bandwidth(device, measure, (1 << 30) if device.type == "cuda" else (64 << 20))
    floor_ms = kv_bytes / bw * 1000

    kc, vc, tables = build_cache(hist, P, KVH, D, dtype, device, args.seed)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    q = torch.randn(B, H, D, generator=g).to(device, dtype)

    names = list(kernels.BACKENDS) if args.backends == "all" else [n.strip() for n in args.backends.split(",")]
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}, {str(dtype).replace('torch.', '')}, heads {H}/{KVH}, head_dim {D}, page_size {P}")
    print(f"{B} decode requests, histories: mean {statistics.mean(hist):.0f}, min {min(hist)}, max {max(hist)}, "
          f"sum {sum(hist)} slots; K+V read per layer {kv_bytes / 2**20:.2f} MiB; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s (read + written); floor {floor_ms * 1000:.1f} us")

    variants = []
    for name in names:
        cls = kernels.backend_class(name)
        reason = cls.why_unavailable(device, P)
        if reason is None:
            reason = cls.why_unsupported(dtype=dtype)
        if reason:
            print(f"  {name}: skipped: {reason}")
            continue
        if name == "flex":    # both decode layouts (kernels/flex_backend.py)
            variants += [("flex", cls("rows")), ("flex-pkd", cls("packed"))]
        else:
            variants.append((name, kernels.get_backend(name, device, P)))

    rows, ref = [], None
    for name, be in variants:
        with torch.inference_mode():
            dec = attn_batch([1] * B, hist, tables, P, device)
            t0 = time.perf_counter()
            be.prepare(dec, "decode")
            out = be.decode(q, kc, vc, dec, scale)          # first call: compiles where the kernel compiles
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_s = time.perf_counter() - t0
            rows_ms = measure(lambda: be.decode(q, kc, vc, dec, scale))
            prep_ms = measure(lambda: be.prepare(attn_batch([1] * B, hist, tables, P, device), "decode"))
            pk = attn_batch([1] * B, hist, tables, P, device)
            be.prepare(pk, "prefill")
            out_pk = be.prefill(q, kc, vc, pk, scale)
            packed_ms = measure(lambda: be.prefill(q, kc, vc, pk, scale))
        if ref is None:
            ref = out.float()
        diff = float((out.float() - ref).abs().max())
        diff_pk = float((out_pk.float() - out.float()).abs().max())
        rows.append(dict(kernel=name, rows_ms=rows_ms, packed_ms=packed_ms, packed_over_rows=packed_ms / rows_ms,
                         floor_ms=floor_ms, rows_over_floor=rows_ms / floor_ms, prepare_ms=prep_ms,
                         first_call_s=first_s, max_diff_vs_first=diff, packed_vs_rows_diff=diff_pk,
                         device=str(device), dtype=str(dtype).replace("torch.", ""), requests=B, heads=H,
                         kv_heads=KVH, head_dim=D, page_size=P, mean_history=statistics.mean(hist),
                         kv_bytes=kv_bytes, copy_bw_bytes_per_s=bw))
        print(f"  {name}: rows {rows_ms * 1000:.1f} us, packed {packed_ms * 1000:.1f} us (first call {first_s:.1f} s)",
              flush=True)

    if args.out and rows:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}")

    print()
    print("per-layer decode attention, median (us); floor = K+V bytes / copy bandwidth; diff = max |out - first "
          "kernel's out|")
    hdr = f"{'kernel':<10}{'rows':>10}{'packed':>10}{'packed/rows':>13}{'floor':>9}{'rows/floor':>12}" \
          f"{'prepare':>10}{'diff':>11}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['kernel']:<10}{r['rows_ms'] * 1000:>10.1f}{r['packed_ms'] * 1000:>10.1f}"
              f"{r['packed_over_rows']:>12.2f}x{r['floor_ms'] * 1000:>9.1f}{r['rows_over_floor']:>11.2f}x"
              f"{r['prepare_ms'] * 1000:>10.1f}{r['max_diff_vs_first']:>11.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
