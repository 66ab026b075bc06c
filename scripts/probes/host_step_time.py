"""Host time of a step, on a CPU, with the 1.5B shape's page geometry (256-slot pages, tables 128 pages wide).

    python -m scripts.probes.host_step_time [--rows 31] [--chunk 512] [--reps 300]
    python -m scripts.probes.host_step_time --repo /path/to/other/checkout      # the same on another checkout
    python -m scripts.probes.host_step_time --engine [--rows 32] [--chunk 512] [--passes 5] [--profile 25]

Default: packing alone, the eager `ModelRunner.build` against the captured paths' in-place fills (`StepGraphs.fill`
for a loaded step, `DecodeGraphs.fill` for a pure decode step), with the mixed draw's histories. The attention
backend is a fake whose `prepare` does nothing, so only packing is timed (no model, no kernel). The model is a
one-layer stand-in: packing depends on pages and positions, not on the model's width.

--engine: a whole `Engine.step`'s host side per step kind, serving a closed mixed draw (MIXED, --new-tokens each,
--requests of them, all at time zero) at --rows rows and --chunk prompt positions a step, with the captured steps
(`DecodeGraphs`, `StepGraphs`) in their off-CUDA emulation. Included: scheduling and admission, the pool and the
prefix cache, the schedule log, the fills, replay bookkeeping, sampling (argmax and `.tolist()` on a CPU logits
buffer of a 32-token vocabulary: about a torch op's dispatch each), booking the tokens, finish_step, the trace.
Excluded: the forward itself (the model is `InstantModel`: a replay returns the static logits at once), the
host-to-device copy of the static buffer (a no-op here: an asynchronous copy on CUDA, a memcpy on a CPU), the graph
launch, and the wait for the device at the readback. --profile N prints the top N functions by own time (cProfile)
over one more pass."""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if "--repo" in sys.argv:     # before the imports below: which checkout's engine is timed
    REPO = Path(sys.argv[sys.argv.index("--repo") + 1]).resolve()
    sys.path.insert(0, str(REPO))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.model import ModelShape, Qwen2  # noqa: E402
from engine.pool import PagePool, pages_for  # noqa: E402
from engine.request import Request, State  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.scheduler import CHUNK_TOKENS, Chunk  # noqa: E402
from engine.workload import MIXED  # noqa: E402
from kernels.base import AttentionBackend  # noqa: E402

PAGE = 256
MAX_LEN = 32768           # the 1.5B shape's max positions: tables of 128 pages
VOCAB = 32                # --engine: sampling reads [rows, VOCAB] logits (the 1.5B vocabulary would time a CPU argmax)


class FakeBackend(AttentionBackend):
    name = "fake"
    graph_safe_decode = True
    graph_safe_prefill = True


