"""CUDA graphs of the pure decode step, and what every captured step shares (`CapturedSteps`).

A pure decode step's shapes depend only on its number of rows, so it can be captured once per batch size and
replayed: one launch instead of a few hundred (28 layers x ~12 kernels on the 1.5B shape). Sizes are a ladder
(1, 2, 4, then every 8 up to 128, every 16 up to 256, every 32 beyond, up to max_batch); a step pads its rows up to
the next captured size.

Everything a step changes lives in ONE static int32 buffer, refreshed in place by one host-to-device copy before
each replay, in sections (each contiguous, as flash-attn wants its block table and cache lengths):

    [ tokens (B) | positions (B) | slots (B) | cache lengths (B) | block table (B x W) ]

B is the largest captured size, W the most pages a request can own. Row i < n is the step's i-th decode request;
rows n..B-1 are padding: token 0 at position 0, writing and reading only slot 0 of the runner's pad page (a page
the pool never hands out), so a padded row never touches a request's page and is always finite, also in poison
mode. A row's block table lists the pages its cache length reaches, then the pad page up to W: kernels stop at the
cache length, so the tail is never read.

Graphs are captured per (rows, table width). For flash-attn's split-KV decode the widths are a ladder, 16, 24, 32,
64, ... up to W (width_ladder), and a step replays the narrowest width that holds its longest row, reading the first
w columns of the table in place (a strided view): split-KV divides the table's width, not each row's length, among
its splits, so a table as wide as the longest admissible request would make every step pay for it
(kernels/flash_backend.py says why). The Triton decode (the flash backend's default) splits by length over a
persistent grid, so its cost does not follow the width (the backend's width_free_decode): one width, W, is captured
(captured_widths), five times fewer graphs at the 1.5B shape's 128-page tables.

Captured graphs read the runner's KV cache tensors and the model's weights in place (their addresses are fixed
for the engine's life) and write their logits into one static buffer per graph set. Sampling (argmax, the poison
check, top-k) runs after the replay on those logits, the same code as an eager step, so poison mode and the gates
see graphed steps exactly like eager ones. Loaded and chunk-only steps: engine/step_graphs.py.
"""
from __future__ import annotations

import gc
import time
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels import AttnBatch
from .model import ForwardContext
from .packing import pack, page_rows

if TYPE_CHECKING:
    from .runner import ModelRunner

SECTIONS = ("tokens", "positions", "slots", "kv_lens")
MIB = 1 << 20
# (CapturedSteps.warm_signature(), key) of every warm-up forward this process ran before a capture. A warm-up makes
# the kernels a capture will record compile and load outside it (Triton's, Inductor's pieces, cuBLAS's choice); in a
# process that already ran the same forward at the same shapes (a gate suite builds one configuration's engine about
# 15 times) they are loaded, and the warm-up is a synchronised eager forward for nothing (session 42's serial cold
# suite: 7.7 s of warm-up forwards for 583 graphs). A kernel that the signature missed compiles inside the capture:
# allowed there (the same graph, slower to build) or the capture fails loudly; never other tokens
WARMED: set[tuple] = set()


