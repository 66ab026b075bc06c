"""CUDA graphs of loaded and chunk-only steps, one per token-count bucket (the packed tokens padded up to it).

Attention is made graph-safe for mixed steps with two paged kernels per layer over fixed-size metadata: ONE
variable-length call (flash-attn's `flash_attn_varlen_func` with a block table) covers the whole packed step, and
ONE decode call (the pure decode step's kernel, query heads of a key/value head read together) covers the
bucket's first R rows, which hold the step's decode rows. Their metadata lives in fixed-size sections of one static
int32 buffer, refreshed in place by one host-to-device copy before each replay:

    [ tokens (T) | positions (T) | slots (T) | logit rows (R) | cache lengths (S) | cu_seqlens_q (S+1) |
      lead lengths (R) | decode rows (1) | table ((R + S) x W) ]

- Decode rows come first in a captured step (the eager step packs them last): row i of the decode call is packed
  position i, and the table's first R rows are the decode call's (row i: decode row i's pages; the pad page past
  the step's decode rows). The variable-length call sees the decode rows as sequences of up to Q_TILE queries over
  ONE key of the pad page (flash-attn writes 0 for a query whose causal mask is all zero): at 32 rows 12 CTAs,
  where a sequence a row (until session 33) made 384, each loading a whole query tile and key block for one row;
  reading each row's whole history there, once per query head and never split, had cost more than the rest of the
  step's attention. The decode call reads the true lengths ("lead lengths", 1 for rows past the step's decode
  rows) and its output replaces the other's on the decode rows ("decode rows", read on the device:
  AttentionBackend.decode_into, where the Triton decode writes only those rows, with no merge kernel after it).
- Every prompt chunk is cut into pieces of at most Q_TILE = 64 query rows, each a sequence of its own whose history
  ends at its last position (flash-attn aligns causal masks bottom-right, so a piece sees its request's history,
  the earlier pieces and itself causally: the same keys, in the same key blocks, as the whole chunk would). So
  `max_seqlen_q` is Q_TILE for every bucket, and flash-attn's grid (query tiles x sequences x heads) has one query
  tile per sequence: no tile waits on a longest sequence that a bucket must assume. flash-attn's paged varlen runs
  its split-KV kernel, whose query tile is 64 rows: a piece is exactly one of its tiles. `max_seqlen_k` is the
  table's width in slots (an upper bound it needs: it caps the key blocks it walks).
- Padding tokens (bucket - T of them) are token 0 at positions 0, 1, ... in pieces of at most 64 on the runner's pad
  page, which no request owns: each piece writes and reads only the pad page's first slots, the same values for
  every piece, so padding is finite also in poison mode and never touches a request's page. Sequences past the
  padding have no query and no key (cu_seqlens flat).
- The variable-length call's table is the table's rows from R on, one a sequence: each piece's row is its
  request's whole page list (as the eager step's table), then the pad page.
- Logit rows keep the eager step's order (the last position of each chunk that completes its prompt, then the
  decode rows), so one sampling serves both; unused rows point at row 0 and are never sampled.
- Bounds per bucket b: S(b) = min(b, max_batch + 1 + b // 64) sequences (a plan's chunks and decode rows are at
  most max_batch requests, and a chunk of c positions is ceil(c / 64) pieces), R(b) = min(b, max_batch) sampled
  rows and decode-call rows. A plan that needs more takes a larger bucket, or runs eagerly (counted in
  `fallbacks`).

Each bucket has a chunk-only step's graph (no decode call) and loaded steps' graphs, one per table width of the
decode call (the pure decode steps' width ladder: the split-KV kernel divides the table's width among its splits, so
a 128-page table cost twice a 17-page one at 32 rows on the H200). One sampling and one host readback per step, as
eagerly; only where attention's work is split differs from the eager step (its prefill kernel over the chunks, its
decode kernel over the decode rows). Off CUDA a "replay" runs the same forward over the same buffers eagerly
(engine/graphs.py)."""
from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels import AttnBatch
from .graphs import CapturedSteps, activation_bytes, captured_widths, gather_tokens
from .model import ForwardContext
from .packing import logit_row_count, pack, page_rows

if TYPE_CHECKING:
    from .runner import ModelRunner

Q_TILE = 64


def token_ladder(max_tokens: int) -> list[int]:
    """Captured token counts: 16, 32, 64, 128, then quarter octaves (160, 192, 224, 256, 320, ...), and max_tokens
    itself: a padded step computes at most 1/4 more positions than it has above 128, and 13 graphs cover chunk 512
    at 32 rows (544 tokens)."""
    sizes = [b for b in (16, 32, 64) if b < max_tokens]
    b = 128
    while b < max_tokens:
        sizes.append(b)
        b += (1 << (b.bit_length() - 1)) // 4
    return sorted(set(sizes + [max_tokens]))


