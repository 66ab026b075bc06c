"""What regressed, by how much: compare two pytest-benchmark JSON files (a baseline and the current run). Against a
stored baseline this is history for a dashboard; the alert on a pull request is gates/ab.py's same-job A/B.

    python -m gates.alert                                   # the newest two runs under golden/benchmarks/
    python -m gates.alert --storage golden/benchmarks/h200  # the newest two runs of one machine's folder
    python -m gates.alert --baseline OLD.json --current NEW.json --markdown summary.md

Rules as vLLM's performance alerting: a latency (a benchmark's median time) over `--latency-threshold` (1.2) times
its baseline, or a throughput (an `extra_info` entry whose key ends in `_per_s`) under `--throughput-threshold`
(0.8) times its baseline, is a regression. Prints a table (benchmark, baseline, now, change, verdict); `--markdown`
writes the same table as Markdown (for a CI summary; `--append` to add to an existing file such as
$GITHUB_STEP_SUMMARY).

A benchmark of the baseline that the current run lacks (skipped, deselected, renamed) fails the comparison unless
`--allow-missing`; a benchmark new in the current run is listed as new. Runs of different machines (machine_info's
node, processor, machine and CPU brand, and a GPU name where one is recorded) or different engine configurations (a
benchmark's `extra_info` entries other than throughputs: model, engine, backend, device, dtype, page size, chunk,
rows, ...) are not compared unless `--allow-different-machines` / `--allow-different-config`.
Exit status: 0 when nothing regressed, 1 on a regression or a missing benchmark, 2 when the inputs are missing or
the runs are not comparable.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .paths import golden_root
from .prog import prog

DEFAULT_STORAGE = golden_root() / "benchmarks"
STATS = ("median", "mean", "min", "max")
GPU_KEYS = ("gpu", "gpu_name", "device_name")    # where a run may record its GPU (machine_info or extra_info)


@dataclass
class Row:
    benchmark: str
    metric: str               # "latency" or the throughput key
    baseline: float | None
    now: float | None
    higher_is_better: bool
    verdict: str = ""

    @property
    def change(self) -> float | None:
        if self.baseline in (None, 0) or self.now is None:
            return None
        return self.now / self.baseline


class InputError(Exception):
    pass


def _storage_dir(path: str | Path) -> Path:
    s = str(path)
    if s.startswith("file://"):
        s = s[len("file://"):]
    return Path(s)


def newest_two(storage: str | Path) -> tuple[Path, Path]:
    """(baseline, current): the newest saved run under `storage` that has a run saved before it in the same folder,
    and that run (pytest-benchmark keeps one folder per machine and numbers the runs it saves)."""
    root = _storage_dir(storage)
    files = [p for p in root.rglob("*.json") if p.is_file()] if root.is_dir() else []
    if not files:
        raise InputError(f"no pytest-benchmark JSON under {root}")
    # a machine's folder with one saved run (a card's first baseline, golden/benchmarks/h100) has nothing to compare
    paired = [p for p in files if any(q.name < p.name for q in p.parent.glob("*.json"))]
    if not paired:
        current = max(files, key=lambda p: (p.stat().st_mtime, p.name))
        raise InputError(f"{current.parent} holds one saved run ({current.name}); a baseline needs two")
    current = max(paired, key=lambda p: (p.stat().st_mtime, p.name))
    older = sorted(p for p in current.parent.glob("*.json") if p.name < current.name)
    return older[-1], current


def load(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{p}: not JSON ({e})") from None
    if not isinstance(data, dict) or "benchmarks" not in data:
        raise InputError(f"{p}: not a pytest-benchmark JSON (no 'benchmarks')")
    return data


def by_name(data: dict) -> dict[str, dict]:
    return {b.get("fullname") or b.get("name"): b for b in data["benchmarks"]}


def metrics(data: dict, stat: str, throughput_suffix: str) -> dict[tuple[str, str], tuple[float, bool]]:
    """(benchmark, metric) -> (value, higher_is_better)."""
    out = {}
    for name, b in by_name(data).items():
        value = (b.get("stats") or {}).get(stat)
        if value is not None:
            out[(name, "latency")] = (float(value), False)
        for k, v in (b.get("extra_info") or {}).items():
            if k.endswith(throughput_suffix) and isinstance(v, (int, float)):
                out[(name, k)] = (float(v), True)
    return out


def compare(baseline: dict, current: dict, stat: str = "median", latency_threshold: float = 1.2,
            throughput_threshold: float = 0.8, throughput_suffix: str = "_per_s") -> list[Row]:
    old = metrics(baseline, stat, throughput_suffix)
    new = metrics(current, stat, throughput_suffix)
    rows = []
    for key in sorted(set(old) | set(new)):
        o, n = old.get(key), new.get(key)
        hib = (n or o)[1]
        row = Row(key[0], key[1], o[0] if o else None, n[0] if n else None, hib)
        if o is None:
            row.verdict = "new"
        elif n is None:
            row.verdict = "missing"
        elif row.change is None:
            row.verdict = "no baseline value"
        elif hib:
            row.verdict = ("REGRESSION" if row.change < throughput_threshold else
                           "improved" if row.change > 1 / throughput_threshold else "ok")
        else:
            row.verdict = ("REGRESSION" if row.change > latency_threshold else
                           "improved" if row.change < 1 / latency_threshold else "ok")
        rows.append(row)
    return rows


def machine_identity(data: dict) -> dict[str, str]:
    """What names the machine a run was measured on; keys a run does not record are left out."""
    m = data.get("machine_info") or {}
    ident = {k: m.get(k) for k in ("node", "processor", "machine")}
    ident["cpu"] = (m.get("cpu") or {}).get("brand_raw")
    gpus = {str(m[k]) for k in GPU_KEYS if m.get(k)}
    gpus |= {str(e[k]) for b in data["benchmarks"] for e in [b.get("extra_info") or {}] for k in GPU_KEYS if e.get(k)}
    ident["gpu"] = ", ".join(sorted(gpus))
    return {k: str(v) for k, v in ident.items() if v}


def machine_differences(baseline: dict, current: dict) -> list[str]:
    """`key: 'baseline value' -> 'current value'` for what both runs record of their machine and differs."""
    old, new = machine_identity(baseline), machine_identity(current)
    return [f"{k} {old[k]!r} -> {new[k]!r}" for k in old if k in new and old[k] != new[k]]


def config_differences(baseline: dict, current: dict, throughput_suffix: str = "_per_s") -> list[str]:
    """Per benchmark in both runs, the extra_info entries both record that differ; throughputs are measurements,
    not configuration. (params are not compared: they hold reprs of code objects that change with the code.)"""
    old, new = by_name(baseline), by_name(current)
    out = []
    for name in sorted(old.keys() & new.keys()):
        eo, en = old[name].get("extra_info") or {}, new[name].get("extra_info") or {}
        diff = [f"{k} {eo[k]!r} -> {en[k]!r}" for k in sorted(eo.keys() & en.keys())
                if not k.endswith(throughput_suffix) and eo[k] != en[k]]
        if diff:
            out.append(f"{name}: " + ", ".join(diff))
    return out


def named(items: list[str], most: int = 5) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _fmt(v: float | None, hib: bool) -> str:
    if v is None:
        return "-"
    if hib:
        return f"{v:,.1f}/s"
    ms = v * 1e3
    return f"{ms:.3f} ms" if ms < 100 else f"{ms:.1f} ms"


def table(rows: list[Row], stat: str) -> tuple[list[str], list[list[str]]]:
    head = ["benchmark", "metric", f"baseline ({stat})", f"now ({stat})", "change", "verdict"]
    body = []
    for r in rows:
        ch = "-" if r.change is None else f"{r.change:.2f}x ({(r.change - 1) * 100:+.1f}%)"
        body.append([r.benchmark, r.metric, _fmt(r.baseline, r.higher_is_better), _fmt(r.now, r.higher_is_better),
                     ch, r.verdict])
    return head, body


def text_table(head, body) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def markdown_table(head, body) -> str:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for b in body:
        cells = [esc(c) for c in b]
        if b[-1] == "REGRESSION":
            cells[-1] = "**REGRESSION**"
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def resolve(a) -> tuple[Path, Path]:
    """(baseline, current) paths from the command line's --baseline / --current / --storage."""
    if a.current and a.baseline:
        return Path(a.baseline), Path(a.current)
    if a.current:
        cur_p = Path(a.current)
        older = sorted(p for p in cur_p.parent.glob("*.json") if p.name < cur_p.name)
        if not older:
            raise InputError(f"no baseline given and no earlier run next to {cur_p}")
        return older[-1], cur_p
    base_p, cur_p = newest_two(a.storage)
    return (Path(a.baseline) if a.baseline else base_p), cur_p


