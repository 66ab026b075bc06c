"""The `torch` backend: plain PyTorch, any device, any page size. It is also the reference.

It gathers exactly the slots each sequence owns up to its length; padding points at the null page (page 0, always
zero, never owned), so it never touches a freed slot, another request's page or a page tail beyond the length."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .base import AttentionBackend, AttnBatch


def gather_slots(block_tables: torch.Tensor, kv_lens: torch.Tensor, max_kv: int, page_size: int) -> torch.Tensor:
    """[B, max_kv] flat cache slot of each history position; positions at or past the length map to slot 0."""
    j = torch.arange(max_kv, device=block_tables.device)
    pages = block_tables.long().gather(1, (j // page_size).expand(block_tables.shape[0], -1))
    slots = pages * page_size + j % page_size
    return torch.where(j < kv_lens.long()[:, None], slots, torch.zeros_like(slots))


# On CUDA the reference runs SDPA's math kernel. Left to choose, SDPA spent 57 to 71 ms per call on the H200 (torch
# 2.11) when every call had a new shape, as a step's do (its histories grow by one token a step); the math kernel
# took 0.27 ms, the memory-efficient one 0.85 to 1.6 ms (docs/performance.md: the probe and its figures).
CUDA_SDPA = [SDPBackend.MATH]


class TorchBackend(AttentionBackend):
    name = "torch"
    decode_kernels = ("gather",)
    prefill_kernel = "gather"
    # right over static buffers (its gathers follow the device lengths; the host gives only bounds), but not graph-safe
    # for real use: a captured decode would gather the table's whole width, 32k positions a row on the 1.5B shape
    static_steps = True

    def prepare(self, batch: AttnBatch, kind: str) -> None:
        # per-sequence lengths come from the device tensors; the host gives only the shapes (sequences, query rows,
        # the longest query and history), so a captured step may pass bounds (engine/step_graphs.py)
        dev = batch.block_tables.device
        cu = batch.cu_q_t.long()
        q_lens = cu[1:] - cu[:-1]
        kv_lens = batch.kv_lens_t.long()
        # packed row -> (sequence, index in sequence), to pad queries and unpad outputs; a sequence with no query
        # row (a captured step's unused one) owns no row
        rows = torch.arange(batch.num_queries, device=dev)
        seq_of_row = torch.searchsorted(cu[1:], rows, right=True)
        idx_in_seq = rows - cu[seq_of_row]
        if dev.type == "cuda":
            # one tile of every sequence under the host's bounds: reading the lengths would sync (and break capture)
            slots, mask = self.tile(batch.block_tables, q_lens, kv_lens, batch.max_q, batch.max_kv, batch.page_size)
            batch.prepared[kind] = [(None, slots, mask, seq_of_row, idx_in_seq)]
            return
        # Nothing is captured off CUDA, so reading the lengths costs no sync: each tile is bounded by its own longest
        # query and history, and single-row sequences (decode rows, a captured step's padding) are tiled apart from
        # chunk pieces. The captured steps' path, emulated on a CPU, passes every sequence its bucket holds (26 for
        # one chunk of 128 rows) at the longest history and the piece's 64 rows: 15 times the step's attention in
        # one tile (a fused mixed-cpu gate run with cuda_graphs=True took 17 s against 5 s without)
        tiles = []
        for sel in (q_lens == 1, q_lens > 1):
            seqs = sel.nonzero().flatten()
            if not len(seqs):
                continue
            slots, mask = self.tile(batch.block_tables[seqs], q_lens[seqs], kv_lens[seqs], int(q_lens[seqs].max()),
                                    int(kv_lens[seqs].max()), batch.page_size)
            if len(seqs) == len(q_lens):    # the tile holds every sequence, so every row, in the batch's order
                tiles.append((None, slots, mask, seq_of_row, idx_in_seq))
            else:                           # its rows, and their sequences' places in the tile
                mine = sel[seq_of_row].nonzero().flatten()
                tiles.append((mine, slots, mask, torch.searchsorted(seqs, seq_of_row[mine]), idx_in_seq[mine]))
        batch.prepared[kind] = tiles

    @staticmethod
    def tile(tables, q_lens, kv_lens, max_q: int, max_kv: int, page_size: int):
        """The gather of a tile's history slots and its causal mask [B, max_q, max_kv]: query i of sequence b sits
        at history position kv_len - q_len + i and sees keys up to it."""
        slots = gather_slots(tables, kv_lens, max_kv, page_size)
        i = torch.arange(max_q, device=tables.device)
        j = torch.arange(max_kv, device=tables.device)
        qpos = (kv_lens - q_lens)[:, None] + i[None, :]                              # [B, max_q]
        mask = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])
        return slots, mask

    def attend(self, q, k_cache, v_cache, batch: AttnBatch, scale: float, kind: str) -> torch.Tensor:
        tiles = batch.prepared[kind]
        if tiles[0][0] is None:                     # one tile holds every row
            return self.attend_tile(q, k_cache, v_cache, scale, *tiles[0][1:])
        out = torch.full_like(q, float("nan"))      # a row no tile wrote would show
        for rows, *tile in tiles:
            out[rows] = self.attend_tile(q[rows], k_cache, v_cache, scale, *tile)
        return out

    @staticmethod
    def attend_tile(q, k_cache, v_cache, scale, slots, mask, seq_of_row, idx_in_seq) -> torch.Tensor:
        B, max_q = mask.shape[:2]
        H, d = q.shape[1], q.shape[2]
        kvh = k_cache.shape[2]
        k = k_cache.view(-1, kvh, d)[slots].transpose(1, 2)         # [B, kvh, max_kv, d]: only owned slots
        v = v_cache.view(-1, kvh, d)[slots].transpose(1, 2)
        qp = q.new_zeros(B, max_q, H, d)
        qp[seq_of_row, idx_in_seq] = q
        with sdpa_kernel(CUDA_SDPA) if q.is_cuda else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
                                               enable_gqa=True)           # [B, H, max_q, d]
        return o.transpose(1, 2)[seq_of_row, idx_in_seq]

    def prefill(self, q, k_cache, v_cache, batch, scale):
        self.took("prefill", "gather")
        return self.attend(q, k_cache, v_cache, batch, scale, "prefill")

    def decode(self, q, k_cache, v_cache, batch, scale):
        self.took("decode", "gather")
        return self.attend(q, k_cache, v_cache, batch, scale, "decode")
