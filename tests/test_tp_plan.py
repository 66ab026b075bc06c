"""The plan between tensor-parallel ranks (no processes): a worker's rebuilt plan carries what rank 0's runner reads,
step after step, as requests come, go, come back and change pages; and the sharding arithmetic."""
from __future__ import annotations

import pickle

import pytest
import torch

from engine.model import ModelShape
from engine.request import Request, State
from engine.scheduler import Chunk, StepPlan
from engine.tp.layers import check_tp, combine, kv_heads, q_heads, rank_shape, shard_summary
from engine.tp.shard import PlanReceiver, PlanSender


def step(index, chunks=(), decodes=()):
    return StepPlan(index, chunks=list(chunks), decodes=list(decodes))


def view(plan: StepPlan, pages_of) -> tuple:
    """What a runner reads of a plan."""
    return ([(c.request.request_id, c.start, c.length, c.long, c.completes_prompt,
              c.request.prompt[c.start:c.start + c.length], pages_of[c.request.request_id]) for c in plan.chunks],
            [(r.request_id, r.output[-1], r.num_cached, pages_of[r.request_id]) for r in plan.decodes])


def test_plan_round_trip_over_steps():
    a = Request("a", list(range(10, 310)), 4, state=State.PREFILL)
    b = Request("b", [5, 6, 7], 4, state=State.DECODE, num_cached=3, output=[9])
    pages = {"a": [1, 2, 3, 4, 5], "b": [6]}
    sender, receiver = PlanSender(), PlanReceiver()
    steps = [
        (step(0, [Chunk(a, 0, 128, True)], [b]), pages),
        (step(1, [Chunk(a, 128, 128)], [b]), pages),                 # both held: nothing resent
        (step(2, [], [b]), pages),                                   # a withheld: the worker drops it
        (step(3, [Chunk(a, 256, 44)], [b]), pages),                  # a comes back: sent whole again
        (step(4, [], [b, a]), {"a": [1, 2, 3, 4, 5], "b": [7]}),     # b's pages changed: resent
    ]
    sent_whole = []
    for i, (plan, pages_of) in enumerate(steps):
        b.output, b.num_cached = b.output + [20 + i], b.num_cached + 1
        if i == 4:
            a.state, a.num_cached, a.output = State.DECODE, 300, [77]
        msg = pickle.loads(pickle.dumps(sender.encode(plan, pages_of)))
        sent_whole.append(sorted(msg[1]))
        got, got_pages = receiver.decode(msg)
        assert got.index == plan.index
        assert view(got, got_pages) == view(plan, pages_of), f"step {i}"
    assert sent_whole == [["a", "b"], [], [], ["a"], ["b"]]


SMALL = ModelShape(4096, 256, 512, 4, 4, 2, 64, 1e4, 1e-6, 8192, False)
QWEN_1P5B = ModelShape(151936, 1536, 8960, 28, 12, 2, 128, 1e6, 1e-6, 32768, True)


def test_heads_split_and_replicate():
    assert [list(kv_heads(SMALL, 2, r)) for r in range(2)] == [[0], [1]]
    assert [list(kv_heads(SMALL, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]     # replicated
    assert [list(kv_heads(QWEN_1P5B, 2, r)) for r in range(2)] == [[0], [1]]
    # every rank's query heads read the key/value head their group uses at tp 1
    for s, tp in ((SMALL, 2), (SMALL, 4), (QWEN_1P5B, 2), (QWEN_1P5B, 4)):
        group = s.num_heads // s.num_kv_heads
        for r in range(tp):
            assert {h // group for h in q_heads(s, tp, r)} <= set(kv_heads(s, tp, r))
    assert (rank_shape(QWEN_1P5B, 2).num_heads, rank_shape(QWEN_1P5B, 2).num_kv_heads) == (6, 1)
    with pytest.raises(ValueError, match="12 attention heads do not split over 5 ranks"):
        check_tp(QWEN_1P5B, 5)


def test_choice_over_shards_is_argmax_with_lowest_id_on_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 24), generator=g).float()     # many exact ties
    tp = 3
    shards = logits.chunk(tp, dim=1)
    gathered = torch.stack([shard_summary(x, i * 8, 4) for i, x in enumerate(shards)])
    tokens, nonfinite, top_v, top_i = combine(gathered, 4)
    assert torch.equal(tokens.long(), logits.argmax(-1))
    assert not nonfinite.any()
    assert torch.equal(top_v, logits.topk(4, dim=-1).values)
    assert torch.equal(logits.gather(1, top_i.long()), top_v)
    logits[5, 20] = float("nan")
    gathered = torch.stack([shard_summary(x, i * 8, 0) for i, x in enumerate(logits.chunk(tp, dim=1))])
    assert combine(gathered, 0)[1].nonzero().flatten().tolist() == [5]