def comparability(a, baseline: dict, current: dict) -> tuple[list[str], list[str]]:
    """(refusals, warnings): differences of machine or configuration, refused unless the flag allows them."""
    refusals, warnings = [], []
    for what, diffs, allowed, flag in (
            ("machines", machine_differences(baseline, current), a.allow_different_machines,
             "--allow-different-machines"),
            ("engine configurations", config_differences(baseline, current, a.throughput_suffix),
             a.allow_different_config, "--allow-different-config")):
        if diffs:
            line = f"different {what} (baseline -> current): {named(diffs)}"
            (warnings if allowed else refusals).append(line if allowed else f"{line}; pass {flag} to compare anyway")
    return refusals, warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("gates.alert"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="baseline pytest-benchmark JSON (default: the run saved before --current)")
    ap.add_argument("--current", help="current pytest-benchmark JSON (default: the newest under --storage)")
    ap.add_argument("--storage", default=str(DEFAULT_STORAGE),
                    help="pytest-benchmark storage folder (file:// accepted) searched for the defaults")
    ap.add_argument("--stat", default="median", choices=STATS, help="the statistic compared (default: median)")
    ap.add_argument("--latency-threshold", type=float, default=1.2,
                    help="a latency over this times its baseline regressed (default 1.2)")
    ap.add_argument("--throughput-threshold", type=float, default=0.8,
                    help="a throughput under this times its baseline regressed (default 0.8)")
    ap.add_argument("--throughput-suffix", default="_per_s",
                    help="extra_info keys ending so are throughputs (higher is better); default _per_s")
    ap.add_argument("--markdown", help="also write the table as Markdown to this path")
    ap.add_argument("--append", action="store_true", help="append to --markdown instead of overwriting it")
    ap.add_argument("--allow-missing", action="store_true",
                    help="a benchmark in the baseline but not in the current run is a warning, not a failure")
    ap.add_argument("--allow-different-machines", action="store_true",
                    help="compare runs of different machines (a warning instead of a refusal)")
    ap.add_argument("--allow-different-config", action="store_true",
                    help="compare benchmarks whose engine configuration (extra_info) differs")
    ap.add_argument("--fail-on-missing", action="store_true", help=argparse.SUPPRESS)   # the default now
    a = ap.parse_args(argv)
    try:
        base_p, cur_p = resolve(a)
        baseline, current = load(base_p), load(cur_p)
    except InputError as e:
        print(f"gates.alert: {e}", file=sys.stderr)
        return 2
    refusals, warnings = comparability(a, baseline, current)
    if refusals:
        print(f"gates.alert: refusing to compare {cur_p} against baseline {base_p}:\n  " + "\n  ".join(refusals),
              file=sys.stderr)
        return 2
    rows = compare(baseline, current, a.stat, a.latency_threshold, a.throughput_threshold, a.throughput_suffix)
    head, body = table(rows, a.stat)
    regressed = [r for r in rows if r.verdict == "REGRESSION"]
    present = set(by_name(current))
    missing = sorted({r.benchmark if r.benchmark not in present else f"{r.benchmark} [{r.metric}]"
                      for r in rows if r.verdict == "missing"})
    new = sorted({r.benchmark for r in rows if r.verdict == "new"})
    title = f"Benchmarks: {cur_p} against baseline {base_p}"
    rule = (f"regression: latency ({a.stat}) > {a.latency_threshold:g}x baseline, or throughput < "
            f"{a.throughput_threshold:g}x baseline")
    if regressed:
        verdict = f"{len(regressed)} regression(s): " + ", ".join(
            f"{r.benchmark} [{r.metric}] {r.change:.2f}x" for r in regressed)
    else:
        verdict = "no regression"
    notes = [f"warning: {w}" for w in warnings]
    if missing:
        gone = f"{len(missing)} benchmark(s) of the baseline missing from the current run: {named(missing)}"
        notes.append(f"warning: {gone} (--allow-missing)" if a.allow_missing else
                     f"FAIL: {gone} (unmeasured is not unchanged; --allow-missing to accept)")
    if new:
        notes.append(f"{len(new)} new benchmark(s), no baseline: {named(new)}")
    print(title)
    print(rule)
    print(text_table(head, body))
    print(verdict)
    for n in notes:
        print(n)
    if a.markdown:
        md = f"### {title}\n\n{rule}\n\n{markdown_table(head, body)}\n\n**{verdict}**\n"
        md += "".join(f"\n- {n}" for n in notes) + ("\n" if notes else "")
        with open(a.markdown, "a" if a.append else "w") as f:
            f.write(md)
    return 1 if regressed or (missing and not a.allow_missing) else 0


if __name__ == "__main__":
    sys.exit(main())
