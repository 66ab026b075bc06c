"""Tensor-parallel checks shared by the gates and the planted-bug tests: a run at tp N against the same run at
tp 1 (the one-GPU engine), step by step under the 0.02 rule, and every rank's KV pool after a run.

Rank agreement (every rank chose the same token for every row) is checked by the engine itself at every step (it
raises RankDisagreementError); these checks also make sure that it ran."""
from __future__ import annotations

from engine.workload import RequestSpec

from .compare import GateReport, compare
from .failure import GateFailure
from .reference import EngineReference


def rank_problems(engine) -> list[str]:
    """Every rank's pages against rank 0's free list, and proof that the agreement check ran on every row."""
    runner = engine.runner
    problems = list(runner.page_problems(list(engine.pool.free)))
    sampled = sum(len(r.tokens) for r in engine.results().values())
    want = sampled * (engine.config.tp - 1)
    if runner.agreed_rows != want:
        problems.append(f"the rank-agreement check covered {runner.agreed_rows} (row, rank) choices; the run "
                        f"sampled {sampled} rows on {engine.config.tp - 1} worker ranks ({want})")
    return problems


def finish(engine) -> None:
    """After a tp > 1 run: fail on any rank's problem, then stop the workers (the pool, results and trace stay)."""
    try:
        problems = rank_problems(engine)
        if problems:
            raise GateFailure(f"tp={engine.config.tp}: " + "\n  ".join(problems))
    finally:
        engine.close()


def tp_vs_tp1(specs: list[RequestSpec], tp: int, threshold: float, flip_cap: int, engine: str = "fused",
              loaded=None, **config) -> tuple[GateReport, list[str], object]:
    """Run `specs` at tp 1 and at `tp` with the same configuration. Returns the comparison (same scheduler, so the
    same tokens at the same steps, flips only at near ties), the tp run's rank problems, and its engine (closed)."""
    one = EngineReference(engine, loaded=loaded, poison=True, **config)
    many = EngineReference(engine, loaded=loaded, poison=True, tp=tp, **config)
    ref = one.generate(specs)
    cand = many.generate(specs)
    eng = many.last_engine
    try:
        ranks = rank_problems(eng)
    finally:
        eng.close()
    report = compare(f"{engine}[{one.config.backend}] tp={tp} vs tp=1", ref, cand, one.score, threshold, flip_cap,
                     check_steps=True)
    return report, ranks, eng
