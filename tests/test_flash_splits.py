"""The flash backend's decode bookkeeping that runs without flash-attn: the split rule and the table cut.

flash-attn's split-KV decode divides the block table's width among its splits, so the backend cuts a decode table to
the pages the rows' lengths reach and sizes the split count from that width (kernels/flash_backend.py; H200 figures
in docs/RESULTS.md). Both are host-side and checked here on a CPU; the kernel itself is gated on a GPU."""
from __future__ import annotations

import pytest
import torch

from kernels import AttnBatch
from kernels.flash_backend import BLOCKS_PER_SPLIT, MAX_SPLITS, SPLIT_CTAS, FlashBackend, decode_splits_for


def test_split_rule():
    # head dim 128: flash-attn's split-KV key block is 128 positions; 256-slot pages are 2 blocks each. At 32 rows
    # of 2 key/value heads the width sets the count
    assert decode_splits_for(256, 128, 32, 2) == 1
    assert decode_splits_for(17 * 256, 128, 32, 2) == 12          # 34 blocks, 3 a split
    assert decode_splits_for(32 * 256, 128, 32, 2) == 22
    assert decode_splits_for(64 * 256, 128, 32, 2) == MAX_SPLITS  # capped: more splits lost on the H200
    assert decode_splits_for(128 * 256, 128, 32, 2) == MAX_SPLITS
    assert decode_splits_for(8 * 256, 64, 32, 2) == -(-8 // BLOCKS_PER_SPLIT)   # head dim 64: 256-position blocks
    # many rows fill the SMs themselves: the count the H200 probe found fastest at 200 rows (8), about 3 at 512
    assert decode_splits_for(17 * 256, 128, 200, 2) == decode_splits_for(32 * 256, 128, 200, 2) == 8
    assert decode_splits_for(17 * 256, 128, 512, 2) == -(-SPLIT_CTAS // 1024) == 3
    assert decode_splits_for(17 * 256, 128, 4096, 2) == 1
    widths = [w * 256 for w in range(1, 200)]
    for rows in (1, 32, 200, 512):
        splits = [decode_splits_for(w, 128, rows, 2) for w in widths]
        assert splits == sorted(splits) and min(splits) >= 1 and max(splits) <= MAX_SPLITS
    by_rows = [decode_splits_for(128 * 256, 128, r, 2) for r in range(1, 2048)]
    assert by_rows == sorted(by_rows, reverse=True)


def backend(splits=None) -> FlashBackend:
    """A FlashBackend without importing flash-attn: only its host-side prepare runs here."""
    b = object.__new__(FlashBackend)
    b.decode_splits = splits
    b._fallback = None
    b.dispatched = set()
    return b


def batch(kv_lens, width, page=256) -> AttnBatch:
    rows = len(kv_lens)
    bt = torch.arange(1, rows * width + 1, dtype=torch.int32).view(rows, width)
    return AttnBatch([1] * rows, list(kv_lens), bt, torch.tensor(kv_lens, dtype=torch.int32),
                     torch.arange(rows + 1, dtype=torch.int32), page)


def test_decode_table_cut_to_the_pages_the_lengths_reach():
    b = batch([1, 300, 513], width=128)      # the longest row reaches 3 pages of 256
    backend().prepare(b, "decode")
    _, bt, seqlens, before = b.prepared["decode"]
    assert bt.shape == (3, 3) and bt.stride(-1) == 1
    assert torch.equal(bt, b.block_tables[:, :3])          # the same pages, in order: a view, not a copy
    assert bt.data_ptr() == b.block_tables.data_ptr()
    assert seqlens.tolist() == [1, 300, 513] and before.tolist() == [0, 299, 512]


@pytest.mark.parametrize("lengths", [[256, 512], [257, 1]])
def test_page_boundary_lengths(lengths):
    b = batch(lengths, width=8)
    backend().prepare(b, "decode")
    need = -(-max(lengths) // 256)
    assert b.prepared["decode"][1].shape[1] == need


def test_captured_table_is_kept_whole():
    """A captured step passes host lengths as wide as its table (engine/graphs.py): nothing is cut."""
    b = batch([32 * 256] * 4, width=32)
    backend().prepare(b, "decode")
    assert b.prepared["decode"][1].shape == (4, 32)


def test_out_of_range_split_count_is_refused(monkeypatch):
    monkeypatch.setattr("kernels.flash_backend._import_flash", lambda: (None, "not here"))
    with pytest.raises(ValueError, match="0..128"):
        FlashBackend(decode_kernel="flash", decode_splits=129)


def test_decode_with_new_kv_appends_at_the_last_position():
    """new_kv goes to flash-attn as k, v [rows, 1, kv_heads, d] with cache_seqlens one short of the lengths: the
    kernel writes them there and attends over the full length. Without it the lengths go as they are."""
    calls = []

    def with_kvcache(q, k_cache, v_cache, **kw):
        calls.append(kw)
        return q.clone()
    b = backend()
    b._with_kvcache = with_kvcache
    bt = batch([1, 300, 513], width=4)
    b.prepare(bt, "decode")
    cache = torch.zeros(8, 256, 2, 64, dtype=torch.float16)
    q = torch.randn(3, 4, 64, dtype=torch.float16)
    k, v = torch.randn(3, 2, 64, dtype=torch.float16), torch.randn(3, 2, 64, dtype=torch.float16)
    b.decode(q, cache, cache, bt, 0.25)
    b.decode(q, cache, cache, bt, 0.25, new_kv=(k, v))
    assert calls[0]["cache_seqlens"].tolist() == [1, 300, 513] and "k" not in calls[0]
    assert calls[1]["cache_seqlens"].tolist() == [0, 299, 512]
    assert calls[1]["k"].shape == (3, 1, 2, 64) and torch.equal(calls[1]["k"][:, 0], k)
    assert torch.equal(calls[1]["v"][:, 0], v)
    assert calls[0]["num_splits"] == calls[1]["num_splits"]
    # each call recorded the kernel it dispatched to, with and without the append (gates/dispatch.py reads these)
    assert b.dispatched == {("decode", "flash", False), ("decode", "flash", True)}


@pytest.mark.parametrize("value, appends", [(None, True), (True, True), (False, False)])
def test_append_can_be_turned_off_for_an_ab_run(monkeypatch, value, appends):
    """EngineConfig.decode_append: None takes the backend's default (flash appends)."""
    monkeypatch.setattr("kernels.flash_backend._import_flash", lambda: (None, "not here"))
    b = object.__new__(FlashBackend)
    with pytest.raises(Exception, match="not here"):     # the choice is made before flash-attn is imported
        FlashBackend.__init__(b, decode_kernel="flash", decode_append=value)
    assert b.appends_decode_kv is appends


def _paged(cache, table_row, n):
    """The first n positions of a paged cache [pages, page, heads, d] through one block-table row."""
    pages = table_row[:-(-n // cache.shape[1])].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:n]


def _attend(q, k, v, scale):
    """Causal attention aligned bottom-right (flash-attn's): q [sq, H, d] over k, v [n, kvh, d]."""
    sq, n, g = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    sees = torch.arange(n)[None, :] <= (n - sq + torch.arange(sq))[:, None]
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~sees, float("-inf")).softmax(-1), v).to(q.dtype)


def test_flash_prefill_probe_layouts_agree_on_a_cpu(monkeypatch, capsys):
    """scripts/probes/flash_prefill.py's layouts (the chunk whole, in 64-row pieces each with its own history, the
    captured loaded step's whole call with its decode rows and padding, and with_kvcache's pieces gathered from a
    packed step) compute the same attention on the chunk's rows: run here with flash-attn's two
    calls emulated in torch and one call instead of a graph's replays, so a device call spends no time on a layout
    bug. A piece given the chunk's history instead of its own is seen."""
    import types

    from scripts.probes import flash_prefill as fp

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, block_table):
        return torch.cat([_attend(q[cu_q[b]:cu_q[b + 1]], _paged(k, block_table[b], int(cu_k[b + 1] - cu_k[b])),
                                  _paged(v, block_table[b], int(cu_k[b + 1] - cu_k[b])), softmax_scale)
                          for b in range(len(cu_q) - 1)])

    def with_kvcache(q, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits):
        return torch.stack([_attend(q[b], _paged(k, block_table[b], int(cache_seqlens[b])),
                                    _paged(v, block_table[b], int(cache_seqlens[b])), softmax_scale)
                            for b in range(q.shape[0])])

    monkeypatch.setitem(__import__("sys").modules, "flash_attn", types.SimpleNamespace(
        flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache))
    monkeypatch.setattr(fp, "have_flash", lambda prog: True)
    monkeypatch.setattr(fp, "graph_time", lambda fn, reps, per: (0.0, fn().float().clone()))
    args = ["--device", "cpu", "--layers", "1", "--chunk", "192", "--histories", "0,300", "--splits", "1,4"]
    assert fp.main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert {r[1] for r in rows} == {"varlen", "varlen-pieces", "varlen-step", "varlen-step-1seq", "kvcache",
                                    "kvcache-pieces", "kvcache-pieces+gather"}
    assert max(float(r[4]) for r in rows) < 2e-3, rows          # fp16 rounding of differently ordered sums

    def with_the_chunks_history(q, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits):
        return with_kvcache(q, k, v, cache_seqlens.max().expand_as(cache_seqlens), block_table, softmax_scale,
                            causal, num_splits)
    monkeypatch.setattr(__import__("sys").modules["flash_attn"], "flash_attn_with_kvcache", with_the_chunks_history)
    assert fp.main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert max(float(r[4]) for r in rows if r[1].startswith("kvcache-pieces")) > 1e-2