def shape_only_q_lens(tokens: int, seqs: int) -> list[int]:
    """Host query lengths with a captured step's bounds (their sum, the most rows a sequence has) and no more:
    the true ones are known only to the device tensors."""
    q = [Q_TILE] * (tokens // Q_TILE) + [tokens % Q_TILE]
    return q + [0] * (seqs - len(q))


class StepGraphs(CapturedSteps):
    kind = "loaded/chunk-only"

    def __init__(self, runner: "ModelRunner", max_tokens: int, max_batch: int, width: int, progress: bool = True,
                 capture: bool = True):
        # uncaptured (a CPU), a backend whose kernels are right over the static buffers is enough
        if not (runner.backend.graph_safe_prefill or not capture and runner.backend.static_steps):
            raise RuntimeError(f"the {runner.backend.name!r} backend's prefill cannot be captured in a CUDA graph "
                               f"(its per-step tensors change shape); use a backend with graph_safe_prefill")
        if runner.pad_page is None:
            raise RuntimeError("step graphs need the runner's pad page (ModelRunner(..., pad_page=True))")
        self.max_batch = max_batch
        self.sizes = token_ladder(max_tokens)
        self.W = width
        self.pad_tile = min(Q_TILE, runner.page_size)      # a padding piece stays within the pad page
        T = self.sizes[-1]
        S, R = self.seqs_for(T), self.rows_for(T)
        super().__init__(runner, [("tokens", (T,)), ("positions", (T,)), ("slots", (T,)), ("logit_rows", (R,)),
                                  ("kv_lens", (S,)), ("cu_q", (S + 1,)), ("lead_kv", (R,)), ("decode_rows", (1,)),
                                  ("table", (R + S, width))], logit_rows=R, capture=capture)
        self.R = R                      # the table's first R rows are the decode call's, the rest one a sequence
        self.host_view["table"][:] = runner.pad_page
        self._lead_filled = 0           # decode-call table rows the last fill wrote pages into
        self.q_lens = np.zeros(S, dtype=np.int64)         # host only: query rows per sequence
        self.pad_slot = runner.pad_page * runner.page_size
        self.fallbacks = 0                                  # plans no bucket holds: run eagerly
        self._ar = np.arange(T)
        self.lead_ids = torch.arange(R, device=runner.device)            # the decode call's rows, for its mask
        self.lead_cu = torch.arange(R + 1, dtype=torch.int32, device=runner.device)
        self.prime((T,))
        # per bucket, loaded graphs by the decode call's table width (flash-attn's split-KV divides the width, not a
        # row's length, among its splits: a ladder of widths; the Triton decode: one. captured_widths, as
        # engine/graphs.py's DecodeGraphs), and a chunk-only one (width 0: no decode call, which over rows that hold
        # no decode row cost a tenth of the step)
        self.widths = captured_widths(runner.backend, width)
        self.capture([(b, w) for b in reversed(self.sizes) for w in [*reversed(self.widths), 0]], progress,
                     "capturing loaded/chunk-only step graphs")

    def seqs_for(self, b: int) -> int:
        return min(b, self.max_batch + 1 + b // self.pad_tile)

    def rows_for(self, b: int) -> int:
        return min(b, self.max_batch)

    def bucket_for(self, chunks, decodes) -> int | None:
        """The smallest captured token count whose sections hold this plan (tokens, sequences, sampled rows)."""
        d = len(decodes)
        t = sum(c.length for c in chunks) + d
        seqs = -(-d // Q_TILE) + sum(-(-c.length // Q_TILE) for c in chunks)
        rows = logit_row_count(chunks, decodes, all_logits=False)
        for b in self.sizes[bisect_left(self.sizes, t):]:
            if self.seqs_for(b) >= seqs + -(-(b - t) // self.pad_tile) and self.rows_for(b) >= rows:
                return b
        return None

    # -- static inputs -------------------------------------------------------------------------------------------
    def fill(self, chunks, decodes, pages_of: dict[str, list[int]], b: int) -> int:
        """Write this step into the host buffer, padded to bucket b, and copy the part bucket b reads to the
        device. Returns the number of sampled rows."""
        hv, ps, pad_page = self.host_view, self.runner.page_size, self.runner.pad_page
        tok, pos, slot, lr = hv["tokens"], hv["positions"], hv["slots"], hv["logit_rows"]
        q, kv = self.q_lens, hv["kv_lens"]
        lead_table, table = hv["table"][:self.R], hv["table"][self.R:]     # the decode call's; a sequence's
        self.wait_copied()
        # decode rows first (the decode call reads packed rows [0, R)), chunk positions after them; the sampled rows
        # keep the eager step's order: chunk completions, then decode rows
        d, nc = len(decodes), logit_row_count(chunks, [], all_logits=False)
        _, nrows = pack([], decodes, pages_of, ps, tok, pos, slot, lr[nc:])
        t, _ = pack(chunks, [], pages_of, ps, tok[d:], pos[d:], slot[d:], lr)
        lr[:nc] += d
        t, nrows = t + d, nrows + nc
        seqs, R = self.seqs_for(b), self.rows_for(b)
        # the variable-length call: the decode rows in sequences of up to Q_TILE queries over one key of the pad
        # page (the decode call computes these rows)
        k = -(-d // Q_TILE)
        q[:k] = Q_TILE
        if k:
            q[k - 1] = d - Q_TILE * (k - 1)
        kv[:k] = 1
        table[:k] = pad_page
        lead = hv["lead_kv"]
        lead[:d] = pos[:d] + 1
        lead[d:R] = 1               # rows past the decode rows: the pad page's first slot, masked out
        hv["decode_rows"][0] = d
        page_rows([pages_of[r.request_id] for r in decodes], None, lead_table[:d], pad_page)
        lead_table[d:self._lead_filled] = pad_page      # rows the step before filled
        self._lead_filled = d
        for c in chunks:       # pieces of at most Q_TILE rows; each history ends at the piece's last position
            n = -(-c.length // Q_TILE)
            q[k:k + n] = Q_TILE
            q[k + n - 1] = c.length - Q_TILE * (n - 1)
            kv[k:k + n] = c.start + np.cumsum(q[k:k + n])
            pages = pages_of[c.request.request_id]
            table[k, :len(pages)] = pages
            table[k, len(pages):] = pad_page
            table[k + 1:k + n] = table[k]
            k += n
        table[k:seqs] = pad_page    # padding pieces and unused sequences read only the pad page
        pad = b - t                 # padding pieces on the pad page: positions 0, 1, ... within each piece
        tok[t:b] = 0
        pos[t:b] = self._ar[:pad] % self.pad_tile
        slot[t:b] = self.pad_slot + pos[t:b]
        n = -(-pad // self.pad_tile)
        q[k:k + n] = self.pad_tile
        if n:
            q[k + n - 1] = pad - self.pad_tile * (n - 1)
        kv[k:k + n] = q[k:k + n]
        k += n
        q[k:seqs] = 0               # no query, no key
        kv[k:seqs] = 0
        cu = hv["cu_q"]
        cu[0] = 0
        np.cumsum(q[:seqs], out=cu[1:seqs + 1])
        lr[nrows:self.rows_for(b)] = 0
        self.upload(self.offsets["table"] + (self.R + seqs) * self.W)
        return nrows

    # -- capture and replay ----------------------------------------------------------------------------------
    def forward(self, key: tuple) -> torch.Tensor:
        b, w = key
        r, dv = self.runner, self.dev_view
        seqs, rows = self.seqs_for(b), self.rows_for(b)
        # bounds, not the step's lengths: a graph-safe prefill reads the true ones from the device tensors
        batch = AttnBatch(shape_only_q_lens(b, seqs), [self.W * r.page_size] * seqs,
                          dv["table"][self.R:self.R + seqs], dv["kv_lens"][:seqs], dv["cu_q"][:seqs + 1],
                          r.page_size)
        r.backend.prepare(batch, "prefill")
        lead = None
        if w:
            dec = AttnBatch([1] * rows, [w * r.page_size] * rows, dv["table"][:rows, :w], dv["lead_kv"][:rows],
                            self.lead_cu[:rows + 1], r.page_size)
            r.backend.prepare(dec, "decode")
            lead = (dec, self.lead_ids[:rows] < dv["decode_rows"], dv["decode_rows"])
        ctx = ForwardContext(dv["slots"][:b].long(), b, batch, None, r.backend, lead=lead, **r.layer_kernels())
        return r.model(dv["tokens"][:b].long(), dv["positions"][:b], r.kv_caches, ctx, dv["logit_rows"][:rows].long(),
                       out=self.logits[:rows])

    def prime(self, key: tuple) -> None:
        self.fill([], [], {}, key[0])

    def estimate_pool_bytes(self, key: tuple) -> int:
        r = self.runner
        return activation_bytes(r.shape, key[0], self.rows_for(key[0]),
                                torch.tensor([], dtype=r.dtype).element_size())

    def replay(self, chunks, decodes, pages_of, source: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits of the step's sampled rows (a view of the static logits: read it before the next replay), or
        None where no captured bucket holds the plan (the caller runs it eagerly). `source`: as DecodeGraphs.replay
        (the decode rows are NextRows whose tokens are in the step before's samples on the device)."""
        b = self.bucket_for(chunks, decodes)
        if b is None:
            self.fallbacks += 1
            return None
        ps = self.runner.page_size
        w = self.width_for(max(-(-(r.num_cached + 1) // ps) for r in decodes)) if decodes else 0
        n = self.fill(chunks, decodes, pages_of, b)
        if source is not None and decodes:
            gather_tokens(self.dev_view["tokens"][:len(decodes)], source)   # decode rows are packed first
        return self.replay_key((b, w), n)


__all__ = ["Q_TILE", "StepGraphs", "shape_only_q_lens", "token_ladder"]
