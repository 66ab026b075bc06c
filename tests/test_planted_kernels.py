"""Planted kernel bugs that the kernel gates (gates/test_kernels.py) must catch, each by name.

Each plant is the torch backend with one mistake; the gate's checking function must raise an AssertionError that
names the backend, the kernel, the shape and the error. The unplanted torch backend passes the same checks, so it is
the plant that fails them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gates.kernel_check import check_kernel, compare_decode_kernels, make_case
from kernels.base import AttnBatch
from kernels.torch_backend import TorchBackend

SHAPE = dict(device="cpu", dtype=torch.float32, num_heads=4, kv_heads=2, head_dim=64, page_size=64)
DECODE_LENS = [1, 63, 64, 65, 100, 255, 256, 257]
PREFILL = dict(q_lens=[1, 5, 64, 7, 33], kv_lens=[1, 5, 64, 257, 100])


def _with(batch: AttnBatch, **changes) -> AttnBatch:
    return dataclasses.replace(batch, prepared={}, **changes)


class ReadsPastLength(TorchBackend):
    """Decode gathers kv_len + 1 slots: one slot past each request's length (its page tail, or the next page)."""
    name = "planted-reads-past-length"

    def prepare(self, batch, kind):
        if kind != "decode":
            return super().prepare(batch, kind)
        bt = batch.block_tables
        bt = torch.cat([bt, bt.new_zeros(bt.shape[0], 1)], dim=1)      # room for the extra slot
        longer = _with(batch, kv_lens=[n + 1 for n in batch.kv_lens], kv_lens_t=batch.kv_lens_t + 1,
                       block_tables=bt)
        super().prepare(longer, kind)
        batch.prepared[kind] = longer.prepared[kind]


class NextRequestsPages(TorchBackend):
    """Prefill reads each sequence's history through the NEXT sequence's block table row (rows shifted by one)."""
    name = "planted-next-request-pages"

    def prepare(self, batch, kind):
        if kind != "prefill":
            return super().prepare(batch, kind)
        shifted = _with(batch, block_tables=torch.roll(batch.block_tables, -1, dims=0))
        super().prepare(shifted, kind)
        batch.prepared[kind] = shifted.prepared[kind]


class MasksAfterLoading(TorchBackend):
    """Decode gathers whole pages (the tail past the length comes from the request's own page, not the null page)
    and masks the scores afterwards: 0 * NaN = NaN, so masking after the fact is not enough."""
    name = "planted-masks-after-loading"

    def prepare(self, batch, kind):
        super().prepare(batch, kind)
        if kind != "decode":
            return
        (rows, slots, mask, *rest), = batch.prepared[kind]     # decode rows: one tile of every sequence
        assert rows is None
        P = batch.page_size
        width = batch.block_tables.shape[1] * P
        j = torch.arange(width)
        whole = batch.block_tables.long().gather(1, (j // P).expand(batch.num_seqs, -1)) * P + j % P
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], width - mask.shape[-1])], dim=-1)
        batch.prepared[kind] = [(rows, whole, mask, *rest)]


def test_unplanted_torch_backend_passes_the_same_checks():
    check_kernel(TorchBackend(), "decode", kv_lens=DECODE_LENS, **SHAPE)
    check_kernel(TorchBackend(), "prefill", **PREFILL, **SHAPE)


def _with_unused_sequences(exact: AttnBatch, at: list[int], width: int) -> AttnBatch:
    """`exact` as a captured step passes it: sequences that own no row (null-page tables, length 0) inserted at
    positions `at` of the result, tables `width` pages wide, and host bounds in place of the lengths."""
    n = exact.num_seqs + len(at)
    real = [i for i in range(n) if i not in at]
    tables = torch.zeros(n, width, dtype=torch.int32)
    tables[real, :exact.block_tables.shape[1]] = exact.block_tables
    kv = exact.kv_lens_t.new_zeros(n)
    kv[real] = exact.kv_lens_t
    q = torch.zeros(n, dtype=exact.cu_q_t.dtype)
    q[real] = exact.cu_q_t[1:] - exact.cu_q_t[:-1]
    cu = torch.cat([exact.cu_q_t[:1], q.cumsum(0).to(exact.cu_q_t.dtype)])
    rows = exact.num_queries
    return AttnBatch([64] * (rows // 64) + [rows % 64] + [0] * (n - 1 - rows // 64),
                     [width * exact.page_size] * n, tables, kv, cu, exact.page_size)


@pytest.mark.parametrize("kind,lens,at,shapes", [
    # chunk pieces and single rows: two tiles, each as wide as its own sequences' longest history
    ("prefill", PREFILL, [0, 6], [(1, 1, 1), (4, 64, 257)]),
    # single rows only, unused sequences between them: one tile of the used ones
    ("decode", dict(kv_lens=[3, 65, 1, 130]), [1, 3, 6], [(4, 1, 130)]),
])
def test_torch_backend_off_cuda_tiles_a_captured_steps_bounds(kind, lens, at, shapes):
    """Off CUDA the torch backend reads the lengths: a captured step's shape (host bounds only, sequences that own no
    row anywhere in the batch, a table as wide as the widest request) is attended in tiles of single-row and
    multi-row sequences, each no wider than its own longest history, and gives what the exact host lengths give and
    the fp32 reference, row for row."""
    from gates.kernel_check import reference_attention
    case = make_case(**lens, **SHAPE)
    scale = case.q.shape[2] ** -0.5
    exact = case.batch()
    be = TorchBackend()
    be.prepare(exact, kind)
    want = be.attend(case.q, case.k_cache, case.v_cache, exact, scale, kind)
    bounded = _with_unused_sequences(exact, at, exact.block_tables.shape[1] + 3)
    be.prepare(bounded, kind)
    assert [tuple(t[2].shape) for t in bounded.prepared[kind]] == shapes, \
        "one tile per kind of sequence, each bounded by its own sequences"
    got = be.attend(case.q, case.k_cache, case.v_cache, bounded, scale, kind)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, reference_attention(case, scale, torch.float32), rtol=1e-5, atol=1e-5)


