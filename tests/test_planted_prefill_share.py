"""Planted bugs that the prefill-share gates (gates/test_prefill_share.py) must catch, each with a clear message.

- a scheduler that, when debt is owed, cuts a long prompt's piece short instead of withholding it: the decoders
  still get most of the step, but a chunk boundary now depends on p. The chunk-boundary gate must catch it (the
  tokens may well stay identical: that is why the gate compares the boundaries too);
- a debt that never saturates: a tiny p starves the long prompt; the debt property must catch it;
- a debt that counts no decoders (owes and withholds whether or not anyone is decoding): the long prompt waits
  for nobody; the debt property must catch it;
- a last long piece paid for only after it runs (no prepay): the decoders get n - 1 of a prompt's n debts while it
  fills; the debt property must catch it.
Each bug is planted by subclassing Scheduler (engine files stay untouched).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from engine.loader import load_model
from engine.request import State
from engine.prefill_share import DEBT_CAP_SECONDS, DEBT_CAP_STEPS, DebtLedger
from engine.scheduler import Chunk, StepPlan, Scheduler
from engine.workload import MIXED_CPU
from gates.prefill_share_check import (CAP_EXAMPLES, DEBT_CASE, check_debt_rule, check_decode_estimate,
                                     check_identical, chunk_problems, serve)

SUBSET = MIXED_CPU.scaled(16)      # shorts that decode while 1024-position prompts fill
FIND = settings(max_examples=300, derandomize=True, database=None, deadline=None, report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck), phases=[Phase.generate])


# -- the planted bugs ----------------------------------------------------------------------------------------------
class CutsShortWhenOwed(Scheduler):
    """Instead of withholding a long prompt's piece while debt is owed, runs half of it (a chunk boundary that
    depends on p)."""

    def pick_chunks(self, withhold_long=False):
        chunks, withheld = super().pick_chunks(withhold_long)
        if withheld:
            piece = self.next_chunk(withheld[0], withheld[0].num_cached)
            chunks.append(Chunk(piece.request, piece.start, max(1, piece.length // 2), long=piece.long))
        return chunks, []


class UncappedLedger(DebtLedger):
    """The debt grows without a cap."""

    def account(self, plan, duration, ahead=0.0):
        if plan.long_chunks and plan.decodes and self.prefill_share < 1.0:
            p, t_d = self.prefill_share, self.decode_estimate or 0.0
            self.debt += max(0.0, max(0.0, duration - t_d) * (1 - p) / p - ahead)
            longs = [c.request.request_id for c in plan.chunks if c.long]
            for rid in longs:       # the estimate a last long chunk's charge ahead is made from, as the ledger keeps it
                self.chunk_extra[rid] = max(0.0, duration - t_d) / len(longs)
        else:
            super().account(plan, duration, ahead)


class NeverSaturates(Scheduler):
    ledger_cls = UncappedLedger


class DecoderBlindLedger(DebtLedger):
    def account(self, plan, duration, ahead=0.0):   # (its scheduler pays nothing ahead)
        p, t = self.prefill_share, duration
        if plan.long_chunks:
            cap = max(DEBT_CAP_SECONDS, DEBT_CAP_STEPS * t)
            self.debt = min(self.debt + max(0.0, t - (self.decode_estimate or 0.0)) * (1 - p) / p, cap)
        elif not plan.chunks:
            if plan.decodes:
                self.decode_estimate = t
            self.debt = max(0.0, self.debt - t)


class CountsNoDecoders(Scheduler):
    """The debt ignores whether anyone decodes: owed after any long work, withheld from a prompt filling alone."""
    ledger_cls = DecoderBlindLedger

    def schedule(self):
        self.kv.begin_step()
        plan = StepPlan(self.step_index, admitted=self.admit())
        plan.decodes = [r for r in self.running if r.state is State.DECODE]
        plan.chunks, withheld = self.pick_chunks(withhold_long=self.ledger.owes)
        plan.long_chunks = sum(not self.is_short(c.request, c.start) for c in plan.chunks)
        plan.withheld = len(withheld)
        self.withheld_steps += bool(withheld)
        for c in plan.chunks:
            c.request.chunks.append((c.start, c.length))
        self.plan = plan
        return plan


# -- the chunk-boundary gate ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_model(None, torch.float32, "cpu")


def boundary_gate(loaded, scheduler_cls) -> list[str]:
    specs = SUBSET.requests()
    base, _ = serve(loaded, specs, 1.0, scheduler_cls=scheduler_cls)
    other, e = serve(loaded, specs, 0.5, scheduler_cls=scheduler_cls)
    assert e.scheduler.withheld_steps > 0 or scheduler_cls is CutsShortWhenOwed, "no debt was ever owed"
    return chunk_problems(other, SUBSET.chunk_tokens, "p=0.5") + check_identical(base, other, "p=1", "p=0.5")


def test_unplanted_scheduler_passes_the_boundary_gate(loaded):
    assert boundary_gate(loaded, Scheduler) == []


def test_chunk_cut_short_when_debt_is_owed_is_caught(loaded):
    problems = boundary_gate(loaded, CutsShortWhenOwed)
    assert problems, "the chunk-boundary gate passed on a scheduler whose chunk boundaries depend on p"
    msg = "\n".join(problems)
    assert "chunk boundaries differ between p=1 and p=0.5: chunk " in msg, msg
    assert "only the order of whole steps may change" in msg, msg
    assert "expected the whole chunk" in msg, msg



class PayAfterLedger(DebtLedger):
    def prepay(self, chunks):
        pass


class PaysLastPieceAfter(Scheduler):
    """The rule before the prepay: a prompt's last long piece is paid for only after it runs, so its debt falls due
    once the prompt already emits its first token, and the decoders get n - 1 of n debts while it fills."""
    ledger_cls = PayAfterLedger


# -- the debt property ---------------------------------------------------------------------------------------------
def run_property(scheduler_cls):
    @FIND
    @given(**DEBT_CASE)
    def prop(p, t_decode, extra_ratio, budgets, long_pieces, chunk_tokens, warmup, last_ratio, tail):
        check_debt_rule(scheduler_cls, p, t_decode, extra_ratio, budgets, long_pieces, chunk_tokens, warmup, last_ratio,
                        tail)

    prop()


def test_unplanted_scheduler_passes_the_debt_property():
    run_property(Scheduler)


def test_debt_that_never_saturates_is_caught():
    # the cycle check or the last long chunk's, whichever meets it first
    with pytest.raises(AssertionError, match=r"rule gives .* saturated at max\(.*\(the debt did not saturate\)"):
        run_property(NeverSaturates)


def test_debt_that_counts_no_decoders_is_caught():
    # caught by whichever check meets it first: a withheld chunk, or the debt left after a step without decoders
    with pytest.raises(AssertionError, match=r"(withheld while nobody decodes .* debt must count only runnable "
                                             r"decoders|carried no decode tokens, yet the decoders are owed .* debt "
                                             r"counts only runnable decoders)"):
        run_property(CountsNoDecoders)


def test_last_long_piece_paid_after_is_caught():
    with pytest.raises(AssertionError, match=r"plus the last long chunk's own debt ahead"):
        run_property(PaysLastPieceAfter)


class LateFloorLedger(DebtLedger):
    @staticmethod
    def debt_cap(t):
        return max(2.0, 8 * t)


class LateStepsLedger(DebtLedger):
    @staticmethod
    def debt_cap(t):
        return max(1.0, 9 * t)


@pytest.mark.parametrize("ledger", [LateFloorLedger, LateStepsLedger], ids=["floor-2s", "9-steps"])
def test_a_cap_that_saturates_late_is_caught_by_the_gates_cap_examples(ledger):
    """The debt gate's explicit examples (CAP_EXAMPLES) catch a cap that saturates later than max(1 s, 8 t), which
    the random draws let through (a mutation campaign's survivor): one of the two examples fails, naming the cap."""
    planted = type("SaturatesLate", (Scheduler,), {"ledger_cls": ledger})
    caught = []
    for case in CAP_EXAMPLES:
        try:
            check_debt_rule(planted, **case)
        except AssertionError as e:
            caught.append(str(e))
    assert caught, "neither cap example caught a cap that saturates late"
    assert all("saturated at max(1.0, 8 t)" in msg for msg in caught), caught
    for case in CAP_EXAMPLES:
        check_debt_rule(Scheduler, **case)      # the engine's own ledger passes both


class LastStepLedger(DebtLedger):
    """t_d is the last pure decode step alone (no running estimate): one slow step swings the debt's payoff."""
    def account(self, plan, duration, ahead=0.0):
        before = self.decode_estimate
        super().account(plan, duration, ahead)
        if plan.decodes and not plan.chunks:
            self.decode_estimate = duration if before is not None else self.decode_estimate


def test_an_estimate_that_is_not_the_documented_ewma_is_caught():
    planted = type("LastStep", (Scheduler,), {"ledger_cls": LastStepLedger})
    durations = [0.05, 0.01, 0.2, 0.03, 0.03, 0.1]
    check_decode_estimate(Scheduler, durations)
    with pytest.raises(AssertionError, match=r"the pure decode estimate t_d is .*; the documented EWMA \(weight "
                                             r"0.25 on the newest pure decode step\) gives"):
        check_decode_estimate(planted, durations)


# -- the ledger's own lines, mutated (session 17-18's campaign survivors, planted as the campaign made them) ---------
def mutated_scheduler(old: str, new: str) -> type:
    """A Scheduler whose ledger is engine/prefill_share.py with one line changed (`old` must occur once)."""
    import inspect
    import engine.prefill_share as module
    source = inspect.getsource(module)
    assert source.count(old) == 1, old
    ns = {"__name__": "engine.planted_prefill_share", "__package__": "engine"}    # its relative imports resolve
    exec(compile(source.replace(old, new), "planted_prefill_share.py", "exec"), ns)
    return type("Planted", (Scheduler,), {"ledger_cls": ns["DebtLedger"]})


@pytest.mark.parametrize("old,new,message", [
    ("owed = max(0.0, extra * (1.0 - p) / p - ahead)", "owed = max(-1.0, extra * (1.0 - p) / p - ahead)",
     r"(after the prompt's last long chunk .* the rule gives min\(|went below 0 .* no credit)"),
    ("owed = max(0.0, extra * (1.0 - p) / p - ahead)", "owed = max(0.0, extra * (1.0 - p) / p + ahead)",
     r"after the prompt's last long chunk .* charged ahead"),
    ("self.debt = max(0.0, self.debt - min(t, t_d))", "self.debt = max(0.0, self.debt + min(t, t_d))",
     r"decode tokens and short chunks only.* raised the debt"),
    ("t_d = self.decode_estimate or 0.0", "t_d = self.decode_estimate or -1.0",
     r"(raised the debt|the rule gives|the debt rule gives)"),
    ("if plan else 0.0", "if not plan else 0.0", r"after the prompt's last long chunk"),
    ("self.prepaid[rid] = self.debt - before", "self.prepaid[rid] = self.debt + before",
     r"after the prompt's last long chunk"),
], ids=["credit", "charged-twice", "short-step-raises", "no-estimate-below-0", "ahead-forgotten", "prepaid-plus"])
def test_the_ledgers_survivors_are_caught_by_the_debt_property(old, new, message):
    """Each mutant of the ledger that passed the debt gate before its step-by-step checks (the debt after the last
    long chunk, a short step never raising the debt, t_d before any pure decode step) fails it now, naming the rule."""
    with pytest.raises(AssertionError, match=message):
        run_property(mutated_scheduler(old, new))
