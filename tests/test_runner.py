"""The model runner: a packed step's logits match transformers' own forward on the same sequences (fp32), in both
forward modes, and sampling makes one host readback per step."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from kernels import BACKENDS
from kernels.torch_backend import TorchBackend
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


class AppendingTorch(TorchBackend):
    """The torch reference, but its decode writes the rows' new K/V itself, where flash-attn's with_kvcache writes
    them (cache_seqlens = kv_lens - 1, through the block table): the model's path for backends that append."""
    appends_decode_kv = True
    offset = 1      # a planted bug sets 0: the new K/V lands one slot past the row's last position
    appended = 0

    def decode(self, q, k_cache, v_cache, batch, scale, new_kv=None):
        if new_kv is not None:
            pos = batch.kv_lens_t.long() - self.offset
            pages = batch.block_tables.long().gather(1, (pos // batch.page_size)[:, None])[:, 0]
            slots = pages * batch.page_size + pos % batch.page_size
            kvh, d = k_cache.shape[2], k_cache.shape[3]
            k_cache.view(-1, kvh, d)[slots] = new_kv[0]
            v_cache.view(-1, kvh, d)[slots] = new_kv[1]
            self.appended += len(slots)
        return super().decode(q, k_cache, v_cache, batch, scale)


class RotatingTorch(AppendingTorch):
    """AppendingTorch whose decode also applies the rotary embedding (rotates_decode, as the flash backend's Triton
    decode with the append): the model hands it the queries and new keys unrotated, with cos and sin."""
    rotates_decode = True
    rotate_keys = True      # a planted bug sets False: the new key lands in the cache unrotated
    rotated_calls = 0

    def decode(self, q, k_cache, v_cache, batch, scale, new_kv=None, rope=None):
        from engine.layer_kernels import rope as rotate
        if rope is None:        # a loaded step's decode rows: the model rotated them and wrote their keys
            assert new_kv is None, "an appending decode got its new keys without cos and sin"
            return super().decode(q, k_cache, v_cache, batch, scale)
        cos, sin = rope
        RotatingTorch.rotated_calls += 1
        k, v = new_kv
        return super().decode(rotate(q, cos, sin), k_cache, v_cache, batch, scale,
                              (rotate(k, cos, sin) if self.rotate_keys else k, v))


def _serve_logged(monkeypatch, backend_cls):
    monkeypatch.setitem(BACKENDS, "torch", backend_cls)
    e = Engine(EngineConfig(chunk_tokens=32, num_pages=64, record_topk=3))
    e.runner.backend.appended = 0
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate((5, 70, 19)):        # decodes beside chunks (loaded steps), then pure decode steps
        e.submit(torch.randint(3, 1000, (n,), generator=g).tolist(), 8, f"r{i}")
    e.run()
    return {rid: (list(r.output), e.topk[rid]) for rid, r in e.requests.items()}, e.runner.backend.appended


def test_a_backend_that_appends_decode_kv_gets_the_same_tokens_and_logits(monkeypatch):
    """Pure decode steps over a backend with appends_decode_kv skip the model's cache writes and hand the rows'
    K/V to its decode (flash-attn's with_kvcache writes them in the kernel): the same tokens and top logits as the
    reference; a write one slot off (planted) changes them."""
    ref, appended = _serve_logged(monkeypatch, TorchBackend)
    assert appended == 0
    got, appended = _serve_logged(monkeypatch, AppendingTorch)
    assert appended > 0, "no pure decode step handed its K/V to the backend"
    assert got == ref

    class OffByOne(AppendingTorch):
        offset = 0
    planted, _ = _serve_logged(monkeypatch, OffByOne)
    assert planted != ref, "a K/V append one slot off went unnoticed"


def test_a_backend_that_rotates_in_its_decode_gets_the_same_tokens_and_logits(monkeypatch):
    """Pure decode steps over a backend with rotates_decode launch no rotary kernel: the model hands its decode the
    queries and new keys unrotated, with each row's cos and sin, and the decode rotates them (the flash backend's
    Triton decode does it in the kernel). The same tokens and top logits as the reference; a decode that writes
    its new keys unrotated (planted) changes them."""
    ref, _ = _serve_logged(monkeypatch, TorchBackend)
    monkeypatch.setattr(RotatingTorch, "rotated_calls", 0)
    got, appended = _serve_logged(monkeypatch, RotatingTorch)
    assert appended > 0 and RotatingTorch.rotated_calls > 0, "no pure decode step handed its rotation to the backend"
    assert got == ref

    class KeysUnrotated(RotatingTorch):
        rotate_keys = False
    planted, _ = _serve_logged(monkeypatch, KeysUnrotated)
    assert planted != ref, "new keys written unrotated went unnoticed"
