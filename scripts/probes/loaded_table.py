"""The results table of `scripts/h200_loaded.sh`: issue 18's "Must show" figures read from one call's files, each
with its target, its status and the command that produced it. Missing files read "not run".

    python -m scripts.probes.loaded_table RESULTS_DIR [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.scheduler import StepKind

WORKLOAD = "mixed-new128-200"       # bench.serving's closed mixed 200 at 128 new tokens


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ours(res: Path, name: str) -> dict | None:
    """Closed mixed 200 of one bench.serving run (results/<name>/flash/summary.json)."""
    s = load(res / name / "flash" / "summary.json")
    row = (s or {}).get("closed", {}).get(WORKLOAD)
    if not row or not row.get("time_to_last_median_s"):
        return None
    return dict(row, req_per_s=200 / row["time_to_last_median_s"])


def nano(res: Path, seqs: int) -> float | None:
    """nano-vllm's cold pass over 200 requests (req/s)."""
    rows = load(res / f"nano{seqs}.json") or []
    cold = [r for r in rows if r.get("requests") == 200 and r.get("prefix_cache") == "cold"]
    return cold[0]["req_per_s"] if cold else None


def step_medians(res: Path) -> dict:
    """(kind, graphed) -> median ms of the flash step benchmarks on the 1.5B shape."""
    out = {}
    for b in (load(res / "steps.json") or {}).get("benchmarks", []):
        x = b.get("extra_info", {})
        if x.get("engine") == "flash" and x.get("kind") and "qwen2.5-1.5b" in str(x.get("model")):
            out[x["kind"], bool(x.get("cuda_graphs"))] = b["stats"]["median"] * 1e3
    return out


def fmt(x, unit="", nd=2) -> str:
    return "not run" if x is None else f"{x:.{nd}f}{unit}"


def verdict(ok) -> str:
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def rows(res: Path) -> list[tuple]:
    c512, c8192, r512 = ours(res, "c512"), ours(res, "c8192"), ours(res, "r512")
    eager = ours(res, "c512-eager")
    serial = ours(res, "c8192-serial")
    n32, n512 = nano(res, 32), nano(res, 512)
    steps = step_medians(res)
    get = lambda r, k: None if r is None else r.get(k)  # noqa: E731
    ratio = lambda a, b: None if a is None or not b else a / b  # noqa: E731
    out = []

    def row(what, target, value, ok, where):
        out.append((what, target, value, verdict(ok), where))

    loaded = get(c512, "step_loaded_median_ms")
    row("median loaded step, chunk 512, closed 200 (trace)", "<= 6 ms", fmt(loaded, " ms"),
        None if loaded is None else loaded <= 6, "c512")
    fixed = steps.get((StepKind.LOADED, True))
    row("median loaded step, 32 rows + 512 chunk (step bench)", "<= 6 ms", fmt(fixed, " ms"),
        None if fixed is None else fixed <= 6, "steps")
    row("  same step eager (step bench)", "-", fmt(steps.get((StepKind.LOADED, False)), " ms"), None, "steps")
    row("median chunk-only step, chunk 512 (trace)", "-", fmt(get(c512, "step_chunk-only_median_ms"), " ms"), None,
        "c512")
    for name, part, r, target, seqs, n, need in (("chunk 512", "c512", c512, 40, 32, n32, 1.2),
                                                 ("chunk 8192", "c8192", c8192, 55, 32, n32, 1.2),
                                                 ("512 rows, chunk 16384", "r512", r512, 100, 512, n512, None)):
        rps = get(r, "req_per_s")
        x = ratio(rps, n)
        row(f"closed 200, {name}: req/s", f">= {target}", fmt(rps, " req/s"), None if rps is None else rps >= target,
            part)
        # need None: faster than the peer (ratio above 1)
        row(f"  ours / nano-vllm cold at {seqs} seqs ({fmt(n, ' req/s')})", f">= {need}x" if need else "> 1x",
            fmt(x, "x"), None if x is None else (x >= need if need else x > 1), f"{part}, nano{seqs}")
    row("closed 200, chunk 512, graphs off: req/s", "-", fmt(get(eager, "req_per_s"), " req/s"), None, "c512-eager")
    row("closed 200, chunk 8192, overlap off: req/s", "-", fmt(get(serial, "req_per_s"), " req/s"), None,
        "c8192-serial")
    for part in ("c512-splitkv", "c8192-splitkv", "r512-splitkv"):   # --decode-kernel flash, same call
        r = ours(res, part)
        if r is not None:
            row(f"closed 200, {part} (flash-attn split-KV decode): req/s; pure decode step", "-",
                f"{fmt(r['req_per_s'], ' req/s')}; {fmt(r.get('step_pure-decode_median_ms'), ' ms')}", None, part)
    gap = get(c512, "gap_worst_ms")
    row("worst token gap, chunk 512", "<= 12 ms", fmt(gap, " ms"), None if gap is None else gap <= 12, "c512")
    pure = get(c512, "step_pure-decode_median_ms")
    row("median pure decode step, chunk 512 (trace)", "<= 2.5 ms", fmt(pure, " ms"),
        None if pure is None else pure <= 2.5, "c512")
    for part, r in (("c8192", c8192), ("c8192-serial", serial)):
        row(f"  median pure decode step, {part} (trace)", "-", fmt(get(r, "step_pure-decode_median_ms"), " ms"),
            None, part)
    row("  pure decode step, 32 rows (step bench)", "-", fmt(steps.get((StepKind.PURE_DECODE, True)), " ms"), None,
        "steps")
    for part, r in (("c512", c512), ("c8192", c8192), ("r512", r512)):
        if r is not None and r.get("steps_ahead") is not None:
            row(f"  steps launched ahead / dropped, {part}", "-",
                f"{r['steps_ahead']:.0f} / {r.get('ahead_discarded', 0):.0f}", None, part)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.loaded_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    table = rows(Path(a.results))
    print("| figure | target | measured | status | part |")
    print("|---|---|---|---|---|")
    for r in table:
        print("| " + " | ".join(r) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps([dict(zip(("figure", "target", "measured", "status", "part"), r))
                                            for r in table], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
