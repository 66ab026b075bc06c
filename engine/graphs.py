"""CUDA graphs of the pure decode step.

A pure decode step's shapes depend only on its number of rows, so it can be captured once per batch size and
replayed: one launch instead of a few hundred (28 layers x ~12 kernels on the 1.5B shape). Sizes are a ladder
(1, 2, 4, 8, then every 8 up to max_batch); a step pads its rows up to the next captured size.

Everything a step changes lives in ONE static int32 buffer, refreshed in place by one host-to-device copy before
each replay, in sections (each contiguous, as flash-attn wants its block table and cache lengths):

    [ tokens (B) | positions (B) | slots (B) | cache lengths (B) | block table (B x W) ]

B is the largest captured size, W the most pages a request can own. Row i < n is the step's i-th decode request;
rows n..B-1 are padding: token 0 at position 0, writing and reading only slot 0 of the runner's pad page (a page
the pool never hands out), so a padded row never touches a request's page and is always finite, also in poison
mode. A row's block table lists the pages its cache length reaches, then the pad page up to W: kernels stop at the
cache length, so the tail is never read.

Graphs are captured per (rows, table width): widths 16, 32, 64, ... up to W. A step replays the narrowest width
that holds its longest row, reading the first w columns of the table in place (a strided view). flash-attn's
split-KV decode divides the table's width, not each row's length, among its splits, so a table as wide as the
longest admissible request makes every step pay for it (kernels/flash_backend.py has the H200 figures).

Captured graphs read the runner's KV cache tensors and the model's weights in place (their addresses are fixed
for the engine's life). Sampling (argmax, the poison check, top-k) runs after the replay on the graph's static
logits, the same code as an eager step, so poison mode and the gates see graphed steps exactly like eager ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import AttnBatch
from .model import ForwardContext

if TYPE_CHECKING:
    from .runner import ModelRunner

SECTIONS = ("tokens", "positions", "slots", "kv_lens")


def ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def width_ladder(width: int) -> list[int]:
    """Captured block-table widths (pages): 16, 32, 64, ... below `width`, then `width` itself."""
    out, w = [], 16
    while w < width:
        out.append(w)
        w *= 2
    return out + [width]


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", max_batch: int, width: int, progress: bool = True):
        if not getattr(runner.backend, "graph_safe_decode", False):
            raise RuntimeError(f"the {runner.backend.name!r} backend's decode cannot be captured in a CUDA graph "
                               f"(its per-step tensors change shape); use a backend with graph_safe_decode")
        self.runner = runner
        # off CUDA nothing is captured: a "replay" runs the same forward over the same static buffers eagerly, so the
        # buffer bookkeeping (refresh, padding, the pad page) is testable on a CPU (tests/test_graph_buffers.py)
        self.capture_graphs = runner.device.type == "cuda"
        self.sizes = ladder(max_batch)
        self.widths = width_ladder(width)
        self.B = self.sizes[-1]
        self.W = width
        B, W, pad = self.B, width, runner.pad_page
        n = len(SECTIONS) * B + B * W
        self.host = torch.empty(n, dtype=torch.int32, pin_memory=self.capture_graphs)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(n, dtype=torch.int32, device=runner.device)
        self.cu_q = torch.arange(B + 1, dtype=torch.int32, device=runner.device)   # one query row per request
        self.view = {name: self.host_np[i * B:(i + 1) * B] for i, name in enumerate(SECTIONS)}
        self.table = self.host_np[len(SECTIONS) * B:].reshape(B, W)
        self.pad_slot = pad * runner.page_size
        self._pad_all()
        self.dev.copy_(self.host)
        self.replays = 0
        self.last_key: tuple[int, int] | None = None     # (rows, width) of the last replay
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}     # (rows, table width) -> graph
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.capture(progress)

    # -- static inputs -------------------------------------------------------------------------------------------
    def _pad_all(self) -> None:
        v = self.view
        v["tokens"][:] = 0
        v["positions"][:] = 0
        v["slots"][:] = self.pad_slot
        v["kv_lens"][:] = 1
        self.table[:] = self.runner.pad_page

    def fill(self, decodes, pages_of: dict[str, list[int]]) -> int:
        """Write this step's rows into the host buffer (padding after them) and copy it to the device. Returns the
        table width the rows need (the most pages any row's cache length reaches)."""
        v, ps = self.view, self.runner.page_size
        n = len(decodes)
        need = 1
        for i, r in enumerate(decodes):
            pages = pages_of[r.request_id]
            pos = r.num_cached
            used = pos // ps + 1            # pages this row's cache length reaches (it owns all it reserved)
            v["tokens"][i] = r.output[-1]
            v["positions"][i] = pos
            v["slots"][i] = pages[pos // ps] * ps + pos % ps
            v["kv_lens"][i] = pos + 1
            self.table[i, :used] = pages[:used]
            self.table[i, used:] = self.runner.pad_page
            need = max(need, used)
        v["tokens"][n:] = 0
        v["positions"][n:] = 0
        v["slots"][n:] = self.pad_slot
        v["kv_lens"][n:] = 1
        self.table[n:] = self.runner.pad_page
        # safe to rewrite the pinned buffer next step: every step ends with a readback that waits for this copy
        self.dev.copy_(self.host, non_blocking=True)
        return need

    def _device_views(self, b: int, w: int):
        B, W = self.B, self.W
        sec = {name: self.dev[i * B:i * B + b] for i, name in enumerate(SECTIONS)}
        table = self.dev[len(SECTIONS) * B:].view(B, W)[:b, :w]     # rows of stride W: read in place
        return sec, table

    # -- capture and replay ----------------------------------------------------------------------------------
    def _forward(self, b: int, w: int) -> torch.Tensor:
        r = self.runner
        sec, table = self._device_views(b, w)
        # the host lengths are unknown at capture: give the upper bound (the table's width); a graph-safe decode
        # reads the true lengths from the device tensor
        batch = AttnBatch([1] * b, [w * r.page_size] * b, table, sec["kv_lens"], self.cu_q[:b + 1],
                          r.page_size)
        r.backend.prepare(batch, "decode")
        ctx = ForwardContext(sec["slots"].long(), 0, None, batch, r.backend)
        return r.model(sec["tokens"].long(), sec["positions"], r.kv_caches, ctx, None)

    @torch.inference_mode()
    def capture(self, progress: bool) -> None:
        from tqdm.auto import tqdm
        if not self.capture_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        keys = [(b, w) for b in sorted(self.sizes, reverse=True) for w in sorted(self.widths, reverse=True)]
        with torch.cuda.stream(stream):   # warm-up launches (allocator, kernel selection) off the default stream
            for b, w in keys:
                self._forward(b, w)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        torch.cuda.synchronize(self.runner.device)
        # largest first: the smaller graphs reuse the memory pool the largest one allocated
        for b, w in tqdm(keys, desc="capturing decode graphs", unit="graph", disable=not progress, leave=False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[b, w] = self._forward(b, w)
            self.graphs[b, w] = g
        torch.cuda.synchronize(self.runner.device)

    def fits(self, n: int) -> bool:
        return 0 < n <= self.B

    def size_for(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def width_for(self, pages: int) -> int:
        return next(w for w in self.widths if w >= pages)

    def replay(self, decodes, pages_of) -> torch.Tensor:
        """Logits [len(decodes), vocab] of one pure decode step (a view of the graph's static output: read it
        before the next replay)."""
        n = len(decodes)
        b = self.size_for(n)
        w = self.width_for(self.fill(decodes, pages_of))
        self.replays += 1
        self.last_key = (b, w)
        if not self.capture_graphs:
            return self._forward(b, w)[:n]
        self.graphs[b, w].replay()
        return self.logits[b, w][:n]


__all__ = ["DecodeGraphs", "ladder", "width_ladder"]
