"""The teacher-forced check: Engine.score() over each golden request's prompt and emitted tokens must rank, at every
emitted position, the golden's token first, or flip it only within a near tie under the threshold on both sides (the
token gates' rule, gates/compare.py). score() is served (teacher forcing, perplexity) and the gates' own tie
decisions lean on it where the reference is an engine (gates/reference.py), so it is gated, not only unit-tested: its
forward asks for every position's logits, a packing path (engine/packing.py, all_logits) that no generated token
takes, and a mutation campaign found its row bookkeeping unchecked by any gate."""
from __future__ import annotations

from .compare import Failure, GateReport, RequestVerdict, accept, gap_in
from .records import GenRecord
from .reference import TOPK


def teacher_forced(gate: str, engine, golden: dict[str, GenRecord], threshold: float, flip_cap: int) -> GateReport:
    verdicts = []
    for rid, g in golden.items():
        v = RequestVerdict(rid, len(g.prompt))
        verdicts.append(v)
        if not g.tokens:
            continue
        # position len(prompt) - 1 + i predicts emitted token i
        logits = engine.score(list(g.prompt) + list(g.tokens[:-1]))[len(g.prompt) - 1:].float()
        left = pages_left(engine)
        if left:
            v.failure = Failure(rid, 0, left)
            continue
        if logits.shape[0] != len(g.tokens):
            v.failure = Failure(rid, 0, f"score() gave {logits.shape[0]} rows of logits for the {len(g.tokens)} "
                                        f"emitted positions")
            continue
        vals, ids = logits.topk(TOPK, dim=-1)
        cand = GenRecord(rid, list(g.prompt), ids[:, 0].tolist(), ids.tolist(), vals.tolist())
        for i, (a, b) in enumerate(zip(g.tokens, cand.tokens)):
            if a != b and not accept(v, g, cand, i, a, b, gap_in(g, i, a, b), threshold, teacher_forced=False):
                break
    return GateReport(gate, verdicts, threshold, flip_cap)


def pages_left(engine) -> str | None:
    """Between steps, score() returns its pages at once: none wait for a step's end, the pool is whole again (every
    request of the gate's run is done). What is wrong, or None."""
    pool = engine.pool
    if pool.pending or pool.num_free != pool.capacity:
        return (f"after score() between steps {sum(len(p) for _, p in pool.pending)} page(s) wait for a step's end and "
                f"{pool.num_free} of {pool.capacity} are free: score() must hand its pages back at once")
    return None
