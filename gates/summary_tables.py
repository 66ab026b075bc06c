"""The gate summary's tables, as text: the terminal's table of comparison gates with their flip sites, and the
reviewer's Markdown page (the outcome, the comparison gates, the path census, failures with their triage verdict,
the workers, the slowest gates). Apart from the pytest plugin (gates/summary.py), which gathers the reports into a
Run and writes the files: what is shown reads a Run and nothing of pytest's, so it changes without touching how
records travel from xdist workers to their controller."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import coverage

if TYPE_CHECKING:           # a type only: gates/summary.py imports this module, so a runtime import would circle
    from .summary import Run


# -- the terminal's table ------------------------------------------------------------------------------------------
def flip_sites(gate: dict) -> dict[str, list[dict]]:
    sites: dict[str, list[dict]] = {}
    for f in gate["flips"]:
        sites.setdefault(f["site"], []).append(f)
    return sites


def flip_line(site: list[dict]) -> str:
    f = site[0]
    return (f"flip site {f['request_id']}@{f['position']}: {f['ref_token']}->{f['cand_token']} "
            f"gaps ref {f['ref_gap']:.4f} cand {f['cand_gap']:.4f}"
            + (f" (x{len(site)} requests)" if len(site) > 1 else "")
            + (" [teacher-forced]" if f["teacher_forced"] else ""))


def lines(gates: list[dict]) -> list[str]:
    if not gates:
        return []
    w = max(len(g["gate"]) for g in gates)
    out = [f"{'gate':<{w}}  identical  flipped  failed  sites  sched-diffs  verdict"]
    for g in gates:
        out.append(f"{g['gate']:<{w}}  {g['identical']:>9}  {g['flipped']:>7}  {g['failed']:>6}  "
                   f"{g['flip_sites']:>5}  {g['schedule_differences']:>11}  {'ok' if g['ok'] else 'FAIL'}")
        out += [f"{'':<{w}}    {flip_line(site)}" for site in flip_sites(g).values()]
    return out


# -- Markdown -------------------------------------------------------------------------------------------------------
def header(config) -> str:
    from .options import gate_options
    from .placement import serial_note, xdist_workers
    o, workers = gate_options(config), xdist_workers(config)
    note = serial_note(config)
    return (f"device {o.device}, dtype {o.dtype}, model {o.model}, engines {','.join(o.engines)}, "
            f"backends {','.join(o.backends)}" + (f"; {workers} xdist workers" if workers else "")
            + (f"\n\n{note}." if note else ""))


def cell(text) -> str:
    return str(text).replace("|", "\\|")


def markdown(run: Run, about: str, slowest: int = 10) -> str:
    """The reviewer's page: the outcome, each comparison gate's counts and flip sites, each failure's first lines
    and triage verdict, and the slowest gates."""
    bad = run.outcomes.get("failed", 0) + run.outcomes.get("error", 0) + sum(not g["ok"] for g in run.gates)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(run.outcomes.items())) or "no gate-file tests"
    out = [f"## stepgate gates: {'FAILED' if bad else 'passed'} ({counts})", "", about, ""]
    if run.gates:
        ok = sum(g["ok"] for g in run.gates)
        out += [f"### Comparison gates ({ok} of {len(run.gates)} ok)", "",
                "| gate | identical | flipped | failed | flip sites | schedule diffs | verdict |",
                "|---|---:|---:|---:|---:|---:|---|"]
        out += [f"| {cell(g['gate'])} | {g['identical']} | {g['flipped']} | {g['failed']} | {g['flip_sites']} | "
                f"{g['schedule_differences']} | {'ok' if g['ok'] else '**FAIL**'} |" for g in run.gates]
        sites = [(g["gate"], site) for g in run.gates for site in flip_sites(g).values()]
        if sites:
            out += ["", "Accepted flips (near ties under the 0.02 rule in both engines' raw logits):", ""]
            out += [f"- {cell(gate)}: {flip_line(site)}" for gate, site in sites]
        out.append("")
    if run.census:
        bad = run.coverage_problems()
        verdict = ("**FAILED**" if bad else "ok") if run.checked else "not judged: the kernel gate did not run"
        out += [f"### Path census (the coverage gate: {verdict})", "",
                "Steps the gates' engines ran, by path; the kernel paths each took were checked by the kernel gate "
                "against fp32 attention on a cache rebuilt from the pages (checks passed per path below).", "",
                "| step kind | kernel paths | mode | buckets (rows or tokens x width) | launched ahead | prefix hit | "
                "steps |", "|---|---|---|---|---|---|---:|"]
        out += [f"| {kind} | {cell(kp)} | {mode} | {cell(b)} | {'yes' if ahead else ''} | {'yes' if hit else ''} | "
                f"{n} |" for kind, kp, mode, b, ahead, hit, n in coverage.census_table(run.census)]
        if run.checked:
            out += ["", "Kernel paths checked: " + ", ".join(f"`{p}` ({n})" for p, n in sorted(run.checked.items()))]
        out += [f"- **{cell(line)}**" for line in bad] if run.checked else []
        if run.served:
            out += ["", "Served configurations (EngineConfig.resolved().key()):", ""]
            out += [f"- {cell(label)}: `{key}`" for label, key in sorted(run.served.items())]
        out.append("")
    if run.failures:
        out += [f"### Failures ({len(run.failures)})", ""]
        for f in run.failures:
            out += [f"#### `{f.nodeid}`" + (f" ({f.when})" if f.when != "call" else ""), "", "```text",
                    *f.lines, "```", ""]
            out += [f"**triage verdict:** {f.verdict}", ""] if f.verdict else []
    if run.workers:
        out += ["### Workers", "", "The first gate's start counts from the run's start (worker start-up, imports, "
                "collection); the idle time is the rest of the run's wall time after its start-up.", "",
                "| worker | gates | busy s | first gate began at s | last gate ended at s | idle s |",
                "|---|---:|---:|---:|---:|---:|"]
        out += [f"| {wid} | {gates} | {busy:.1f} | {first:.1f} | {last:.1f} | {idle:.1f} |"
                for wid, gates, busy, first, last, idle in run.worker_rows()]
        out += ["", "Each worker's work units (an engine configuration's gates, or a file's), busy seconds:", "",
                "| worker | work units |", "|---|---|"]
        out += [f"| {wid} | {cell(units)} |" for wid, units in run.unit_rows()]
        out.append("")
    if run.durations:
        out += [f"### Slowest gates ({min(slowest, len(run.durations))} of {len(run.durations)})", "", "| gate | seconds |", "|---|---:|"]
        out += [f"| `{cell(nodeid)}` | {seconds:.1f} |" for nodeid, seconds in run.slowest(slowest)]
        out += ["", "### Time by gate file", "", "| file | gates | seconds |", "|---|---:|---:|"]
        out += [f"| `{cell(name)}` | {n} | {secs:.1f} |" for name, n, secs in run.by_file()]
        out.append("")
    return "\n".join(out)