def setup(rows: int, chunk: int):
    shape = ModelShape(1000, 64, 128, 1, 2, 1, 32, 1e6, 1e-6, MAX_LEN, False)
    specs = MIXED.scaled(rows).requests(1000)
    need = sum(-(-(len(s.prompt) + s.budget) // PAGE) for s in specs) + -(-2 * chunk // PAGE) + 2
    pool = PagePool(need + 1, PAGE)
    runner = ModelRunner(Qwen2(shape), pool.num_pages, PAGE, "torch", "cpu", torch.float32, pad_page=True)
    runner.backend = FakeBackend()
    decodes = []
    for s in specs:
        r = Request(s.request_id, s.prompt, s.budget)
        pool.reserve(r.request_id, r.slots_needed)
        r.state, r.num_cached, r.output = State.DECODE, len(s.prompt), [7]
        decodes.append(r)
    long = Request("chunked", [5] * (2 * chunk), 1)
    pool.reserve(long.request_id, long.slots_needed)
    long.state, long.num_cached = State.PREFILL, chunk
    return runner, pool, decodes, Chunk(long, chunk, chunk)


def median_us(fn, reps: int) -> tuple[float, float]:
    """(median, minimum) microseconds: on a shared machine the minimum is the steadier figure."""
    for _ in range(10):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6, min(ts) * 1e6


# -- --engine: a whole step's host side -------------------------------------------------------------------------
class InstantModel:
    """Stands in for the forward: a replay gets its static logits back at once, an eager step (a plan no captured
    bucket holds) zeros. Holds no weights."""

    def __init__(self, shape: ModelShape):
        self.shape = shape
        self.out_width = shape.vocab_size     # as Qwen2's: the captured steps' static logits are this wide
        self.zeros = torch.zeros(0, shape.vocab_size)

    def __call__(self, tokens, positions, kv_caches, ctx, logit_rows, out=None):
        if out is not None:
            return out
        n = tokens.shape[0] if logit_rows is None else logit_rows.shape[0]
        if self.zeros.shape[0] < n:
            self.zeros = torch.zeros(n, self.shape.vocab_size)
        return self.zeros[:n]


def engine_setup(rows: int, chunk: int, new_tokens: int, overlap: bool = False) -> Engine:
    """An Engine on the CPU serving the 1.5B geometry with captured steps emulated and an instant forward; its pool
    holds `rows` rows of the longest mixed request, so only the rows limit admission."""
    # one layer, one KV head of 4 dims: the KV cache is never read, only allocated (twice: the Engine's own runner,
    # then the one with the pad page that the captured steps need)
    shape = ModelShape(VOCAB, 8, 8, 1, 1, 1, 4, 1e6, 1e-6, MAX_LEN, False)
    pages = max(rows * pages_for(max(MIXED.prompt_lengths) + new_tokens, PAGE), pages_for(MAX_LEN, PAGE)) + 1
    cfg = EngineConfig(forward="fused", backend="torch", page_size=PAGE, max_batch=rows, chunk_tokens=chunk,
                       num_pages=pages, max_model_len=MAX_LEN, cuda_graphs=False, sync_trace=True, progress=False)
    model = InstantModel(shape)
    eng = Engine(cfg, loaded=(model, None, "instant"))
    width = eng.pool.pages_needed(MAX_LEN)
    runner = ModelRunner(model, pages, PAGE, "torch", "cpu", torch.float32, pad_page=True)
    runner.backend = FakeBackend()
    runner.capture_decode_graphs(rows, width, progress=False)        # as build_runner on CUDA, emulated
    runner.capture_step_graphs(chunk + rows, rows, width, progress=False)
    for g in (runner.graphs, runner.step_graphs):
        g.forward = lambda key, g=g: g.logits       # the replay: no forward
        g.upload = lambda upto=None: None           # the host-to-device copy: an async enqueue on CUDA
    runner.graph_logits.zero_()
    eng.runner = runner
    # with steps launched ahead, a step's host side also foresees the next one and packs it (its launch too)
    eng.overlap = overlap and hasattr(runner, "launch_ahead")
    return eng


def serve_pass(rows: int, chunk: int, requests: int, new_tokens: int, profiler=None, overlap: bool = False):
    """Serve one closed mixed draw to its end; returns [(kind, decode tokens, seconds)] per step and the engine."""
    eng = engine_setup(rows, chunk, new_tokens, overlap)
    for s in MIXED.with_budget(new_tokens).scaled(requests).requests(VOCAB):
        eng.submit(s.prompt, s.budget, s.request_id)
    steps = []
    clock = time.perf_counter
    while eng.scheduler.has_work:
        if profiler is not None:
            profiler.enable()
        t = clock()
        rec = eng.step()
        dt = clock() - t
        if profiler is not None:
            profiler.disable()
        steps.append((str(rec.kind), rec.decode_tokens, dt))
    return steps, eng


def engine_main(a) -> int:
    requests = a.requests or 2 * a.rows
    by_kind: dict[str, list[float]] = defaultdict(list)     # per pass, each kind's median; and every step's time
    every: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, tuple[int, float]] = {}
    fallbacks = 0
    for _ in range(a.passes):
        steps, eng = serve_pass(a.rows, a.chunk, requests, a.new_tokens, overlap=a.overlap)
        fallbacks = eng.runner.step_graphs.fallbacks
        kinds = defaultdict(list)
        for kind, d, dt in steps:
            kinds[kind].append((d, dt))
        for kind, xs in kinds.items():
            ts = [dt for _, dt in xs]
            by_kind[kind].append(statistics.median(ts))
            every[kind] += ts
            counts[kind] = (len(xs), statistics.median(d for d, _ in xs))
    print(f"{REPO}: host time of Engine.step (instant forward, captured steps emulated), us: {requests} mixed "
          f"requests of {a.new_tokens} new tokens, {a.rows} rows, chunk {a.chunk}, pages of {PAGE}, {a.passes} "
          f"passes; eager fallbacks {fallbacks} a pass" +
          (f"; steps launched ahead (overlap) {eng.steps_ahead} of {len(steps)} in the last pass" if a.overlap else ""))
    print(f"  {'kind':12s} {'steps':>6s} {'rows':>6s} {'min':>9s} {'median':>9s} {'median of pass medians':>24s}")
    for kind in ("pure-decode", "loaded", "chunk-only"):
        if kind in every:
            n, rows = counts[kind]
            print(f"  {kind:12s} {n:6d} {rows:6.0f} {min(every[kind]) * 1e6:9.1f} "
                  f"{statistics.median(every[kind]) * 1e6:9.1f} {statistics.median(by_kind[kind]) * 1e6:24.1f}")
    if a.profile:
        prof = cProfile.Profile()
        serve_pass(a.rows, a.chunk, requests, a.new_tokens, prof, overlap=a.overlap)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.profile)
        print(f"cProfile of one pass's steps (top {a.profile} by own time):")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip()
                        and not line.startswith(("Ordered by", "   List reduced"))))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.host_step_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None,
                    help="decode rows of the loaded step (default 31); --engine: max_batch (default 32)")
    ap.add_argument("--chunk", type=int, default=CHUNK_TOKENS,
                    help="positions in the loaded step's prompt chunk; --engine: chunk_tokens")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--engine", action="store_true", help="time whole engine steps by kind (module docstring)")
    ap.add_argument("--requests", type=int, default=None, help="--engine: requests served (default 2 x rows)")
    ap.add_argument("--new-tokens", type=int, default=128, help="--engine: each request's budget")
    ap.add_argument("--passes", type=int, default=5, help="--engine: closed runs timed, a fresh engine each")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="--engine: then profile one more pass and print the top N functions by own time")
    ap.add_argument("--overlap", action="store_true",
                    help="--engine: with steps launched ahead (EngineConfig.overlap): each step also foresees and "
                         "packs the next")
    ap.add_argument("--repo", default=None, help="the checkout whose engine is timed (default: this one)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.engine:
        a.rows = a.rows or 32
        return engine_main(a)
    a.rows = a.rows or 31
    runner, pool, decodes, chunk = setup(a.rows, a.chunk)
    owned = pool.owned
    width = -(-MAX_LEN // PAGE)
    out = {"eager build, loaded": median_us(lambda: runner.build([chunk], decodes, owned), a.reps),
           "eager build, pure decode": median_us(lambda: runner.build([], decodes, owned), a.reps)}
    try:
        from engine.graphs import DecodeGraphs
        dg = DecodeGraphs(runner, max(a.rows, 32), width, progress=False)
        out["DecodeGraphs.fill, pure decode"] = median_us(lambda: dg.fill(decodes, owned), a.reps)
    except Exception as e:  # noqa: BLE001 (report what this checkout lacks, time the rest)
        print(f"DecodeGraphs: {type(e).__name__}: {e}")
    try:
        from engine.step_graphs import StepGraphs
        sg = StepGraphs(runner, a.chunk + max(a.rows, 32) + 1, max(a.rows, 32) + 1, width, progress=False)
        b = sg.bucket_for([chunk], decodes)
        out["StepGraphs.fill, loaded"] = median_us(lambda: sg.fill([chunk], decodes, owned, b), a.reps)
    except ImportError:
        print("StepGraphs: not in this checkout")
    print(f"{REPO}: host time per step over {a.reps} runs (us, median / minimum): {a.rows} decode rows + a "
          f"{a.chunk}-position chunk, pages of {PAGE}, tables {width} pages wide")
    for k, (med, low) in out.items():
        print(f"  {k:34s} {med:9.1f} / {low:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
