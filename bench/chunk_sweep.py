"""The chunk budget as a measured knob: open-loop capacity and token gaps per `chunk_tokens`, one table, one plot.

A bigger chunk budget reads a prompt in fewer, longer steps: more capacity (fewer eager loaded steps, each nearer the
device's compute bound), but every decoder waits through each of those longer steps (a worse token gap). For each
budget this serves one open run (bench.serving) at one offered rate above capacity (so the served rate IS the
capacity) and reads the served rate and the incumbents' token gaps (median, p99, worst).

    python -m bench.chunk_sweep --model qwen2.5-1.5b-random --device cuda --engine flash \\
        --chunks 512,1024,2048,4096 --arrivals 200 --rate 200 --new-tokens 128 --out results/chunk-sweep
    python -m bench.chunk_sweep --chunks 64,128,256,512 --arrivals 24 --rate 200 --threads 1   # small model, CPU

Writes <out>/chunk_sweep.csv, chunk_sweep.md and chunk_sweep.png; each budget's raw rows go to <out>/chunk-<c>/.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.config import LINEAGE

from .cli import DEVICE_HELP, ENGINE_HELP, cannot_run, parse
from .plots import draw_chunk_sweep
from .serving import ServingOptions, serve
from .stats import fmt, ints, write_csv

PROG = "bench.chunk_sweep"
FIELDS = ["chunk_tokens", "offered_rate", "served_rate", "gap_median_ms", "gap_p99_ms", "gap_worst_ms",
          "queue_wait_median_s", "ttft_median_s", "steps", "loaded_step_median_ms", "pure_decode_step_median_ms"]


@dataclass
class SweepOptions:
    model: str = "small"
    device: str = "cpu"
    engine: str = "fused"
    chunks: tuple[int, ...] = (512, 1024, 2048, 4096)
    arrivals: int = 200
    rate: float = 200.0             # offered req/s: above capacity, so served = capacity
    new_tokens: int = 128
    threads: int | None = None


def sweep_row(chunk: int, runs: list[dict]) -> dict:
    """The chunk sweep's row from one budget's serving rows (its last open run)."""
    r = [x for x in runs if x["part"] == "open"][-1]
    return dict(chunk_tokens=chunk, offered_rate=r["offered_rate"], served_rate=r["served_rate"],
                gap_median_ms=r["gap_median_ms"], gap_p99_ms=r["gap_p99_ms"], gap_worst_ms=r["gap_worst_ms"],
                queue_wait_median_s=r["queue_wait_median_s"], ttft_median_s=r["ttft_median_s"], steps=r["steps"],
                loaded_step_median_ms=r.get("step_loaded_median_ms"),
                pure_decode_step_median_ms=r.get("step_pure-decode_median_ms"))


def sweep(o: SweepOptions, out: Path | None = None, loaded=None) -> list[dict]:
    """One open run per chunk budget; a row each. `out`: each budget's raw rows go to <out>/chunk-<c>/."""
    rows = []
    for c in o.chunks:
        run = serve(ServingOptions(model=o.model, device=o.device, engine=o.engine, threads=o.threads, open=True,
                                   no_capped=True, chunk_tokens=c, arrivals=o.arrivals, rates=[o.rate],
                                   new_tokens=o.new_tokens, no_progress=True),
                    loaded=loaded, out=None if out is None else out / f"chunk-{c}" / o.engine)
        rows.append(sweep_row(c, run.runs))
    return rows


def table(rows: list[dict]) -> str:
    md = ["| chunk tokens | served (req/s) | token gap median / p99 / worst (ms) | loaded step median (ms) |",
          "|---|---|---|---|"]
    md += [f"| {r['chunk_tokens']} | {fmt(r['served_rate'], none='')} | {fmt(r['gap_median_ms'], 1, '')} / "
           f"{fmt(r['gap_p99_ms'], 1, '')} / {fmt(r['gap_worst_ms'], 1, '')} | "
           f"{fmt(r['loaded_step_median_ms'], 1, '')} |" for r in rows]
    return "\n".join(md) + "\n"


def write(out: Path, rows: list[dict]) -> list[str]:
    write_csv(out / "chunk_sweep.csv", FIELDS, rows)
    (out / "chunk_sweep.md").write_text(table(rows))
    drew = draw_chunk_sweep(rows, out / "chunk_sweep.png")
    return ["chunk_sweep.csv", "chunk_sweep.md"] + (["chunk_sweep.png"] if drew else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--device", default="cpu", help=DEVICE_HELP)
    ap.add_argument("--engine", default=None, choices=sorted(LINEAGE), help=ENGINE_HELP)
    ap.add_argument("--chunks", default="512,1024,2048,4096")
    ap.add_argument("--arrivals", type=int, default=200)
    ap.add_argument("--rate", type=float, default=200.0, help="offered req/s: above capacity, so served = capacity")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/chunk-sweep")
    a = parse(ap, argv)
    if cannot_run(PROG, a.engine, a.device):
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = sweep(SweepOptions(a.model, a.device, a.engine, tuple(ints(a.chunks)), a.arrivals, a.rate, a.new_tokens,
                              a.threads), out)
    files = write(out, rows)
    print(table(rows), end="")
    print(f"wrote {out}/: {' '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
