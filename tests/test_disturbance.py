"""The disturbance benchmark's token check (bench/disturbance.py): identical runs pass, a difference at a near
tie is reported as a tie flip, and a planted difference that is not a near tie fails with where it is. Plus one
short end-to-end run of the CLI on the small model."""
from __future__ import annotations

import csv

import pytest
import torch

from bench import disturbance
from engine.config import lineage_config
from engine.engine import Engine
from engine.loader import load_model
from engine.scheduler import StepKind


@pytest.fixture(scope="module")
def served():
    loaded = load_model("small", torch.float32, "cpu")
    e = Engine(lineage_config("fused", device="cpu", dtype="float32", chunk_tokens=64), loaded=loaded)
    prompt = list(range(5, 45))
    rid = e.submit(prompt, 12, "A")
    e.run()
    return e, {"A": prompt}, {"A": list(e.requests[rid].output)}


def test_identical(served):
    e, prompts, ref = served
    assert disturbance.check_tokens(e, prompts, ref, {"A": list(ref["A"])}) == (True, "identical")
    # a shorter run (A cancelled earlier) is compared over the common length
    assert disturbance.check_tokens(e, prompts, ref, {"A": ref["A"][:5]}) == (True, "identical")


def test_planted_difference_that_is_no_tie_fails(served):
    e, prompts, ref = served
    logits = e.score(prompts["A"] + ref["A"][:6], last_only=True)[-1]
    assert int(logits.argmax()) == ref["A"][6]          # the scoring agrees with what was served
    worst = int(logits.argmin())                        # far from a tie
    bad = ref["A"][:6] + [worst] + ref["A"][7:]
    ok, what = disturbance.check_tokens(e, prompts, ref, {"A": bad})
    assert not ok and what.startswith(f"DIFFERS at A@6 ({ref['A'][6]} vs {worst}, gap "), what
    gap = float(what.split("gap ")[1].rstrip(")"))
    assert gap == pytest.approx(float(logits.max() - logits.min()), abs=1e-3)


def test_difference_at_a_near_tie_is_a_flip(served, monkeypatch):
    e, prompts, ref = served
    logits = e.score(prompts["A"] + ref["A"][:3], last_only=True)[-1]
    second = int(logits.topk(2).indices[1])
    gap = float(logits.topk(2).values[0] - logits.topk(2).values[1])
    flipped = ref["A"][:3] + [second] + ref["A"][4:]
    monkeypatch.setattr(disturbance, "TIE_THRESHOLD", gap + 1e-3)   # make this gap count as a tie
    ok, what = disturbance.check_tokens(e, prompts, ref, {"A": flipped})
    assert ok and what.startswith("tie flip at A@3"), what
    monkeypatch.setattr(disturbance, "TIE_THRESHOLD", gap / 2)      # and not, under a tighter rule
    ok, what = disturbance.check_tokens(e, prompts, ref, {"A": flipped})
    assert not ok and what.startswith("DIFFERS at A@3"), what


def test_cli_short_run(tmp_path):
    rc = disturbance.main(["--model", "small", "--device", "cpu", "--threads", "1", "--b-tokens", "640",
                           "--chunk-tokens", "64", "--shares", "1,0.5", "--b-at", "0.3", "--c-after", "0.05",
                           "--alone-reps", "1", "--no-progress", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "disturbance.csv")))
    assert rc == 0 and [float(r["prefill_share"]) for r in rows] == [1.0, 0.5]
    assert all(r["tokens_check"] == "identical" for r in rows), rows   # fp32 on the CPU: no flips expected
    assert float(rows[0]["decode_time_share"]) == 0.0 and float(rows[1]["withheld_steps"]) > 0
    assert all(float(r["c_ttft_s"]) > 0 and float(r["b_alone_s"]) > 0 for r in rows)


def test_message_names_the_step_kinds(served):
    e, prompts, ref = served
    kinds = disturbance.token_kinds(e, ["A"])
    assert kinds["A"][0] in ("chunk-only", "loaded") and set(kinds["A"][1:]) == {"pure-decode"}
    logits = e.score(prompts["A"] + ref["A"][:2], last_only=True)[-1]
    bad = ref["A"][:2] + [int(logits.argmin())] + ref["A"][3:]
    other = {"A": ["loaded"] * len(bad)}
    ok, what = disturbance.check_tokens(e, prompts, ref, {"A": bad}, kinds, other)
    assert not ok and "; a loaded step here, pure-decode in the first run)" in what, what


def test_strict_tokens_flag():
    assert disturbance.parse_args([]).strict_tokens is None           # the default: strict in float32 only
    assert disturbance.parse_args(["--strict-tokens"]).strict_tokens is True
    assert disturbance.parse_args(["--no-strict-tokens"]).strict_tokens is False


def test_decode_share_counts_from_b_admission():
    """A pure decode step that starts after B's arrival time but was planned before B was delivered (a slow
    host) is not B's fill: at p = 1 every step from B's admission to its first token is loaded, share 0."""
    from types import SimpleNamespace as NS
    sc = NS(b_at=0.3)
    a = NS(token_times=[0.27, 0.28, 0.29, 0.35, 0.45, 0.55], output=[1] * 6, state=NS(value="running"),
           finish_time=None)
    b = NS(output=[7], first_token_time=0.6, arrival_time=0.3, admit_time=0.31)
    c = NS(output=[8], first_token_time=0.58, arrival_time=0.35)
    trace = [NS(kind=StepKind.PURE_DECODE, start=t, duration=0.01) for t in (0.1, 0.2, 0.295, 0.305)]
    trace += [NS(kind=StepKind.LOADED, start=t, duration=0.05) for t in (0.31, 0.4, 0.5)]
    e = NS(requests={"A": a, "B": b, "C": c}, trace=trace, scheduler=NS(withheld_steps=0))
    assert disturbance.measure(e, sc)["decode_time_share"] == 0.0
    trace.insert(5, NS(kind=StepKind.PURE_DECODE, start=0.35, duration=0.01))   # one inside the fill counts
    assert disturbance.measure(e, sc)["decode_time_share"] > 0.0
