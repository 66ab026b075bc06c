"""The report of a poisoned read (poison mode): a step's logits came out non-finite, so a kernel read a freed or
never-written KV slot. It names the reader, the slot it read (found by re-running the step: engine/poisoned_reads.py),
that slot's page and whose it is or was, then every request in the step with its pages: the cause, not only the
victim. No tensors here beyond what the runner's search returns."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import errors

if TYPE_CHECKING:
    from .engine import Engine


def poison_error(engine: "Engine", plan, sampled, nonfinite) -> errors.PoisonedLogitsError:
    """Names the reader, the slot it read (found by re-running the step: engine/poisoned_reads.py), that
    slot's page and whose it is or was, then every request in the step with its pages."""
    bad = [r.request_id for r, nf in zip(sampled, nonfinite) if nf]
    row = list(nonfinite).index(True)
    reader = sampled[row].request_id
    found = engine.runner.poisoned_reads(plan, engine.pool.owned, engine.config.forward, row)
    lines = [f"step {plan.index} ({plan.kind}): non-finite logits for {bad}: a kernel read a freed or "
             f"never-written KV slot."]
    if found is None:
        lines.append(f"  {reader}: its logits stay non-finite with every NaN slot made finite: the NaN comes "
                     f"from the step's own computation, not from a slot it read")
    slots, more = found or ([], False)
    whose = []
    for slot in slots:
        page = slot // engine.pool.page_size
        whose.append(slot_holder(engine, plan, page, slot))
        lines.append(f"  {reader} read slot {slot} (page {page}): {whose[-1]}")
    if more:
        lines.append(f"  {reader} also read NaN in other pages (not searched: each costs about "
                     f"log2(pages) + log2(page_size) forwards)")
    lines.append("Requests in this step and the pages they own:")
    for c in plan.chunks:
        lines.append(f"  {c.request.request_id}: prompt chunk [{c.start}, {c.start + c.length}) of "
                     f"{c.request.prompt_len}, pages {engine.pool.owned.get(c.request.request_id)}")
    for r in plan.decodes:
        lines.append(f"  {r.request_id}: decode token at position {r.num_cached}, "
                     f"pages {engine.pool.owned.get(r.request_id)}")
    first = slots[0] if slots else None
    return errors.PoisonedLogitsError(
        plan.index, bad, "\n".join(lines), reader=reader, slot=first,
        page=None if first is None else first // engine.pool.page_size,
        owner=whose[0] if whose else None, reads=slots)

def slot_holder(engine: "Engine", plan, page: int, slot: int) -> str:
    """Whose `slot` is or was: owner and position, and whether it was written, freed or never handed out."""
    if page == engine.runner.pad_page:
        return "the pad page of the captured decode steps: no request owns it"
    owner, state = engine.pool.holder(page)
    if owner is None:
        return "a page never owned by any request: never written since the pool was made"
    r = engine.requests.get(owner)
    pages = r.pages if r is not None and page in r.pages else engine.pool.owned.get(owner, [])
    pos = pages.index(page) * engine.pool.page_size + slot % engine.pool.page_size if page in pages else None
    at = f"{owner} (position {pos})" if pos is not None else owner
    if state != "owned":
        step = engine.pool.last_owner[page][1]
        return f"last owned by {at}, " + ("released in this step" if state == "released" else
                                          f"freed at the end of step {step}")
    if r is None or pos is None:
        return f"owned by {at}"
    # what this step writes for the owner counts as written: the forward writes before it reads
    wrote = {c.request.request_id: c.start + c.length for c in plan.chunks}
    wrote.update({d.request_id: d.num_cached + 1 for d in plan.decodes})
    cached = wrote.get(owner, r.num_cached)
    if pos >= cached:
        return f"owned by {at}, never written ({owner} has cached {cached} positions, this step's included)"
    return (f"owned by {at}, written with NaN at step {r.step_of(pos)} (layers past the first): that step's "
            f"forward read a poisoned slot itself")


__all__ = ["poison_error", "slot_holder"]
