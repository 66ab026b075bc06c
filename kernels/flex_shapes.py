"""The padded shapes and block masks of the `flex` backend (kernels/flex_backend.py's docstring, "Compiled shapes",
says why each dim is padded to a ladder): the rungs of each dim, and BlockMasks built at block granularity from a
dense mask."""
from __future__ import annotations

import torch

BLOCK = 128          # FlexAttention's default block size (both Q and KV)
MIN_BLOCKS = 2       # the shortest padded length, in blocks: one block would be a size-1 dim, specialised apart
ROWS = 32            # decode rows are padded to a multiple of this


def q_bucket(n: int) -> int:
    """The padded query length: the next power of two, at least MIN_BLOCKS blocks."""
    return max(MIN_BLOCKS * BLOCK, 1 << max(0, int(n) - 1).bit_length())


def kv_bucket(n: int) -> int:
    """The padded key length: the smallest of 128 x {2, 3, 4, 6, 8, 12, ...} that holds n."""
    blocks = max(MIN_BLOCKS, -(-int(n) // BLOCK))
    p = 1 << (blocks - 1).bit_length()          # next power of two >= blocks
    if p >= 4 and blocks <= 3 * p // 4:
        p = 3 * p // 4
    return p * BLOCK


def rows_bucket(n: int) -> int:
    return max(ROWS, -(-int(n) // ROWS) * ROWS)


def ladder(max_len: int, bucket=kv_bucket) -> list[int]:
    """Every padded length a dim of at most `max_len` can take under `bucket`."""
    out, n = [], 1
    while True:
        b = bucket(n)
        out.append(b)
        if b >= max_len:
            return out
        n = b + 1


def _sparse(flags: torch.Tensor):
    """[B, nq, nk] bool block flags -> (num [B, 1, nq] int32, indices [B, 1, nq, nk] int32), listed blocks first."""
    num = flags.sum(-1, dtype=torch.int32)
    idx = torch.argsort(flags.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None].contiguous(), idx[:, None].contiguous()


def block_mask_from_dense(dense: torch.Tensor, mask_mod, q_len: int, kv_len: int):
    """A BlockMask from a dense [B, q_len, kv_len] bool mask (kv_len a multiple of BLOCK): blocks with some but not
    all entries allowed are partial (mask_mod applied), blocks with all allowed are full; rows past q_len (padding of
    the last query block) do not exist for the kernel, so they count as allowed for 'full' and not for 'partial'."""
    from torch.nn.attention.flex_attention import BlockMask
    B = dense.shape[0]
    nq, nk = -(-q_len // BLOCK), kv_len // BLOCK
    assert kv_len % BLOCK == 0 and tuple(dense.shape) == (B, q_len, kv_len), (dense.shape, q_len, kv_len)
    pad = nq * BLOCK - q_len
    if pad:
        lo = torch.cat([dense, dense.new_zeros(B, pad, kv_len)], 1)
        hi = torch.cat([dense, dense.new_ones(B, pad, kv_len)], 1)
    else:
        lo = hi = dense
    any_ = lo.view(B, nq, BLOCK, nk, BLOCK).any(4).any(2)
    all_ = hi.view(B, nq, BLOCK, nk, BLOCK).all(4).all(2)
    kv_num, kv_idx = _sparse(any_ & ~all_)
    full_num, full_idx = _sparse(all_)
    # compute_q_blocks=False: the query-side indices serve only the backward pass (none runs here); building them
    # transposes and repacks the whole sparse map: 295 aten ops a mask instead of 73 (2.3 against 1.0 ms on a CPU),
    # on CUDA each a launch of an eager reference step
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len), compute_q_blocks=False)


__all__ = ["BLOCK", "MIN_BLOCKS", "ROWS", "q_bucket", "kv_bucket", "rows_bucket", "ladder", "block_mask_from_dense"]
