"""The benchmarks' plots, drawn from their rows (matplotlib optional: without it nothing is drawn)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from engine.scheduler import WORK_KINDS

from .stats import median


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def draw_serving(out: Path) -> list[str]:
    """The serving benchmark's plots, drawn from runs.jsonl and steps.csv in `out`; the file names drawn."""
    plt = pyplot()
    if plt is None:
        return []
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines() if x.strip()]
    drawn = []
    opened = [r for r in runs if r["part"] in ("open", "capped")]
    if opened:
        fig, ax = plt.subplots(figsize=(6, 4))
        top = 0
        for part, style in (("open", "o-"), ("capped", "s--")):
            rows = sorted((r for r in opened if r["part"] == part), key=lambda r: r["rate"])
            if rows:
                ax.plot([r["offered_rate"] for r in rows], [r["served_rate"] for r in rows], style,
                        label="default pool" if part == "open" else "capped pool")
                top = max(top, max(r["offered_rate"] for r in rows))
        ax.plot([0, top], [0, top], ":", color="grey", label="served = offered")
        ax.set(xlabel="offered rate (requests/s)", ylabel="served rate (requests/s)",
               title=f"{opened[0]['engine']} on {opened[0]['model']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "served_vs_offered.png", dpi=120)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        for part, style in (("open", "o-"), ("capped", "s--")):
            rows = sorted((r for r in opened if r["part"] == part), key=lambda r: r["rate"])
            if rows:
                ax.plot([r["offered_rate"] for r in rows], [r["queue_wait_median_s"] for r in rows], style,
                        label="default pool" if part == "open" else "capped pool")
        ax.set(xlabel="offered rate (requests/s)", ylabel="median queue wait (s)", yscale="symlog")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "queue_wait.png", dpi=120)
        plt.close(fig)
        drawn += ["served_vs_offered.png", "queue_wait.png"]
    steps_p = out / "steps.csv"
    if steps_p.exists():
        with open(steps_p) as f:
            steps = list(csv.DictReader(f))
        # only the kinds that ran: a run without (say) loaded steps has no box, and no label, for them
        present = [(k, d) for k in WORK_KINDS if (d := [float(s["duration_ms"]) for s in steps if s["kind"] == k])]
        if present:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.boxplot([d for _, d in present], showfliers=False)
            ax.set_xticks(range(1, len(present) + 1), [f"{k}\n(n={len(d)})" for k, d in present])
            ax.set(ylabel="step time (ms)", title="step time by kind (device synchronised)")
            fig.tight_layout()
            fig.savefig(out / "step_time_by_kind.png", dpi=120)
            plt.close(fig)
            drawn.append("step_time_by_kind.png")
    gapped = [r for r in runs if r.get("gap_median_ms") is not None and not r.get("warmup")]
    if gapped:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        closed = [r for r in gapped if r["part"] == "closed"]
        if closed:
            names = sorted({r["workload"] for r in closed}, key=lambda n: [r["workload"] for r in closed].index(n))
            med = [median([r["gap_median_ms"] for r in closed if r["workload"] == n]) for n in names]
            worst = [max(r["gap_worst_ms"] for r in closed if r["workload"] == n) for n in names]
            x = range(len(names))
            axes[0].bar([i - 0.2 for i in x], med, 0.4, label="median")
            axes[0].bar([i + 0.2 for i in x], worst, 0.4, label="worst")
            axes[0].set_xticks(list(x), names, rotation=20)
            axes[0].set(ylabel="token gap (ms)", yscale="log", title="closed runs")
            axes[0].legend()
        for part, style in (("open", "o-"), ("capped", "s--")):
            rows = sorted((r for r in gapped if r["part"] == part), key=lambda r: r["rate"])
            if rows:
                axes[1].plot([r["rate"] for r in rows], [r["gap_median_ms"] for r in rows], style,
                             label=f"{part} median")
                axes[1].plot([r["rate"] for r in rows], [r["gap_worst_ms"] for r in rows], style, alpha=0.5,
                             label=f"{part} worst")
        axes[1].set(xlabel="offered rate (requests/s)", ylabel="token gap (ms)", yscale="log",
                    title="open runs (requests already decoding)")
        if any(r["part"] != "closed" for r in gapped):
            axes[1].legend()
        fig.tight_layout()
        fig.savefig(out / "token_gaps.png", dpi=120)
        plt.close(fig)
        drawn.append("token_gaps.png")
    return drawn


def draw_disturbance(rows: list[dict], tokens: list[dict], sc_by_chunk: dict, path: Path) -> bool:
    """The disturbance benchmark's plot: per chunk budget, first tokens and A's pause by p; A's tokens over time."""
    plt = pyplot()
    if plt is None:
        return False
    chunks = sorted({r["chunk_tokens"] for r in rows})
    fig, axes = plt.subplots(len(chunks), 2, figsize=(13, 4.2 * len(chunks)), squeeze=False)
    for row_axes, ct in zip(axes, chunks):
        rs = sorted((r for r in rows if r["chunk_tokens"] == ct), key=lambda r: r["prefill_share"])
        ps = [r["prefill_share"] for r in rs]
        ax = row_axes[0]
        for key, label in [("b_ttft_s", "B first token (s)"), ("c_ttft_s", "C first token (s)"),
                           ("a_longest_pause_s", "A longest pause (s)")]:
            ax.plot(ps, [r[key] if r[key] is not None else float("nan") for r in rs], "o-", label=label)
        ax.set_yscale("log")
        ax.set_xlabel("prefill share p")
        ax.set_ylabel("seconds")
        ax.set_title(f"chunk budget {ct}: first tokens and A's longest pause")
        ax2 = ax.twinx()
        ax2.plot(ps, [r["a_rate_ratio"] if r["a_rate_ratio"] is not None else float("nan") for r in rs], "s--",
                 color="black", label="A rate while B fills / alone")
        ax2.plot(ps, [1 - p for p in ps], ":", color="gray", label="1 - p")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("A's token rate ratio")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="best")
        ax = row_axes[1]
        for p in ps:
            ts = [t["time_s"] for t in tokens if t["chunk_tokens"] == ct and t["prefill_share"] == p
                  and t["request"] == "A"]
            ax.plot(ts, range(1, len(ts) + 1), label=f"p = {p:g}")
        sc = sc_by_chunk[ct]
        ax.axvline(sc.b_at, color="red", ls=":", label="B arrives")
        ax.axvline(sc.c_at, color="orange", ls=":", label="C arrives")
        ax.set_xlabel("seconds")
        ax.set_ylabel("A's tokens")
        ax.set_title(f"chunk budget {ct}: A's tokens over time")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw_chunk_sweep(rows: list[dict], path: Path) -> bool:
    """The chunk sweep's plot: capacity and token gaps by chunk budget."""
    plt = pyplot()
    if plt is None:
        return False
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
