"""The chunk budget as a measured knob: open-loop capacity and token gaps per `chunk_tokens`, one table, one plot.

A bigger chunk budget reads a prompt in fewer, longer steps: more capacity (fewer eager loaded steps, each nearer the
device's compute bound), but every decoder waits through each of those longer steps (a worse token gap). For each
budget this runs `engine.bench --open` at one offered rate above capacity (so the served rate IS the capacity) and
reads the served rate and the incumbents' token gaps (median, p99, worst).

    python scripts/chunk_sweep.py --model qwen2.5-1.5b-random --device cuda --engine flash \\
        --chunks 512,1024,2048,4096 --arrivals 200 --rate 200 --new-tokens 128 --out results/chunk-sweep
    python scripts/chunk_sweep.py --chunks 64,128,256,512 --arrivals 24 --rate 200 --threads 1   # small model, CPU

Writes <out>/chunk_sweep.csv, chunk_sweep.md and chunk_sweep.png; each budget's raw rows stay in <out>/chunk-<c>/.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import bench  # noqa: E402

FIELDS = ["chunk_tokens", "offered_rate", "served_rate", "gap_median_ms", "gap_p99_ms", "gap_worst_ms",
          "queue_wait_median_s", "ttft_median_s", "steps", "loaded_step_median_ms", "pure_decode_step_median_ms"]


def sweep_row(out: Path, engine: str, chunk: int) -> dict:
    rows = [json.loads(x) for x in (out / engine / "runs.jsonl").read_text().splitlines() if x.strip()]
    r = [x for x in rows if x["part"] == "open"][-1]
    return dict(chunk_tokens=chunk, offered_rate=r["offered_rate"], served_rate=r["served_rate"],
                gap_median_ms=r["gap_median_ms"], gap_p99_ms=r["gap_p99_ms"], gap_worst_ms=r["gap_worst_ms"],
                queue_wait_median_s=r["queue_wait_median_s"], ttft_median_s=r["ttft_median_s"], steps=r["steps"],
                loaded_step_median_ms=r.get("step_loaded_median_ms"),
                pure_decode_step_median_ms=r.get("step_pure-decode_median_ms"))


def fmt(x, nd=2):
    return "" if x is None else f"{x:.{nd}f}"


def write(out: Path, rows: list[dict]) -> list[str]:
    with open(out / "chunk_sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    md = ["| chunk tokens | served (req/s) | token gap median / p99 / worst (ms) | loaded step median (ms) |",
          "|---|---|---|---|"]
    md += [f"| {r['chunk_tokens']} | {fmt(r['served_rate'])} | {fmt(r['gap_median_ms'], 1)} / "
           f"{fmt(r['gap_p99_ms'], 1)} / {fmt(r['gap_worst_ms'], 1)} | {fmt(r['loaded_step_median_ms'], 1)} |"
           for r in rows]
    (out / "chunk_sweep.md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["chunk_sweep.csv", "chunk_sweep.md"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["chunk_tokens"] for r in rows]
    ax.plot(xs, [r["served_rate"] for r in rows], "o-", color="tab:blue", label="capacity (served req/s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk budget (prompt positions per step)")
    ax.set_ylabel("capacity, requests/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["gap_worst_ms"] for r in rows], "s--", color="tab:red", label="worst token gap")
    ax2.plot(xs, [r["gap_p99_ms"] for r in rows], "^:", color="tab:orange", label="p99 token gap")
    ax2.set_ylabel("token gap, ms", color="tab:red")
    fig.legend(loc="upper left", fontsize=8)
    ax.set_title("chunk budget: capacity vs token gaps")
    fig.tight_layout()
    fig.savefig(out / "chunk_sweep.png", dpi=120)
    plt.close(fig)
    return ["chunk_sweep.csv", "chunk_sweep.md", "chunk_sweep.png"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine", default="fused")
    ap.add_argument("--chunks", default="512,1024,2048,4096")
    ap.add_argument("--arrivals", type=int, default=200)
    ap.add_argument("--rate", type=float, default=200.0, help="offered req/s: above capacity, so served = capacity")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/chunk-sweep")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in bench.ints(a.chunks):
        args = ["--model", a.model, "--device", a.device, "--engine", a.engine, "--open", "--no-capped",
                "--chunk-tokens", str(c), "--arrivals", str(a.arrivals), "--rates", str(a.rate),
                "--new-tokens", str(a.new_tokens), "--out", str(out / f"chunk-{c}"), "--no-progress"]
        if a.threads:
            args += ["--threads", str(a.threads)]
        rc = bench.main(args)
        if rc:
            return rc
        rows.append(sweep_row(out / f"chunk-{c}", a.engine, c))
    files = write(out, rows)
    print((out / "chunk_sweep.md").read_text(), end="")
    print(f"wrote {out}/: {' '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
