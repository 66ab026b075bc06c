"""What an A/B run (gates/ab.py) leaves behind: the Markdown table (the gate summary's style, for
$GITHUB_STEP_SUMMARY), the JSON record with every round's timings, and a plot of the rounds (base against head, round
by round), drawn only where matplotlib is installed (the `plots` extra)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .ab_stats import REGRESSION
from .alert import markdown_table, text_table


def fmt_s(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f} ms" if ms < 100 else f"{ms:.1f} ms"


def side_label(side: dict) -> str:
    rev = side.get("rev") or ""
    commit = (side.get("commit") or "")[:10]
    dirty = " +uncommitted" if side.get("dirty") else ""
    plant = f" (planted {side['plant']})" if side.get("plant") else ""
    return (f"{rev} @ {commit}" if rev and commit and rev != commit else commit or rev or side["tree"]) + dirty + plant


def rows(record: dict) -> tuple[list[str], list[list[str]]]:
    conf = int(round(record["confidence"] * 100))
    other = record["benchmarks"][0]["other_clock"]["clock"] if record["benchmarks"] else "other"
    head = ["benchmark", "base (median)", "head (median)", f"ratio head/base [{conf}% CI]", "each process pair",
            f"{other} time ratio", "verdict"]
    body = [[b["name"], fmt_s(b["base_median"]), fmt_s(b["head_median"]),
             f"{b['ratio']:.3f}x [{b['low']:.3f}, {b['high']:.3f}]",
             " ".join(f"{r:.3f}" for r in b.get("pair_ratios", [])) or "-", f"{b['other_clock']['ratio']:.3f}x",
             b["verdict"]] for b in record["benchmarks"]]
    return head, body


def rule(record: dict) -> str:
    t = record["threshold"]
    pairs = record.get("pairs", 1)
    return (f"regression: the interval above 1 and the ratio above {1 + t:.3f} (A/A noise threshold "
            f"{t * 100:g}% on {record['device_kind']}); {record['clock']} time of each step; {record['rounds']} "
            f"interleaved rounds x {record['reps']} steps a side over {pairs} process pair(s), bootstrap over "
            + ("pairs, then rounds within them" if pairs > 1 else "rounds (one pair: a process's own speed not "
               "sampled)"))


def summary_line(record: dict) -> str:
    bad = [b for b in record["benchmarks"] if b["verdict"] == REGRESSION]
    if not bad:
        return "no regression"
    return f"{len(bad)} regression(s): " + ", ".join(f"{b['name']} {b['ratio']:.3f}x" for b in bad)


def title(record: dict) -> str:
    return (f"A/B: head {side_label(record['head'])} against base {side_label(record['base'])} on "
            f"{record['device_name']}")


def markdown(record: dict) -> str:
    head, body = rows(record)
    notes = "".join(f"\n- {n}" for n in record.get("notes", []))
    return (f"### {title(record)}\n\n{rule(record)}\n\n{markdown_table(head, body)}\n\n**{summary_line(record)}**"
            f" ({record['seconds']:.0f} s)\n{notes}\n")


def text(record: dict) -> str:
    head, body = rows(record)
    lines = [title(record), rule(record), text_table(head, body), f"{summary_line(record)} ({record['seconds']:.0f} s)"]
    return "\n".join(lines + [f"note: {n}" for n in record.get("notes", [])])


def write_json(record: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def plot(record: dict, path: Path) -> str | None:
    """Each benchmark's rounds: every step (dots) and each round's median (lines), base against head. Returns why
    nothing was drawn, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[plots]')"
    benches = record["benchmarks"]
    fig, axes = plt.subplots(len(benches), 1, figsize=(8, 3 * len(benches)), squeeze=False)
    for ax, b in zip(axes[:, 0], benches):
        for side, color in (("base", "tab:blue"), ("head", "tab:red")):
            rounds = b[f"{side}_rounds"]
            for i, r in enumerate(rounds):
                ax.scatter([i + 1] * len(r), [t * 1e3 for t in r], s=4, color=color, alpha=0.25)
            ax.plot(range(1, len(rounds) + 1), [statistics.median(r) * 1e3 for r in rounds], "o-", color=color,
                    label=f"{side} {side_label(record[side])}")
        pairs = record.get("pair_of_round", [])
        for i in range(1, len(pairs)):        # where the next process pair's rounds begin
            if pairs[i] != pairs[i - 1]:
                ax.axvline(i + 0.5, color="grey", linestyle=":")
        ax.set_title(f"{b['name']}: {b['ratio']:.3f}x [{b['low']:.3f}, {b['high']:.3f}] {b['verdict']}", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel(f"step, {record['clock']} time (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
