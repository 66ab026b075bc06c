"""Which poisoned slot a row read (poison mode): after a step whose sampled row got non-finite logits, the search that
re-runs the step with groups of NaN slots made finite until the slot the row read is found. Apart from the runner
because it serves only the report of a poisoned read (engine/poison_report.py), never a step: it works on the
runner's KV cache through the runner's own packing and step (`build`, `run`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .runner import ModelRunner
    from .scheduler import StepPlan


@torch.inference_mode()
def poisoned_reads(runner: "ModelRunner", plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str,
                   row: int, max_reads: int = 1) -> tuple[list[int], bool] | None:
    """After a step whose sampled `row` got non-finite logits: (slots, more): flat cache slots (page * page_size
    + offset) that row's logits depend on, one per page, at most `max_reads`; `more`: it reads NaN in other
    pages too. Kernel-agnostic: every slot holding NaN (poisoned, or written NaN by an earlier forward) is made
    finite, then group by group put back while the same step is run again (idempotent: it rewrites the same
    slots); the row turns non-finite again only when a group it reads is NaN. Bisects pages, then slots in the
    page found: about log2(pages) + log2(page_size) forwards a slot. Leaves the cache as found, but for the
    step's own slots. None: the row stays non-finite with every such slot finite."""
    ps = runner.page_size
    flat = [t.view(t.shape[0] * ps, -1) for kv in runner.kv_caches for t in kv]
    poisoned = torch.isnan(flat[0]).all(-1)     # never written since poisoned: NaN in every layer
    tainted = torch.zeros_like(poisoned)
    for t in flat:
        tainted |= torch.isnan(t).any(-1)
    tainted &= ~poisoned
    written = runner.build(plan.chunks, plan.decodes, pages_of)[2].slot_mapping
    poisoned[written] = False                   # the step rewrites these before any read
    tainted[written] = False
    cand = (poisoned | tainted).nonzero().flatten()
    if cand.numel() == 0:
        return None
    cand_tainted = tainted[cand]
    saved = [t[cand[cand_tainted]].clone() for t in flat]

    def put(slots: torch.Tensor, nan: bool) -> None:
        """Put `slots` (a subset of cand) back as found (nan) or make them finite."""
        sel = torch.isin(cand, slots)
        p, tn = cand[sel & ~cand_tainted], sel[cand_tainted]
        q = cand[cand_tainted][tn]
        for t, keep in zip(flat, saved):
            t[p] = float("nan") if nan else 0.0
            t[q] = keep[tn] if nan else torch.nan_to_num(keep[tn], nan=0.0)

    def reads(slots: torch.Tensor) -> bool:
        """Non-finite with only `slots` NaN?"""
        put(slots, True)
        bad = runner.run(plan, pages_of, forward_mode).nonfinite[row]
        put(slots, False)
        return bad

    def bisect(slots: torch.Tensor, unit) -> torch.Tensor:
        """The group (slots with one `unit` value) that the row reads, among groups that hold one."""
        groups = torch.unique(unit(slots))
        while len(groups) > 1:
            half = groups[:len(groups) // 2]
            inside = slots[torch.isin(unit(slots), half)]
            groups = half if reads(inside) else groups[len(groups) // 2:]
        return slots[unit(slots) == groups[0]]

    put(cand, False)
    try:
        if reads(cand[:0]):
            return None
        found = []
        # slots read while poisoned first: a NaN written by an earlier forward is that forward's read's effect
        for left in (cand[~cand_tainted], cand[cand_tainted]):
            while len(found) < max_reads and left.numel() and reads(left):
                page = bisect(left, lambda s: s // ps)
                found.append(int(bisect(page, lambda s: s)[0]))
                left = left[left // ps != found[-1] // ps]
        rest = cand[~torch.isin(cand // ps, torch.tensor(found, device=cand.device) // ps)]
        return found, bool(rest.numel()) and reads(rest)
    finally:
        put(cand, True)
