"""Host time of packing one step, on a CPU: the eager `ModelRunner.build` against the captured paths' in-place fills
(`StepGraphs.fill` for a loaded step, `DecodeGraphs.fill` for a pure decode step), with the 1.5B shape's page
geometry (256-slot pages, tables 128 pages wide) and the mixed draw's histories.

    python -m bench.host_step_time [--rows 31] [--chunk 512] [--reps 300]
    python -m bench.host_step_time --repo /path/to/other/checkout      # the same on another checkout

The attention backend is a fake whose `prepare` does nothing, so only packing is timed (no model, no kernel). The
model is a one-layer stand-in: packing depends on pages and positions, not on the model's width."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if "--repo" in sys.argv:     # before the imports below: which checkout's engine is timed
    REPO = Path(sys.argv[sys.argv.index("--repo") + 1]).resolve()
    sys.path.insert(0, str(REPO))

from engine.model import ModelShape, Qwen2  # noqa: E402
from engine.pool import PagePool  # noqa: E402
from engine.request import Request, State  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.scheduler import CHUNK_TOKENS, Chunk  # noqa: E402
from engine.workload import MIXED  # noqa: E402
from kernels.base import AttentionBackend  # noqa: E402

PAGE = 256
MAX_LEN = 32768           # the 1.5B shape's max positions: tables of 128 pages


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_step_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=31, help="decode rows of the loaded step")
    ap.add_argument("--chunk", type=int, default=CHUNK_TOKENS, help="positions in the loaded step's prompt chunk")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--repo", default=None, help="the checkout whose engine is timed (default: this one)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
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