def ladder(max_batch: int) -> list[int]:
    """Captured row counts: 1, 2, 4, then every 8 up to 128, every 16 up to 256, every 32 beyond (from 64 rows on,
    a padded step computes at most 1/8 more rows than it has), and max_batch itself: 35 sizes at 512 rows, 7 at 32."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 128 else (16 if b < 256 else 32)
    return sorted(set(sizes + [max_batch]))


def width_ladder(width: int) -> list[int]:
    """Captured block-table widths (pages): 16, 24, 32, 64, 128, ... below `width`, then `width` itself. 24: the
    split-KV kernel gives each split about 3 key blocks of the table's width (kernels/flash_backend.py), so a row
    of 17 to 24 pages (4k to 6k positions: most of the mixed workload's longest rows) in a 32-page table runs 22
    splits, the last third of them empty for every row, and the combine reads them all; at width 24, 16 splits."""
    out, w = [], 16
    while w < width:
        out.append(w)
        if w == 16 and width > 24:
            out.append(24)
        w *= 2
    return out + [width]


def captured_widths(backend, width: int) -> list[int]:
    """The block-table widths a graph set captures: the whole width where the backend's decode costs follow the
    rows' lengths (width_free_decode: the Triton decode), else width_ladder(width) (flash-attn's split-KV)."""
    return [width] if backend.width_free_decode else width_ladder(width)


def gather_tokens(tokens: torch.Tensor, source: torch.Tensor) -> None:
    """tokens[i] = source[tokens[i]]: rows packed with their index in the step before's samples (NextRow.output)
    get their input tokens on the device. A gather into a new tensor, then the copy: no overlap of the two."""
    tokens.copy_(source.index_select(0, tokens))


class CapturedSteps:
    """What every set of captured steps shares: one int32 static input buffer in named sections (pinned on the
    host, refreshed on the device by one copy of the prefix a step uses), the runner's static fp32 logits buffer that
    every graph writes (one for all sets: a step's logits are read back before the next step replays anything; at
    512 rows it is 0.3 GiB on the 1.5B shape), and capture of a list of keys into the runner's graph memory pool,
    largest first.

    Off CUDA nothing is captured: a "replay" runs the same forward over the same static buffers eagerly, so the
    buffer bookkeeping (refresh, padding, the pad page) is testable on a CPU."""
    kind = "captured"

    def __init__(self, runner: "ModelRunner", sections: list[tuple[str, tuple[int, ...]]], logit_rows: int,
                 capture: bool = True):
        # a weak reference: the runner owns its graph sets, so the two never form a cycle that keeps a dropped
        # engine's KV cache alive until the collector runs
        self.runner = runner if isinstance(runner, weakref.ProxyTypes) else weakref.proxy(runner)
        # capture=False on CUDA: the same forward over the same buffers, eagerly (EngineConfig.capture_graphs)
        self.capture_graphs = capture and runner.device.type == "cuda"
        self.offsets: dict[str, int] = {}
        n = 0
        for name, shape in sections:
            self.offsets[name] = n
            n += int(np.prod(shape))
        self.host = torch.empty(n, dtype=torch.int32, pin_memory=self.capture_graphs)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(n, dtype=torch.int32, device=runner.device)
        self.copied = torch.cuda.Event() if self.capture_graphs else None    # the last upload's copy is done
        self.host_view, self.dev_view = {}, {}
        for name, shape in sections:
            lo, size = self.offsets[name], int(np.prod(shape))
            self.host_view[name] = self.host_np[lo:lo + size].reshape(shape)
            self.dev_view[name] = self.dev[lo:lo + size].view(shape)
        shared = runner.graph_logits
        self.owns_logits = shared is None or shared.shape[0] < logit_rows
        if self.owns_logits:
            # the model's output width: the vocabulary, or a tensor-parallel rank's packed choice (ChoiceModel)
            runner.graph_logits = torch.empty(logit_rows, runner.model.out_width, dtype=torch.float32,
                                              device=runner.device)
        self.logits = runner.graph_logits
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.last_key: tuple | None = None
        self.capture_s = 0.0            # the whole capture: warm-up forwards and the captures
        self.warm_s = 0.0               # of it, the warm-up forwards (synchronised; warm_keys says which keys)
        self.warmed = 0                 # how many keys had one
        self.pool_bytes = 0

    def upload(self, upto: int | None = None) -> None:
        """Copy the host buffer's first `upto` entries (all by default) to the device, asynchronously."""
        n = self.host.numel() if upto is None else upto
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def wait_copied(self) -> None:
        """Before rewriting the pinned buffer: the last upload's copy must have read it. Usually long done (a
        step's readback waits for it), but a chunk-only step that completes no prompt samples nothing."""
        if self.copied is not None:
            self.copied.synchronize()

    def width_for(self, pages: int) -> int:
        """The narrowest captured block-table width (self.widths) that holds `pages` pages."""
        return next(w for w in self.widths if w >= pages)

    def forward(self, key: tuple) -> torch.Tensor:
        """The captured step of `key` over the device sections, writing the logits buffer (subclasses)."""
        raise NotImplementedError

    def prime(self, key: tuple) -> None:
        """Make the static buffer a valid step of `key` (all padding) before a warm-up forward runs it."""

    def estimate_pool_bytes(self, key: tuple) -> int:
        """A rough upper bound of one forward's activations at `key` (for planning where nothing is captured)."""
        raise NotImplementedError

    def warm_signature(self) -> tuple:
        """What decides the kernels, and the shapes they are launched at, of this graph set's forwards besides the
        key: the graph kind and its static buffers' layout, the model's shape, the backend and its kernel choices,
        the cache's pages, dtype and device, and the runner's layer kernels (elementwise pieces, MLP, projections,
        PDL)."""
        r = self.runner
        return (self.kind, tuple(self.offsets.items()), self.host.numel(), self.logits.shape[0],
                getattr(self, "max_batch", None), r.shape,
                r.backend.name, tuple(sorted(r.backend_options.items())), r.page_size, r.num_pages,
                r.pad_page, str(r.device), r.dtype, tuple((n, id(f)) for n, f in sorted(r.ops.items())),
                r.mlp_rows, r.linear_rows, r.pdl)

    def warm_keys(self, keys: list[tuple]) -> list[tuple]:
        """The keys whose warm-up forward runs before the captures: the first always (this capture's new stream:
        its cuBLAS workspace is made outside the capture), and each one this process has not run yet under the
        same signature (WARMED). Records them."""
        sig = self.warm_signature()
        out = [k for i, k in enumerate(keys) if i == 0 or (sig, k) not in WARMED]
        WARMED.update((sig, k) for k in out)
        return out

    @torch.inference_mode()
    def capture(self, keys: list[tuple], progress: bool, desc: str) -> None:
        """Capture every key, largest first (the smaller graphs reuse the memory the largest one took)."""
        from tqdm.auto import tqdm
        self.keys = list(keys)
        if not self.capture_graphs:
            return
        r = self.runner
        t0 = time.perf_counter()
        if r.graph_pool is None:
            r.graph_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(r.device)
        stream.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(stream):   # warm-up launches (allocator, kernel selection) off the default stream
            warm = self.warm_keys(self.keys)
            self.warmed = len(warm)
            for key in warm:
                self.prime(key)
                self.forward(key)
                stream.synchronize()      # the next prime rewrites the pinned buffer this one's copy reads
        torch.cuda.current_stream(r.device).wait_stream(stream)
        torch.cuda.synchronize(r.device)
        self.warm_s = time.perf_counter() - t0
        torch.cuda.empty_cache()          # what the warm-ups cached is not the graphs' memory
        before = torch.cuda.memory_reserved(r.device)
        # capture_begin/capture_end on a side stream is what `torch.cuda.graph` does, less its gc.collect() and
        # empty_cache() per graph (the memory was settled once, above). No collection during the captures: one
        # inside a capture frees whatever garbage holds (an earlier engine's graphs, its events), calls that a
        # global-mode capture forbids, and the capture is invalidated ("operation failed due to a previous error
        # during capture": the flash gate suite, session 20); the garbage waits for the first collection after
        # them. Nor one before them: disabling the collector is enough, and a full collection of a process that
        # holds the gate suite is slow (session 22: the serial GPU suite's captures took 46.6 s for 524 graphs, 89 ms
        # a graph, beside 5.3 s of warm-up forwards; the collection before each graph set was the suspect)
        collecting = gc.isenabled()
        gc.disable()
        stream.wait_stream(torch.cuda.current_stream(r.device))
        try:
            with torch.cuda.stream(stream):
                for key in tqdm(self.keys, desc=desc, unit="graph", disable=not progress, leave=False):
                    g = torch.cuda.CUDAGraph()
                    g.capture_begin(pool=r.graph_pool)
                    try:
                        self.forward(key)
                    finally:
                        g.capture_end()
                    self.graphs[key] = g
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream(r.device).wait_stream(stream)
        torch.cuda.synchronize(r.device)
        self.capture_s = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved(r.device) - before

    def replay_key(self, key: tuple, n: int) -> torch.Tensor:
        """The first n logit rows of the step captured at `key` (a view of the static buffer: read it before the
        next replay)."""
        self.replays += 1
        self.last_key = key
        if self.capture_graphs:
            self.graphs[key].replay()
        else:
            self.forward(key)
        return self.logits[:n]

    def report(self) -> dict:
        """Graphs captured, capture time and memory: static buffers, the logits buffer, and what the captures added
        to the graph pool (measured on CUDA; off CUDA, the estimate of the largest key's activations)."""
        keys = getattr(self, "keys", [])
        est = max((self.estimate_pool_bytes(k) for k in keys), default=0)
        return dict(kind=self.kind, graphs=len(self.graphs), keys=len(keys), captured=self.capture_graphs,
                    capture_s=round(self.capture_s, 3), warm_s=round(self.warm_s, 3), static_bytes=self.host.numel() * 4,
                    logits_bytes=self.logits.numel() * 4 if self.owns_logits else 0, pool_bytes=self.pool_bytes,
                    pool_estimate_bytes=est)

    def describe(self) -> str:
        r = self.report()
        done = (f"{r['graphs']} {self.kind} graphs captured in {r['capture_s']:.2f} s (warm-up forwards "
                f"{r['warm_s']:.2f} s, {self.warmed} of them)" if r["captured"] else
                f"{r['keys']} {self.kind} step shapes emulated (off CUDA: nothing captured)")
        pool = (f"graph pool +{r['pool_bytes'] / MIB:.1f} MiB" if r["captured"] else
                f"graph pool about {r['pool_estimate_bytes'] / MIB:.1f} MiB (estimate)")
        logits = f"logits {r['logits_bytes'] / MIB:.1f} MiB" if self.owns_logits else "logits shared"
        return f"{done}; memory: {pool}, {logits}, static inputs {r['static_bytes'] / MIB:.2f} MiB"


