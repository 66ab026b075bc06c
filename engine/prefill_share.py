"""The prefill-share debt ledger, mixed into the Scheduler. No tensors.

Prefill share p (0 < p <= 1; p below 0.01, above 1 or not finite falls back to 1): while runnable requests decode, a
step that carried long-prompt work and took t seconds owes the decoders (t - t_d) (1 - p) / p seconds of pure decode
steps (`debt`) before the next long-prompt chunk, where t_d is a running estimate (EWMA) of a pure decode step's
duration. So pure decode time : prompt work's extra time = (1 - p) : p, and decoders keep about (1 - p) of their
token rate while a long prompt fills.
- The debt saturates at max(DEBT_CAP_SECONDS, DEBT_CAP_STEPS * t) (t: the loaded step that just ran), so that even a
  tiny p never starves a long prompt for long: a loaded step of t owes at most 8 t (or 1 s) of decoding, which is
  exact for every p >= 1/9 and, for fast steps, down to p = 0.01.
- While debt > 0 and runnable decoders exist, long-prompt chunks are withheld; short prompts' chunks never wait.
- A prompt's LAST long chunk (the one after which at most short_prompt_positions are left) also pays its own debt
  ahead, estimated from the extra time of that prompt's previous long chunk, and settles the difference after it
  runs. Why: paid after it, that chunk's debt would fall due once the prompt already emits its first token, so
  while a prompt of n long chunks fills the decoders would get only n - 1 of its n debts (docs/prefill-share.md).
  A prompt's first long chunk has no estimate: nothing is paid ahead for it. A prompt cancelled before its last long
  chunk ran gives back what was charged ahead for it.
- A pure decode step pays off its duration; a step with decode tokens and short-prompt chunks (no long work) pays
  off the decode part of it (min(t, t_d)). No credit: the debt never goes below 0.
- Debt counts only runnable decoders: a step with no decode tokens (nobody decoding, or every decoder finished or
  cancelled) clears it; a step that carried long work but no decode tokens owes nothing.
- p = 1 owes nothing, ever: the steps are exactly those of the scheduler's chunk picking, without the feature.
Time is injected: Engine.step passes each step's measured duration to finish_step(duration=...); tests pass
synthetic durations. finish_step() without a duration adds and pays off no debt.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .copying import copy_fields

if TYPE_CHECKING:       # the ledger reads a step's plan and chunks; it is below the scheduler, which holds it
    from .scheduler import Chunk, StepPlan

DEBT_CAP_SECONDS = 1.0      # the debt saturates at max(DEBT_CAP_SECONDS, DEBT_CAP_STEPS * the loaded step's time)
DEBT_CAP_STEPS = 8
DEBT_EPS = 1e-9             # seconds: a debt at or under this is paid (float dust)
DECODE_EWMA = 0.25          # weight of the newest pure decode step in the running estimate of its duration
MIN_SHARE = 0.01


def normalise_share(p) -> float:
    """prefill_share as used: p in [0.01, 1]; below 0.01, above 1, not finite or not a number: 1 (no debt)."""
    try:
        p = float(p)
    except (TypeError, ValueError):
        p = math.nan                    # (EngineConfig refuses a non-number first: a direct caller's mistake)
    return p if math.isfinite(p) and MIN_SHARE <= p <= 1.0 else 1.0


class DebtLedger:
    """The decoders' debt and what it is computed from: an object the Scheduler holds (Scheduler.ledger; a planted
    ledger comes in as the scheduler's ledger_cls), which it asks prepay, owes, settle and forget."""
    __deepcopy__ = copy_fields      # engine/copying.py

    def __init__(self, prefill_share=1.0, short_prompt_positions: int = 512):
        self.short_prompt_positions = short_prompt_positions
        self.prefill_share = normalise_share(prefill_share)
        self.debt = 0.0                      # seconds of pure decode steps owed to the decoders
        self.decode_estimate: float | None = None   # running estimate of a pure decode step's duration (s)
        self.chunk_extra: dict[str, float] = {}   # request id -> extra seconds of its latest long chunk
        self.prepaid: dict[str, float] = {}       # request id -> debt charged ahead for its last long chunk

    @property
    def owes(self) -> bool:
        return self.debt > DEBT_EPS

    def account(self, plan: StepPlan, duration: float, ahead: float = 0.0) -> None:
        """The debt rule, after a step of `duration` seconds (see the module docstring). `ahead`: debt already
        charged for the step's last long chunks before they ran."""
        p = self.prefill_share
        t = max(0.0, float(duration))
        if not plan.decodes:
            self.debt = 0.0
            return
        if not plan.chunks:                  # a pure decode step: it pays, and teaches the estimate
            self.decode_estimate = t if self.decode_estimate is None else \
                (1 - DECODE_EWMA) * self.decode_estimate + DECODE_EWMA * t
            self.debt = max(0.0, self.debt - t)
            return
        t_d = self.decode_estimate or 0.0
        if plan.long_chunks:                 # (p < 1 here: settle() does not account at p = 1)
            extra = max(0.0, t - t_d)
            longs = [c.request.request_id for c in plan.chunks if c.long]
            for rid in longs:
                self.chunk_extra[rid] = extra / len(longs)
            owed = max(0.0, extra * (1.0 - p) / p - ahead)
            self.debt = min(self.debt + owed, self.debt_cap(t))
        else:                                # decode tokens and short chunks only
            self.debt = max(0.0, self.debt - min(t, t_d))

    @staticmethod
    def debt_cap(t: float) -> float:
        return max(DEBT_CAP_SECONDS, DEBT_CAP_STEPS * t)

    def is_last_long(self, c: Chunk) -> bool:
        """A long chunk after which the prompt is short (or read): its request's last long chunk."""
        return c.long and c.request.prompt_left - c.length <= self.short_prompt_positions

    def prepay(self, chunks: list[Chunk]) -> None:
        """Charge the debt of a last long chunk that would run now, once, before it runs (module docstring).
        `prepaid` holds the charge (0 without an estimate) until the chunk runs or its request retires."""
        p, t_d = self.prefill_share, self.decode_estimate or 0.0
        for c in chunks:
            rid = c.request.request_id
            if self.is_last_long(c) and rid not in self.prepaid:
                est = self.chunk_extra.get(rid)
                before = self.debt
                if est is not None:
                    self.debt = max(before, min(before + est * (1.0 - p) / p, self.debt_cap(est + t_d)))
                self.prepaid[rid] = self.debt - before

    def settle(self, plan, duration: float | None) -> None:
        """At the end of a step: the last long chunks that ran settle what they paid ahead, and the step's
        `duration` (None: the debt is left as it is) goes through the debt rule."""
        ahead = sum(self.prepaid.pop(c.request.request_id, 0.0) for c in plan.chunks if c.long) if plan else 0.0
        if duration is not None and plan is not None and self.prefill_share < 1.0:
            self.account(plan, duration, ahead)

    def forget(self, request_id: str) -> None:
        """A retiring request: cancelled before its last long chunk ran, what was charged ahead for it is owed to
        nobody."""
        self.chunk_extra.pop(request_id, None)
        self.debt = max(0.0, self.debt - self.prepaid.pop(request_id, 0.0))
