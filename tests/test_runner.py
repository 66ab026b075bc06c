"""The model runner: a packed step's logits match transformers' own forward on the same sequences (fp32), in both
forward modes, and sampling makes one host readback per step."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.loader import hf_model
from engine.scheduler import Chunk
from engine.request import Request

TOL = 5e-3   # fp32; seen 9e-4 at most on the small model, whose logits reach about 100


@pytest.fixture(scope="module")
def hf():
    return hf_model()


def test_packed_step_logits_match_transformers(hf):
    """One forward over three prompt chunks (with and without history) and two decode rows."""
    e = Engine(EngineConfig(chunk_tokens=64, num_pages=64))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (40, 150, 7, 90, 20)]
    reqs = [Request(f"r{i}", p, 4) for i, p in enumerate(prompts)]
    for r in reqs:
        e.pool.reserve(r.request_id, r.slots_needed)
    pages = e.pool.owned
    # histories: r1 has its first 100 positions cached, r3 and r4 are decoding at their last prompt position
    e.runner.forward([Chunk(reqs[1], 0, 100)], [], pages)
    for r in (reqs[3], reqs[4]):
        e.runner.forward([Chunk(r, 0, r.prompt_len - 1)], [], pages)
        r.num_cached = r.prompt_len - 1
        r.output = [r.prompt[-1]]     # the decode row feeds the last prompt token at its own position
    chunks = [Chunk(reqs[0], 0, 40), Chunk(reqs[1], 100, 50), Chunk(reqs[2], 0, 7)]
    logits = e.runner.forward(chunks, [reqs[3], reqs[4]], pages, all_logits=True)
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0] for p in prompts]
    expect = torch.cat([ref[0], ref[1][100:150], ref[2], ref[3][-1:], ref[4][-1:]])
    err = (logits - expect).abs().max().item()
    print(f"packed step: max abs logit error against transformers {err:.2e} over {len(expect)} rows")
    assert err < TOL, f"packed step logits differ from transformers' forward by {err}"


@pytest.mark.parametrize("forward", ["fused", "chunked"])
def test_one_host_readback_per_step(forward, monkeypatch):
    e = Engine(EngineConfig(forward=forward, chunk_tokens=32, num_pages=64))
    e.submit([5, 6], 6, "short")            # decodes while the long prompt is read: loaded steps
    e.submit(list(range(3, 100)), 3, "long")
    calls = {"n": 0}
    tolist = torch.Tensor.tolist

    def counting(self):
        calls["n"] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    kinds = []
    while e.scheduler.has_work:
        before = calls["n"]
        emitted = sum(len(r.output) for r in e.requests.values())
        rec = e.step()
        kinds.append(rec.kind)
        sampled = sum(len(r.output) for r in e.requests.values()) > emitted
        readbacks = calls["n"] - before
        # a step that samples reads back exactly once; a chunk-only step that completes no prompt samples nothing
        assert readbacks == int(sampled), f"{rec.kind} step {rec.index}: {readbacks} host readbacks"
    assert "loaded" in kinds
