"""The gate summary: every comparison gate adds its report here; at the end of the run conftest prints a table
(requests identical / with accepted flips / failed, flip sites with gaps) and writes it as JSON."""
from __future__ import annotations

import json
from pathlib import Path

from .compare import GateReport

REPORTS: list[GateReport] = []
PATH: Path | None = None     # set by conftest: the JSON is rewritten after every gate, so a run cut short (a CI
                             # timeout, a device call's deadline) still leaves the summary of what it gated


def record(report: GateReport) -> GateReport:
    REPORTS.append(report)
    if PATH is not None:
        write_json(PATH)
    return report


def lines() -> list[str]:
    if not REPORTS:
        return []
    w = max(len(r.gate) for r in REPORTS)
    out = [f"{'gate':<{w}}  identical  flipped  failed  sites  sched-diffs  verdict"]
    for r in REPORTS:
        c = r.counts()
        out.append(f"{r.gate:<{w}}  {c['identical']:>9}  {c['flipped']:>7}  {c['failed']:>6}  {len(r.sites):>5}  "
                   f"{len(r.schedule_diffs):>11}  {'ok' if r.ok else 'FAIL'}")
        for site in r.sites.values():
            f = site[0]
            out.append(f"{'':<{w}}    flip site {f.request_id}@{f.position}: {f.ref_token}->{f.cand_token} "
                       f"gaps ref {f.ref_gap:.4f} cand {f.cand_gap:.4f}"
                       + (f" (x{len(site)} requests)" if len(site) > 1 else "")
                       + (" [teacher-forced]" if f.teacher_forced else ""))
    return out


def write_json(path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([r.summary() for r in REPORTS], indent=2) + "\n")
    tmp.replace(path)      # atomic: a reader never sees half a file
