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
        max_q, max_kv = batch.max_q, batch.max_kv
        if dev.type != "cuda":
            # nothing is captured off CUDA, so reading the lengths costs no sync: the step's own longest history
            # bounds the gather (the bound stays a cap). The captured steps' path, emulated on a CPU, passes the
            # table's whole width for each piece: 30 times the step's attention, most of the CPU gates' time
            max_kv = max(1, min(max_kv, int(batch.kv_lens_t.max())))
        slots = gather_slots(batch.block_tables, batch.kv_lens_t, max_kv, batch.page_size)
        cu = batch.cu_q_t.long()
        q_lens = cu[1:] - cu[:-1]
        kv_lens = batch.kv_lens_t.long()
        i = torch.arange(max_q, device=dev)
        j = torch.arange(max_kv, device=dev)
        # query i of sequence b sits at history position kv_len - q_len + i and sees keys up to it (causal)
        qpos = (kv_lens - q_lens)[:, None] + i[None, :]                              # [B, max_q]
        mask = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])
        # packed row -> (sequence, index in sequence), to pad queries and unpad outputs; a sequence with no query
        # row (a captured step's unused one) owns no row
        rows = torch.arange(batch.num_queries, device=dev)
        seq_of_row = torch.searchsorted(cu[1:], rows, right=True)
        idx_in_seq = rows - cu[seq_of_row]
        batch.prepared[kind] = (slots, mask, seq_of_row, idx_in_seq)

    def attend(self, q, k_cache, v_cache, batch: AttnBatch, scale: float, kind: str) -> torch.Tensor:
        slots, mask, seq_of_row, idx_in_seq = batch.prepared[kind]
        B, max_q = batch.num_seqs, batch.max_q
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
