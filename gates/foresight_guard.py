"""The engine's guard on a step launched ahead (EngineConfig.overlap): a launch is used only when the real schedule is
exactly the step it computed (engine/foresight.py: matches), else dropped and the step run as scheduled. With a right
foresight the guard never says no, so no ordinary run shows whether it would: gates/test_smoke.py runs the engine
with a scheduler that foresees wrongly on purpose, in the ways a real schedule can differ from a launch (a row gone,
as after a cancel; the rows in another order; a prompt chunk a position shorter), each writing only its own rows'
next slots, as a real launch does, and checks that what is served is the right foresight's run, token by token and
step by step. (A mutation campaign found the guard's checks weakened without any gate noticing: its `and` made `or`.)
"""
from __future__ import annotations

from dataclasses import replace

from engine.scheduler import Foresight, Scheduler
from engine.workload import RequestSpec

from .schedule_check import check_engine

WRONG = ("a row gone", "the rows reversed", "a prompt chunk one position shorter")


class MisForeseeing(Scheduler):
    """Every other foresight made wrong, in turn each way of WRONG that applies to it; `wrong` counts them by way."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.foreseen = 0
        self.wrong = {w: 0 for w in WRONG}

    def next_step(self, plan) -> Foresight | None:
        step = super().next_step(plan)
        if step is None:
            return None
        self.foreseen += 1
        if self.foreseen % 2:
            return step                 # right: launches are still used
        for k in range(len(WRONG)):
            way = WRONG[(self.foreseen // 2 + k) % len(WRONG)]
            changed = self.mis(step, way)
            if changed is not None:
                self.wrong[way] += 1
                return changed
        return step

    @staticmethod
    def mis(step: Foresight, way: str) -> Foresight | None:
        if way == "a row gone" and step.rows:
            return Foresight(list(step.chunks), step.rows[:-1])
        if way == "the rows reversed" and len(step.rows) > 1:
            return Foresight(list(step.chunks), step.rows[::-1])
        if way == "a prompt chunk one position shorter" and step.chunks and step.chunks[0].length > 1:
            c = step.chunks[0]
            return Foresight([replace(c, length=c.length - 1)] + step.chunks[1:], list(step.rows))
        return None


def twins(n: int, length: int, budget: int, vocab: int) -> list[RequestSpec]:
    """n requests of one prompt length and budget, different tokens: admitted together they decode at the same
    positions, so rows in another order still sit at the positions the real rows are at."""
    return [RequestSpec(f"twin-{i}", [(7 + 31 * i + 13 * j) % vocab for j in range(length)], budget)
            for i in range(n)]


def guard_problems(ref, right, specs: list[RequestSpec], label: str) -> tuple[list[str], dict[str, int]]:
    """`ref` (an EngineReference with steps launched ahead) serves `specs` with MisForeseeing, against `right`, an
    engine of it that served them with the real scheduler; then three twins, with and without. Returns what differs
    (problems) and how many foresights were made wrong each way."""
    pairs = []
    for batch in (specs, twins(3, 40, 12, right.shape.vocab_size)):
        engines = ([] if not pairs else [ref.engine()]) + [ref.engine(scheduler_cls=MisForeseeing)]
        for e in engines:
            e.run(batch)
            check_engine(e, f"{label}, steps launched ahead, {type(e.scheduler).__name__}")
        pairs.append((right if not pairs else engines[0], engines[-1]))
    ways, problems = {w: 0 for w in WRONG}, []
    for right, wrong in pairs:
        for w, n in wrong.scheduler.wrong.items():
            ways[w] += n
        if not wrong.ahead_discarded or not wrong.steps_ahead:
            problems.append(f"{wrong.steps_ahead} steps ran launched ahead and {wrong.ahead_discarded} launches were "
                            f"dropped: want both above 0 ({wrong.scheduler.wrong})")
        got = wrong.results()
        for rid, r in right.results().items():
            w = got[rid]
            if (w.tokens, w.token_steps) != (r.tokens, r.token_steps):
                i = next((i for i, (a, b) in enumerate(zip(w.tokens, r.tokens)) if a != b),
                         min(len(w.tokens), len(r.tokens)))
                problems.append(f"{rid}: with wrong foresights served {w.tokens[i:i + 4]} at emitted position {i} "
                                f"(steps {w.token_steps[i:i + 4]}), the right foresight's run {r.tokens[i:i + 4]} "
                                f"(steps {r.token_steps[i:i + 4]}): a launch of a wrong foresight was used")
    problems += [f"no foresight was made wrong as {w!r}: this run proves nothing of it" for w, n in ways.items() if not n]
    return problems, ways
