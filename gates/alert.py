"""What regressed, by how much: compare two pytest-benchmark JSON files (a baseline and the current run).

    python -m gates.alert                                   # the newest two runs under golden/benchmarks/
    python -m gates.alert --storage golden/benchmarks/h200  # the newest two runs of one machine's folder
    python -m gates.alert --baseline OLD.json --current NEW.json --markdown summary.md

Rules as vLLM's performance alerting: a latency (a benchmark's median time) over `--latency-threshold` (1.2) times
its baseline, or a throughput (an `extra_info` entry whose key ends in `_per_s`) under `--throughput-threshold`
(0.8) times its baseline, is a regression. Prints a table (benchmark, baseline, now, change, verdict); `--markdown`
writes the same table as Markdown (for a CI summary; `--append` to add to an existing file such as
$GITHUB_STEP_SUMMARY). Exit status: 0 when nothing regressed, 1 on a regression, 2 when the inputs are missing.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STORAGE = Path(__file__).resolve().parent.parent / "golden" / "benchmarks"
STATS = ("median", "mean", "min", "max")


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
    """(baseline, current): the newest saved run under `storage` and the run saved before it in the same folder
    (pytest-benchmark keeps one folder per machine and numbers the runs it saves)."""
    root = _storage_dir(storage)
    files = [p for p in root.rglob("*.json") if p.is_file()] if root.is_dir() else []
    if not files:
        raise InputError(f"no pytest-benchmark JSON under {root}")
    current = max(files, key=lambda p: (p.stat().st_mtime, p.name))
    older = sorted(p for p in current.parent.glob("*.json") if p.name < current.name)
    if not older:
        raise InputError(f"{current.parent} holds one saved run ({current.name}); a baseline needs two")
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


def metrics(data: dict, stat: str, throughput_suffix: str) -> dict[tuple[str, str], tuple[float, bool]]:
    """(benchmark, metric) -> (value, higher_is_better)."""
    out = {}
    for b in data["benchmarks"]:
        name = b.get("fullname") or b.get("name")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gates.alert", description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--fail-on-missing", action="store_true",
                    help="a benchmark in the baseline but not in the current run is a failure too")
    a = ap.parse_args(argv)
    try:
        if a.current and a.baseline:
            base_p, cur_p = Path(a.baseline), Path(a.current)
        elif a.current:
            cur_p = Path(a.current)
            older = sorted(p for p in cur_p.parent.glob("*.json") if p.name < cur_p.name)
            if not older:
                raise InputError(f"no baseline given and no earlier run next to {cur_p}")
            base_p = older[-1]
        else:
            base_p, cur_p = newest_two(a.storage)
            if a.baseline:
                base_p = Path(a.baseline)
        baseline, current = load(base_p), load(cur_p)
    except InputError as e:
        print(f"gates.alert: {e}", file=sys.stderr)
        return 2
    rows = compare(baseline, current, a.stat, a.latency_threshold, a.throughput_threshold, a.throughput_suffix)
    head, body = table(rows, a.stat)
    regressed = [r for r in rows if r.verdict == "REGRESSION"]
    missing = [r for r in rows if r.verdict == "missing"]
    title = f"Benchmarks: {cur_p} against baseline {base_p}"
    rule = (f"regression: latency ({a.stat}) > {a.latency_threshold:g}x baseline, or throughput < "
            f"{a.throughput_threshold:g}x baseline")
    if regressed:
        verdict = f"{len(regressed)} regression(s): " + ", ".join(
            f"{r.benchmark} [{r.metric}] {r.change:.2f}x" for r in regressed)
    else:
        verdict = "no regression"
    if missing:
        verdict += f"; {len(missing)} benchmark(s) missing from the current run"
    print(title)
    print(rule)
    print(text_table(head, body))
    print(verdict)
    if a.markdown:
        md = f"### {title}\n\n{rule}\n\n{markdown_table(head, body)}\n\n**{verdict}**\n"
        with open(a.markdown, "a" if a.append else "w") as f:
            f.write(md)
    failed = bool(regressed) or (a.fail_on_missing and bool(missing))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
