"""The comparator on synthetic records: the tie rule on absolute gaps, teacher forcing after a flip, distinct sites,
and hypothesis properties (self-comparison has no flips; a gap >= threshold always fails; the rule is symmetric in
reference and candidate; sites <= differing positions)."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from gates.compare import TIE_THRESHOLD, compare, compare_request
from gates.records import GenRecord

V = 16


def record(rid, prompt, logit_rows, steps=None):
    """A greedy record from a list of logit rows: tokens are the argmax of each row."""
    rows = [torch.tensor(r, dtype=torch.float32) for r in logit_rows]
    toks = [int(r.argmax()) for r in rows]
    vals, ids = zip(*[r.topk(8) for r in rows]) if rows else ((), ())
    return GenRecord(rid, prompt, toks, [i.tolist() for i in ids], [v.tolist() for v in vals], steps)


def rows_with_winner(winners, gap=1.0, second=None):
    out = []
    for i, w in enumerate(winners):
        r = [-0.1 * i for i in range(V)]    # distinct, so the recorded top-k is well defined
        r[w] = gap
        if second is not None and second[i] is not None:
            r[second[i]] = gap - 0.0   # exact tie
        out.append(r)
    return out


def scorer_from(rows):
    return lambda prompt, tokens: torch.tensor(rows, dtype=torch.float32)


def test_identical_records_pass():
    a = record("r", [1, 2], rows_with_winner([3, 4, 5]))
    v = compare_request(a, a, None, 0.02)
    assert v.status == "identical" and not v.flips


def test_non_tie_fails_with_request_position_tokens_gaps_and_context():
    ref = record("r7", [9, 8, 7], rows_with_winner([3, 4, 5]))
    bad_rows = rows_with_winner([3, 4, 5])
    bad_rows[1][6] = 2.0          # candidate picks 6 at position 1; in the reference 6 is 1.6 below 4
    cand = record("r7", [9, 8, 7], bad_rows)
    rep = compare("g", {"r7": ref}, {"r7": cand}, None, 0.02, 3)
    assert not rep.ok
    msg = rep.problems()[0]
    for part in ("r7 position 1", "reference token 4", "candidate token 6", "not a near tie", "prompt [9, 8, 7]"):
        assert part in msg, msg
    assert "gap in reference logits 1.6000" in msg


def test_exact_tie_is_an_accepted_flip_and_the_rest_is_teacher_forced():
    ref_rows = rows_with_winner([3, 4, 5, 6], second=[None, 7, None, None])   # 4 and 7 tie at position 1
    ref = record("r", [1], ref_rows)
    cand_rows = [list(r) for r in ref_rows]
    cand_rows[1][7] += 1e-6          # the candidate breaks the tie the other way
    cand_rows[2] = rows_with_winner([9])[0]   # after the flip its continuation differs by nature
    cand = record("r", [1], cand_rows)
    # teacher forcing the reference over the candidate's tokens agrees with them after the flip
    tf = rows_with_winner([3, 4, 9, 6])
    tf[1][7] = tf[1][4]
    rep = compare("g", {"r": ref}, {"r": cand}, scorer_from(tf), 0.02, 3)
    assert rep.ok, rep.problems()
    assert rep.counts() == {"identical": 0, "flipped": 1, "failed": 0}
    assert len(rep.sites) == 1 and rep.flips[0].position == 1


def test_after_a_flip_a_non_tie_under_teacher_forcing_fails():
    ref_rows = rows_with_winner([3, 4, 5], second=[None, 7, None])
    ref = record("r", [1], ref_rows)
    cand_rows = [list(r) for r in ref_rows]
    cand_rows[1][7] += 1e-6
    cand_rows[2] = rows_with_winner([9])[0]
    cand = record("r", [1], cand_rows)
    tf = rows_with_winner([3, 4, 5])      # the reference, forced over the candidate's prefix, still says 5 not 9
    tf[1][7] = tf[1][4]
    rep = compare("g", {"r": ref}, {"r": cand}, scorer_from(tf), 0.02, 3)
    assert not rep.ok
    assert "teacher-forced" in rep.problems()[0] and "position 2" in rep.problems()[0]


def test_flip_sites_are_counted_once_per_prefix_and_capped():
    ref_rows = rows_with_winner([3, 4], second=[7, None])
    cand_rows = [list(r) for r in ref_rows]
    cand_rows[0][7] += 1e-6
    refs, cands = {}, {}
    for i in range(3):                   # the same prompt flipping in three requests: one site
        refs[f"r{i}"] = record(f"r{i}", [1, 2], ref_rows)
        cands[f"r{i}"] = record(f"r{i}", [1, 2], cand_rows)
    tf = rows_with_winner([3, 4], second=[7, None])
    rep = compare("g", refs, cands, scorer_from(tf), 0.02, flip_cap=1)
    assert rep.ok and len(rep.sites) == 1 and len(rep.flips) == 3
    refs["x"] = record("x", [5], ref_rows)
    cands["x"] = record("x", [5], cand_rows)
    rep = compare("g", refs, cands, scorer_from(tf), 0.02, flip_cap=1)
    assert not rep.ok and "2 distinct flip sites, over the cap of 1" in rep.problems()[0]


def test_schedule_difference_is_reported_apart():
    a = record("r", [1], rows_with_winner([3, 4]), steps=[5, 6])
    b = record("r", [1], rows_with_winner([3, 4]), steps=[5, 7])
    rep = compare("g", {"r": a}, {"r": b}, None, 0.02, 3)
    assert not rep.ok and rep.counts()["failed"] == 0
    assert "schedule difference, emitted at step 7, the reference at step 6" in rep.problems()[0]


def own_runner_up(ref_gap: float, cand_gap: float, teacher_forced: bool):
    """Reference and candidate that differ at one position (1, or 2 after a tie flip at 1), where the reference's
    two tokens are ref_gap apart and the candidate emits the token its own logits rank cand_gap BELOW the other."""
    pos = 2 if teacher_forced else 1
    ref_rows = rows_with_winner([3, 4, 5, 6], second=[None, 7, None, None])    # an exact tie at 1
    ref_rows[pos][9] = ref_rows[pos][5 if teacher_forced else 4] - ref_gap
    cand_rows = [list(r) for r in ref_rows]
    if teacher_forced:
        cand_rows[1][7] += 1e-6                      # the accepted flip at 1: 4 -> 7
    winner = 5 if teacher_forced else 4
    cand_rows[pos][9] = cand_rows[pos][winner] - cand_gap
    ref, cand = record("r", [1], ref_rows), record("r", [1], cand_rows)
    assert cand.tokens[pos] == winner, "the plant needs the candidate's own argmax to be the reference's token"
    cand.tokens[pos] = 9                             # the plant: emit its own runner-up
    tf = [list(r) for r in ref_rows]                 # the reference forced over the candidate's tokens
    tf[1][7] = tf[1][4]
    return ref, cand, scorer_from(tf), pos, winner


def test_a_candidate_that_picks_its_own_runner_up_just_over_the_threshold_fails():
    """The candidate side of the rule is the ABSOLUTE gap: a signed gap (own token minus the other) is negative here
    and would pass every threshold."""
    ref, cand, tf, pos, winner = own_runner_up(0.001, TIE_THRESHOLD * 1.05, teacher_forced=False)
    rep = compare("g", {"r": ref}, {"r": cand}, tf, TIE_THRESHOLD, 3)
    assert not rep.ok and rep.counts()["failed"] == 1
    msg = rep.problems()[0]
    for part in (f"r position {pos}", f"reference token {winner}", "candidate token 9",
                 "gap in reference logits 0.0010, in candidate logits 0.0210", f"not a near tie under {TIE_THRESHOLD}",
                 f"the candidate's own logits rank its token 9 below {winner} by 0.0210"):
        assert part in msg, msg


def test_a_candidate_that_picks_its_own_runner_up_under_the_threshold_is_a_flip():
    ref, cand, tf, pos, _ = own_runner_up(0.001, TIE_THRESHOLD * 0.95, teacher_forced=False)
    rep = compare("g", {"r": ref}, {"r": cand}, tf, TIE_THRESHOLD, 3)
    assert rep.ok, rep.problems()
    (flip,) = rep.flips
    assert flip.position == pos and abs(flip.cand_gap - 0.019) < 1e-5 and abs(flip.ref_gap - 0.001) < 1e-5


def test_teacher_forced_side_uses_the_absolute_gap_too():
    ref, cand, tf, pos, winner = own_runner_up(0.001, TIE_THRESHOLD * 1.05, teacher_forced=True)
    rep = compare("g", {"r": ref}, {"r": cand}, tf, TIE_THRESHOLD, 3)
    assert not rep.ok
    msg = rep.problems()[0]
    for part in (f"r position {pos}", "teacher-forced after an earlier flip", "in candidate logits 0.0210",
                 f"the candidate's own logits rank its token 9 below {winner} by 0.0210"):
        assert part in msg, msg
    ref, cand, tf, pos, _ = own_runner_up(0.001, TIE_THRESHOLD * 0.95, teacher_forced=True)
    rep = compare("g", {"r": ref}, {"r": cand}, tf, TIE_THRESHOLD, 3)
    assert rep.ok, rep.problems()
    assert [(f.position, f.teacher_forced) for f in rep.flips] == [(1, False), (pos, True)]


# -- properties ----------------------------------------------------------------------------------------------
logit_rows = st.lists(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=V, max_size=V),
                      min_size=1, max_size=12)


@given(logit_rows, st.lists(st.integers(0, V - 1), max_size=4))
def test_self_comparison_has_zero_flips(rows, prompt):
    a = record("r", prompt, rows)
    v = compare_request(a, a, None, 0.02)
    assert v.status == "identical" and v.flips == []


@given(logit_rows, st.data(), st.floats(0.02, 10.0))
def test_a_flip_with_gap_at_or_over_threshold_always_fails(rows, data, gap):
    ref = record("r", [1], rows)
    pos = data.draw(st.integers(0, len(rows) - 1))
    a = ref.tokens[pos]
    b = data.draw(st.integers(0, V - 1).filter(lambda t: t != a))
    cand_rows = [list(r) for r in rows]
    ref_rows = [list(r) for r in rows]
    ref_rows[pos][b] = ref_rows[pos][a] - gap          # the reference prefers a by `gap`
    ref_rows[pos] = [x if i in (a, b) else min(x, ref_rows[pos][b] - 1) for i, x in enumerate(ref_rows[pos])]
    cand_rows[pos] = [x if i != b else ref_rows[pos][a] + 1.0 for i, x in enumerate(ref_rows[pos])]
    ref2, cand = record("r", [1], ref_rows), record("r", [1], cand_rows)
    if ref2.tokens[pos] != a or cand.tokens[pos] != b or ref2.tokens[:pos] != cand.tokens[:pos]:
        return   # the construction did not isolate one difference at pos (float rounding); nothing to check
    v = compare_request(ref2, cand, scorer_from(ref_rows), 0.02)
    assert v.status == "failed"


@given(logit_rows, logit_rows)
def test_distinct_sites_never_exceed_differing_positions(rows_a, rows_b):
    n = min(len(rows_a), len(rows_b))
    a, b = record("r", [1], rows_a[:n]), record("r", [1], rows_b[:n])
    rep = compare("g", {"r": a}, {"r": b}, scorer_from(rows_a[:n]), threshold=10.0, flip_cap=10 ** 6)
    differing = sum(x != y for x, y in zip(a.tokens, b.tokens))
    assert len(rep.sites) <= max(differing, len(rep.flips))
    assert len(rep.sites) <= n


small_rows = st.lists(st.floats(-0.0625, 0.0625, allow_nan=False, width=32), min_size=V, max_size=V)


@given(st.lists(st.tuples(small_rows, small_rows, st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=6),
       st.floats(0.001, 0.05))
def test_the_tie_rule_is_symmetric_and_on_absolute_gaps(rows, threshold):
    """Each side emits its top-1 or top-2 token (so either may rank its own token lower): the first difference is
    accepted exactly when both sides' absolute gaps are under the threshold, whichever side is the reference."""
    x = record("x", [1], [r for r, _, _, _ in rows])
    y = record("x", [1], [[u + d / 2 for u, d in zip(r, e)] for r, e, _, _ in rows])   # y: x moved a little
    x.tokens = [x.topk_ids[i][k] for i, (_, _, k, _) in enumerate(rows)]
    y.tokens = [y.topk_ids[i][k] for i, (_, _, _, k) in enumerate(rows)]
    one, other = compare_request(x, y, None, threshold), compare_request(y, x, None, threshold)
    accepted = lambda v: v.failure is None or "accepted flip" in v.failure.reason   # noqa: E731
    assert accepted(one) == accepted(other), (one.failure, other.failure)
    diff = next((i for i, (a, b) in enumerate(zip(x.tokens, y.tokens)) if a != b), None)
    if diff is None:
        assert one.status == "identical"
        return
    a, b = x.tokens[diff], y.tokens[diff]
    gaps = [(r.logit(diff, a), r.logit(diff, b)) for r in (x, y)]
    tie = all(u is not None and w is not None and abs(u - w) < threshold for u, w in gaps)
    assert accepted(one) == tie, (gaps, one.failure)