def activation_bytes(shape, tokens: int, logit_rows: int, element: int) -> int:
    """The live tensors of one forward at `tokens` packed positions, roughly: hidden and residual streams, q/k/v,
    attention output, gate/up and its product, and the sampled rows' logits before the fp32 copy."""
    s = shape
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    per_token = 4 * s.hidden_size + qkv + s.num_heads * s.head_dim + 3 * s.intermediate_size
    return tokens * per_token * element + logit_rows * s.vocab_size * element


class DecodeGraphs(CapturedSteps):
    kind = "decode"

    def __init__(self, runner: "ModelRunner", max_batch: int, width: int, progress: bool = True,
                 capture: bool = True):
        # uncaptured (a CPU), a backend whose kernels are right over the static buffers is enough
        if not (runner.backend.graph_safe_decode or not capture and runner.backend.static_steps):
            raise RuntimeError(f"the {runner.backend.name!r} backend's decode cannot be captured in a CUDA graph "
                               f"(its per-step tensors change shape); use a backend with graph_safe_decode")
        self.sizes = ladder(max_batch)
        self.widths = captured_widths(runner.backend, width)
        self.B = B = self.sizes[-1]
        self.W = width
        super().__init__(runner, [(name, (B,)) for name in SECTIONS] + [("table", (B, width))], logit_rows=B,
                         capture=capture)
        self.view = {name: self.host_view[name] for name in SECTIONS}
        self.table = self.host_view["table"]
        self.cu_q = torch.arange(B + 1, dtype=torch.int32, device=runner.device)   # one query row per request
        self.pad_slot = runner.pad_page * runner.page_size
        self._rows = np.empty(B, dtype=np.int64)
        self._filled: tuple[list, np.ndarray] = ([], np.empty(0, dtype=np.int64))   # the table rows' (pages, used)
        self._pad(0)
        self.upload()
        self.capture([(b, w) for b in sorted(self.sizes, reverse=True) for w in sorted(self.widths, reverse=True)],
                     progress, "capturing decode graphs")

    # -- static inputs -------------------------------------------------------------------------------------------
    def _pad(self, n: int) -> None:
        v = self.view
        v["tokens"][n:] = 0
        v["positions"][n:] = 0
        v["slots"][n:] = self.pad_slot
        v["kv_lens"][n:] = 1
        self.table[n:] = self.runner.pad_page

    def fill(self, decodes, pages_of: dict[str, list[int]]) -> int:
        """Write this step's rows into the host buffer (padding after them) and copy it to the device. Returns the
        table width the rows need (the most pages any row's cache length reaches)."""
        v, ps, n = self.view, self.runner.page_size, len(decodes)
        self.wait_copied()
        pack([], decodes, pages_of, ps, v["tokens"], v["positions"], v["slots"], self._rows)
        np.add(v["positions"][:n], 1, out=v["kv_lens"][:n])
        used = v["positions"][:n] // ps + 1     # pages its cache length reaches (it owns all it reserved)
        self._table_rows([pages_of[r.request_id] for r in decodes], used)
        self._pad(n)
        self.upload()
        return int(used.max()) if n else 1

    def _table_rows(self, pages: list[list[int]], used: np.ndarray) -> None:
        """Block-table rows: row i lists pages[i][:used[i]], then the pad page. Most pure decode steps have the rows
        of the step before with the same pages (a row's pages are fixed from its admission on), and only a row whose
        length just entered a new page changes: then only those rows are rewritten. (This is the table's only
        writer.)"""
        n, pad = len(pages), self.runner.pad_page
        last_pages, last_used = self._filled
        if pages == last_pages:         # by value: the last fill kept copies, so a list changed in place differs
            for i in np.flatnonzero(used != last_used).tolist():
                k = int(used[i])
                self.table[i, :k] = pages[i][:k]
                self.table[i, k:] = pad
            self._filled = (last_pages, used)      # the kept copies still equal the rows' pages
        else:
            page_rows(pages, used.tolist(), self.table[:n], pad)
            self._filled = ([list(p) for p in pages], used)

    def _device_views(self, b: int, w: int):
        sec = {name: self.dev_view[name][:b] for name in SECTIONS}
        return sec, self.dev_view["table"][:b, :w]     # rows of stride W: read in place

    # -- capture and replay ----------------------------------------------------------------------------------
    def forward(self, key: tuple) -> torch.Tensor:
        b, w = key
        r = self.runner
        sec, table = self._device_views(b, w)
        # the host lengths are unknown at capture: give the upper bound (the table's width); a graph-safe decode
        # reads the true lengths from the device tensor
        batch = AttnBatch([1] * b, [w * r.page_size] * b, table, sec["kv_lens"], self.cu_q[:b + 1], r.page_size)
        r.backend.prepare(batch, "decode")
        ctx = ForwardContext(sec["slots"].long(), 0, None, batch, r.backend, **r.layer_kernels())
        return r.model(sec["tokens"].long(), sec["positions"], r.kv_caches, ctx, None, out=self.logits[:b])

    def estimate_pool_bytes(self, key: tuple) -> int:
        r = self.runner
        return activation_bytes(r.shape, key[0], key[0], torch.tensor([], dtype=r.dtype).element_size())

    def fits(self, n: int) -> bool:
        return 0 < n <= self.B

    def size_for(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def replay(self, decodes, pages_of, source: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(decodes), vocab] of one pure decode step (a view of the static logits: read it before the
        next replay). `source`: the step before's sampled tokens, still on the device; the rows are then NextRows,
        whose tokens section holds their index in it (NextRow.output), and the device takes each row's token from
        there before the replay (the step is launched before the one before it is read back)."""
        n = len(decodes)
        b = self.size_for(n)
        w = self.width_for(self.fill(decodes, pages_of))
        if source is not None:
            gather_tokens(self.dev_view["tokens"][:n], source)
        return self.replay_key((b, w), n)


__all__ = ["CapturedSteps", "DecodeGraphs", "activation_bytes", "captured_widths", "gather_tokens", "ladder",
           "width_ladder"]