def test_gate_catches_decode_reading_one_slot_past_the_length():
    with pytest.raises(AssertionError, match=r"backend 'planted-reads-past-length' decode kernel, heads 4/2 .*"
                                             r"head_dim 64, page_size 64.*max error (inf|nan).*non-finite outputs"):
        check_kernel(ReadsPastLength(), "decode", kv_lens=DECODE_LENS, **SHAPE)


def test_gate_catches_decode_reading_past_the_length_on_a_page_boundary():
    """Histories that end exactly on a page edge: the extra slot is the null page (zero, finite), so no NaN;
    the gate still fails, on the values."""
    with pytest.raises(AssertionError, match=r"planted-reads-past-length' decode kernel.*max error \d.*"
                                             r"exceeds 2 x 0.000e\+00.*wrong values"):
        check_kernel(ReadsPastLength(), "decode", kv_lens=[64, 128, 256], **SHAPE)


def test_gate_catches_prefill_attending_to_the_next_requests_pages():
    with pytest.raises(AssertionError, match=r"backend 'planted-next-request-pages' prefill kernel, heads 4/2.*"
                                             r"q_lens \[1,5,64,7,33\].*max error .* exceeds"):
        check_kernel(NextRequestsPages(), "prefill", **PREFILL, **SHAPE)


def test_gate_catches_masking_after_loading_a_poisoned_slot():
    with pytest.raises(AssertionError, match=r"planted-masks-after-loading' decode kernel.*non-finite outputs"):
        check_kernel(MasksAfterLoading(), "decode", kv_lens=DECODE_LENS, **SHAPE)


def test_masking_after_loading_passes_only_without_poison():
    """The same plant is invisible on a zero-filled cache: this is why the gates poison."""
    check_kernel(MasksAfterLoading(), "decode", kv_lens=DECODE_LENS, poison=False, **SHAPE)


def test_decode_comparison_catches_the_plant():
    case = make_case(kv_lens=DECODE_LENS, seed=5, **SHAPE)
    assert compare_decode_kernels([TorchBackend()], case)["torch"] == 0.0
    with pytest.raises(AssertionError, match=r"planted-reads-past-length' decode kernel.*differs from the torch "
                                             r"decode kernel"):
        compare_decode_kernels([ReadsPastLength()], case)


def test_the_gate_hands_a_rotating_decode_unrotated_rows_and_catches_what_it_gets_wrong():
    """An appending decode that rotates (rotates_decode: the flash backend's Triton decode as served) is checked as
    the model calls it: queries and new keys unrotated, with cos and sin. A correct one passes; one that writes its
    new keys unrotated, or attends unrotated queries, fails naming what went wrong."""
    from tests.test_runner import AppendingTorch, RotatingTorch
    shape = dict(num_heads=4, kv_heads=2, head_dim=64, page_size=64)
    check_kernel(RotatingTorch(), "decode", kv_lens=DECODE_LENS, append=True, **shape)

    class KeysUnrotated(RotatingTorch):
        rotate_keys = False
    with pytest.raises(AssertionError, match=r"unrotated with cos and sin.*own key is not in the cache"):
        check_kernel(KeysUnrotated(), "decode", kv_lens=DECODE_LENS, append=True, **shape)

    class QueriesUnrotated(RotatingTorch):
        def decode(self, q, k_cache, v_cache, batch, scale, new_kv=None, rope=None):
            from engine.layer_kernels import rope as rotate
            k, v = new_kv
            return AppendingTorch.decode(self, q, k_cache, v_cache, batch, scale, (rotate(k, *rope), v))
    with pytest.raises(AssertionError, match=r"unrotated with cos and sin.*wrong values"):
        check_kernel(QueriesUnrotated(), "decode", kv_lens=DECODE_LENS, append=True, **shape)
