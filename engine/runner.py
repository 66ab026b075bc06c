"""The model runner: the only place that touches the KV cache. It turns a step plan into packed tensors, runs one
forward (`fused`) or two (`chunked`), and samples greedily with ONE host readback per step (engine/readback.py).

Pure decode steps can replay CUDA graphs (`DecodeGraphs`), and loaded and chunk-only steps too (`StepGraphs`): an
eager step of a 28-layer model is launch-bound on a large GPU, a captured one is not."""
from __future__ import annotations

import gc
import sys
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kernels import AttnBatch, Unavailable, get_backend
from kernels.base import AttentionBackend

from .build_cost import add_graph_sets, timed
from .census import StepPath, kernel_paths, step_kind
from .layer_kernels import EAGER_OPS, warm_linear, warm_mlp
from .model import ForwardContext, Qwen2
from .poisoned_reads import poisoned_reads
from .pool import NULL_PAGE
from .graphs import DecodeGraphs
from .packing import logit_row_count, pack
from .readback import Sampled, StepOutput
from .scheduler import Chunk, Foresight, StepPlan
from .step_graphs import StepGraphs

if TYPE_CHECKING:
    from .config import EngineConfig


class Runner(Protocol):
    """What the engine asks of a runner: ModelRunner (one device) and engine.tp.runner.TPRunner (rank 0 of tp ranks)
    implement it explicitly. What a runner cannot do it says here (can_launch_ahead; launch_ahead returns None;
    poisoned_reads returns None), and the engine decides from that."""
    device: torch.device
    graphs: "DecodeGraphs | None"       # the captured pure decode steps (None: eager)
    can_launch_ahead: bool              # EngineConfig.overlap can be on

    def launch(self, plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str,
               use_graphs: bool = True) -> "Sampled | StepOutput": ...

    def launch_ahead(self, step: Foresight, pages_of: dict[str, list[int]], source: "Sampled",
                     forward_mode: str) -> "Sampled | None": ...

    def poison_pages(self, pages: list[int]) -> None: ...

    def poisoned_reads(self, plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str, row: int,
                       max_reads: int = 1) -> "tuple[list[int], bool] | None": ...

    def score(self, chunk: Chunk, pages: list[int], last_only: bool = False) -> torch.Tensor: ...

    def path_census(self) -> list[dict]: ...

    def close(self) -> None: ...


class ModelRunner:
    """The one-device Runner."""

    # forwards of at most this many positions run the MLP's fused kernel (kernels/mlp.py; build_runner sets it from
    # EngineConfig.mlp_kernel): every ForwardContext this runner makes carries it, and `mlp_dispatched` collects the
    # kernels its forwards' MLPs took (ForwardContext.fuses_mlp). linear_rows, linear_dispatched: the same for the
    # projections' split-K kernel (kernels/linear.py, EngineConfig.linear_kernel; ForwardContext.linear)
    mlp_rows = 0
    linear_rows = 0
    pdl = False         # the Triton kernels launched with PDL (EngineConfig.pdl; build_runner sets it)
    # the elementwise pieces every forward of this runner runs (ForwardContext.ops): EAGER_OPS, or the compiled ones
    # where its configuration compiles them (EngineConfig.compile_elementwise; build_runner sets them)
    ops = EAGER_OPS

    def __init__(self, model: Qwen2, num_pages: int, page_size: int, backend: str, device, dtype,
                 poison: bool = False, record_topk: int = 0, pad_page: bool = False,
                 backend_options: dict | None = None):
        """pad_page: one more page than the pool's (index num_pages), never owned by a request, that the padding
        rows of a captured decode step write and read (CUDA graphs). backend_options: its kernel choices
        (EngineConfig.backend_options())."""
        self.model = model
        self.shape = model.shape
        self.device = torch.device(device)
        self.dtype = dtype
        self.page_size = page_size
        self.num_pages = num_pages
        self.poison = poison
        self.record_topk = record_topk
        self.backend_options = dict(backend_options or {})
        self.backend: AttentionBackend = get_backend(backend, self.device, page_size, **self.backend_options)
        # refused here, before any launch, rather than computed wrong (a head dim a kernel is not built for)
        reason = self.backend.why_unsupported(model.shape.head_dim, dtype, model.shape.num_heads,
                                              model.shape.num_kv_heads)
        if reason:
            raise Unavailable(f"attention backend {backend!r} cannot serve this model: {reason}")
        self.census: Counter = Counter()     # the paths this runner's steps took (path_census)
        self.mlp_dispatched: set[tuple[int, str]] = set()
        self.linear_dispatched: set[tuple[int, str]] = set()
        s = self.shape
        fill = float("nan") if poison else 0.0
        self.pad_page = num_pages if pad_page else None
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        self.graph_pool = None          # one CUDA graph memory pool for every captured step
        self.graph_logits: torch.Tensor | None = None   # the static logits every captured step writes
        self.kv_caches = []
        if self.device.type == "cuda":
            need = (num_pages + bool(pad_page)) * self.bytes_per_page(s, page_size, dtype) + (1 << 30)
            room = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device) - \
                torch.cuda.memory_allocated(self.device)     # the device's free bytes and the allocator's
            if room < need:
                # a dropped engine's KV cache may sit in a reference cycle: free it before this one takes its
                # own (only then: a full collection costs about 0.2 s in a process that holds torch and dynamo)
                gc.collect()
        for _ in range(s.num_layers):
            k = torch.full((num_pages + bool(pad_page), page_size, s.num_kv_heads, s.head_dim), fill, dtype=dtype, device=self.device)
            v = torch.full_like(k, fill)
            k[NULL_PAGE] = 0   # padding of every gather points here: it must stay finite
            v[NULL_PAGE] = 0
            self.kv_caches.append((k, v))

    @property
    def can_launch_ahead(self) -> bool:
        """A step is launched ahead only as a captured step (its tokens gathered on the device)."""
        return self.graphs is not None

    def close(self) -> None:
        """Nothing to stop: one device, in this process."""

    @staticmethod
    def bytes_per_page(shape, page_size: int, dtype) -> int:
        return 2 * shape.num_layers * page_size * shape.num_kv_heads * shape.head_dim * \
            torch.tensor([], dtype=dtype).element_size()

    # -- poison ----------------------------------------------------------------------------------------------
    def poison_pages(self, pages: list[int]) -> None:
        """Freed pages hold NaN until written again: a kernel that reads one turns the logits into NaN."""
        if not self.poison or not pages:
            return
        idx = torch.tensor(pages, device=self.device)
        for k, v in self.kv_caches:
            k[idx] = float("nan")
            v[idx] = float("nan")

    # -- which poisoned slot a row read ---------------------------------------------------------------------
    def poisoned_reads(self, plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str, row: int,
                       max_reads: int = 1) -> tuple[list[int], bool] | None:
        """After a step whose sampled `row` got non-finite logits: the slots it read NaN from, found by re-running
        the step (engine/poisoned_reads.py says how)."""
        return poisoned_reads(self, plan, pages_of, forward_mode, row, max_reads)

    # -- per-step tensors ------------------------------------------------------------------------------------
    def _attn_batch(self, q_lens, kv_lens, tables) -> AttnBatch:
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [NULL_PAGE] * (width - len(t)) for t in tables], dtype=torch.int32,
                          device=self.device)
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        return AttnBatch(list(q_lens), list(kv_lens), bt,
                         torch.tensor(kv_lens, dtype=torch.int32, device=self.device),
                         torch.tensor(cu, dtype=torch.int32, device=self.device), self.page_size)

    def layer_kernels(self) -> dict:
        """A ForwardContext's layer kernel choices and where it records them (every forward this runner makes)."""
        return dict(mlp_rows=self.mlp_rows, mlp_took=self.mlp_dispatched, linear_rows=self.linear_rows,
                    linear_took=self.linear_dispatched, pdl=self.pdl, ops=self.ops)

    def build(self, chunks: list[Chunk], decodes, pages_of: dict[str, list[int]], all_logits: bool = False):
        """Packed inputs for one forward: chunk positions first, decode tokens last (engine/packing.py), copied to
        the device in one piece."""
        n = sum(c.length for c in chunks) + len(decodes)
        flat = np.empty(3 * n + logit_row_count(chunks, decodes, all_logits), dtype=np.int64)
        pack(chunks, decodes, pages_of, self.page_size, flat[:n], flat[n:2 * n], flat[2 * n:3 * n],
                       flat[3 * n:], all_logits)
        num_prefill = n - len(decodes)
        prefill = decode = None
        if chunks:
            prefill = self._attn_batch([c.length for c in chunks], [c.start + c.length for c in chunks],
                                       [pages_of[c.request.request_id] for c in chunks])
            self.backend.prepare(prefill, "prefill")
        if decodes:
            decode = self._attn_batch([1] * len(decodes), [r.num_cached + 1 for r in decodes],
                                      [pages_of[r.request_id] for r in decodes])
            self.backend.prepare(decode, "decode")
        t = torch.from_numpy(flat).to(self.device)
        ctx = ForwardContext(t[2 * n:3 * n], num_prefill, prefill, decode, self.backend, **self.layer_kernels())
        return t[:n], t[n:2 * n], ctx, t[3 * n:]

    @torch.inference_mode()
    def forward(self, chunks, decodes, pages_of, all_logits=False) -> torch.Tensor:
        tokens, positions, ctx, rows = self.build(chunks, decodes, pages_of, all_logits)
        return self.model(tokens, positions, self.kv_caches, ctx, rows)

    def capture_decode_graphs(self, max_batch: int, max_pages_per_seq: int, progress: bool = True,
                              capture: bool = True) -> None:
        """Capture the pure decode step for a ladder of batch sizes (needs the pad page and a backend whose decode
        reads only device tensors of fixed shape)."""
        if self.pad_page is None:
            raise RuntimeError("decode graphs need the runner's pad page (ModelRunner(..., pad_page=True))")
        self.graphs = DecodeGraphs(self, max_batch, max_pages_per_seq, progress=progress, capture=capture)
        self._report(self.graphs, progress)

    def capture_step_graphs(self, max_tokens: int, max_batch: int, max_pages_per_seq: int,
                            progress: bool = True, capture: bool = True) -> None:
        """Capture loaded and chunk-only steps (fused forward) per token-count bucket up to max_tokens (needs the
        pad page and a backend whose prefill reads only device tensors of fixed shape)."""
        self.step_graphs = StepGraphs(self, max_tokens, max_batch, max_pages_per_seq, progress=progress,
                                      capture=capture)
        self._report(self.step_graphs, progress)

    @staticmethod
    def _report(graphs, progress: bool) -> None:
        if progress:
            print(f"stepgate: {graphs.describe()}", file=sys.stderr, flush=True)

    @torch.inference_mode()
    def run(self, plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str,
            use_graphs: bool = True) -> StepOutput:
        """use_graphs=False runs a step eagerly even where graphs were captured (graphs on vs off in one process,
        for the gates and the step benchmarks)."""
        return self.launch(plan, pages_of, forward_mode, use_graphs).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str,
               use_graphs: bool = True) -> "Sampled | StepOutput":
        """Queue the step on the device and return its sampled rows, read back by `.result()`."""
        return self.sample_async(self.logits(plan, pages_of, forward_mode, use_graphs))

    def logits(self, plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str,
               use_graphs: bool = True) -> torch.Tensor:
        """The step's sampled rows' logits (a captured step's: a view of the static logits, sampled before the next
        replay)."""
        hit = any(r.cached_prefix for r in plan.admitted)
        if use_graphs and self.graphs is not None and not plan.chunks and self.graphs.fits(len(plan.decodes)):
            # a pure decode step is the same in both forward modes: replay the captured one
            logits = self.graphs.replay(plan.decodes, pages_of)
            self.count(plan.chunks, plan.decodes, forward_mode, self.graphs, prefix_hit=hit)
            return logits
        if use_graphs and self.step_graphs is not None and plan.chunks and forward_mode == "fused":
            logits = self.step_graphs.replay(plan.chunks, plan.decodes, pages_of)
            if logits is not None:
                self.count(plan.chunks, plan.decodes, forward_mode, self.step_graphs, prefix_hit=hit)
                return logits
        self.count(plan.chunks, plan.decodes, forward_mode, None, prefix_hit=hit)
        if forward_mode == "fused":
            return self.forward(plan.chunks, plan.decodes, pages_of)
        # chunked: prompt chunks, then the decode batch, as two forwards
        parts = []
        if plan.chunks:
            parts.append(self.forward(plan.chunks, [], pages_of))
        if plan.decodes:
            parts.append(self.forward([], plan.decodes, pages_of))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @torch.inference_mode()
    def launch_ahead(self, step: Foresight, pages_of: dict[str, list[int]], source: "Sampled",
                     forward_mode: str) -> "Sampled | None":
        """Queue the foreseen step behind the step in flight, whose sampled rows (`source`) are not read back yet:
        each decode row's input token is taken on the device from source.tokens[row.source]. The host packs this
        step while the device still runs the one before, so the device need not wait for the host. Only a captured
        step can take its tokens from the device: None (nothing launched) where the step would run eagerly."""
        if not step.chunks:
            if self.graphs is None or not self.graphs.fits(len(step.rows)):
                return None
            logits = self.graphs.replay(step.rows, pages_of, source.tokens)
            self.count(step.chunks, step.rows, forward_mode, self.graphs, ahead=True)
            return self.sample_async(logits)
        sg = self.step_graphs
        if sg is None or forward_mode != "fused" or sg.bucket_for(step.chunks, step.rows) is None:
            return None
        # a chunk-only step after one that sampled nothing (a prompt's earlier chunks) takes no token from it
        logits = sg.replay(step.chunks, step.rows, pages_of, source.tokens if step.rows else None)
        self.count(step.chunks, step.rows, forward_mode, sg, ahead=True)
        return self.sample_async(logits)

    def count(self, chunks, decodes, forward_mode: str, graphs, ahead: bool = False, prefix_hit: bool = False):
        """One step in the path census (engine/census.py): `graphs`, the captured steps it replayed (None: eager)."""
        if graphs is None:
            mode, bucket = "eager", "-"
        else:
            mode = "captured" if graphs.capture_graphs else "uncaptured"
            bucket = "x".join(map(str, graphs.last_key))
        self.census[StepPath(step_kind(bool(chunks), bool(decodes)),
                             kernel_paths(self.backend, bool(chunks), bool(decodes), forward_mode), mode, bucket,
                             ahead, prefix_hit)] += 1

    def path_census(self) -> list[dict]:
        """The census as rows (StepPath.row), most taken first."""
        return [path.row(n) for path, n in self.census.most_common()]

    def sample(self, logits: torch.Tensor) -> StepOutput:
        """Greedy, read back now."""
        return self.sample_async(logits).result()

    def sample_async(self, logits: torch.Tensor) -> "Sampled | StepOutput":
        """Greedy, on the device; the host copy starts at once (one per sampled quantity): `.result()` reads it."""
        if logits.shape[0] == 0:
            return StepOutput([])
        tokens = logits.argmax(-1)
        nonfinite = ~torch.isfinite(logits).all(-1) if self.poison else None
        topk = logits.topk(self.record_topk, dim=-1) if self.record_topk else None
        return Sampled(tokens, nonfinite, topk)

    @torch.inference_mode()
    def score(self, chunk: Chunk, pages: list[int], last_only: bool = False) -> torch.Tensor:
        """Teacher forcing: logits at every position of one whole sequence (or at its last position only: a long
        sequence's every logit would not fit), in one forward (fp32, on the host)."""
        return self.forward([chunk], [], {chunk.request.request_id: pages}, all_logits=not last_only).cpu()

    def perturb_page(self, page: int, scale: float = 1.0, seed: int = 0) -> None:
        """Add noise to one page's K and V in every layer (the small model's history-dependence probe)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        for k, v in self.kv_caches:
            for t in (k, v):
                t[page] += (torch.randn(t[page].shape, generator=g) * scale).to(t.device, t.dtype)


def compiles_elementwise(config: "EngineConfig") -> bool:
    """Whether a runner of `config` runs torch.compile'd elementwise pieces: where the configuration asks, and by
    default on CUDA."""
    return bool(config.compile_elementwise or (config.compile_elementwise is None
                                               and torch.device(config.device).type == "cuda"))


def elementwise_sizes(config: "EngineConfig", backend) -> dict:
    """try_compile_elementwise's sizes for a runner of `config` over `backend`: the most tokens a step carries (the
    compile is made at that count: Inductor sizes its kernels' launches from the first call's), and
    whether a step ever rotates without writing the cache (its decode kernel appends K/V but does not rotate: the
    rotary piece alone). build_runner's, and the gate prewarm's (gates/prewarm.py), which compiles the same pieces
    ahead into the shared compile cache."""
    return dict(tokens=config.chunk_tokens + config.max_batch,
                rotary=backend.appends_decode_kv and not backend.rotates_decode)


def build_runner(model, config: "EngineConfig", dtype, num_pages: int, max_kv: int, table_width: int,
                 graphs: bool = False, runner_cls=ModelRunner, **runner_kw) -> ModelRunner:
    """A runner ready to serve: fused elementwise pieces, the runner over `num_pages` pages, the backend's warm-up
    and, with `graphs` (the engine decides: Engine.use_cuda_graphs), the captured steps. Every tensor-parallel rank
    builds its own this way (`model`: its shard)."""
    s = model.shape
    on_cuda = torch.device(config.device).type == "cuda"
    cost: dict[str, float] = {}         # where the build's time goes (engine/build_cost.py)
    runner = runner_cls(model, num_pages, config.page_size, config.backend, config.device, dtype,
                        poison=config.poison, record_topk=config.record_topk, pad_page=graphs,
                        backend_options=config.backend_options(), **runner_kw)
    compiled = False
    if compiles_elementwise(config):
        from .layer_kernels import try_compile_elementwise
        # after the runner, whose backend decides the rotary piece (elementwise_sizes)
        with timed(cost, "compile_s"):
            runner.ops, why = try_compile_elementwise(config.device, dtype, model,
                                                      **elementwise_sizes(config, runner.backend))
        if why:
            warnings.warn(f"torch.compile of the elementwise pieces failed; running them eagerly ({why})")
        compiled = not why
    runner.compiled_elementwise = compiled      # what this build did, for the gates to hold against Engine.served
    runner.build_cost = cost
    warm = config.compile_warmup if config.compile_warmup is not None else runner.device.type == "cuda"
    # before the warm-ups: they compile the kernels as the steps will launch them
    runner.pdl = runner.backend.pdl = config.resolved_pdl()
    if config.resolved_layer_kernel("mlp_kernel") == "triton":
        from kernels.mlp import FUSED_ROWS
        runner.mlp_rows = FUSED_ROWS
        if warm:     # its two row tilings compiled now, so that no step or capture compiles
            with timed(cost, "warmup_s"):
                warm_mlp(model, runner.device, dtype, runner.pdl)
    if config.resolved_layer_kernel("linear_kernel") == "triton":
        from kernels.linear import SKINNY_ROWS
        runner.linear_rows = SKINNY_ROWS
        with timed(cost, "warmup_s"):      # warm or not: a captured step needs the workspace made first
            warm_linear(model, runner.device, dtype, runner.pdl)
    if warm and hasattr(runner.backend, "warmup"):
        # compile every shape a step can reach now, so that no measured step includes a compile
        with timed(cost, "warmup_s"):
            runner.backend.warmup(s.num_heads, s.num_kv_heads, s.head_dim, dtype, config.device, max_kv=max_kv,
                                  max_prefill_tokens=config.chunk_tokens, max_rows=config.max_batch,
                                  page_size=config.page_size)
    if graphs:   # after the backend's warm-up: a capture must not include a compile
        # off CUDA nothing can be captured: the captured steps' path (static buffers, steps launched ahead) runs
        # uncaptured, for a backend whose kernels allow it (engine.config.graphs_problem)
        capture = config.capture_graphs and on_cuda
        runner.capture_decode_graphs(config.max_batch, table_width, progress=config.progress, capture=capture)
        static_prefill = runner.backend.graph_safe_prefill or (not on_cuda and runner.backend.static_steps)
        if config.forward == "fused" and config.tp == 1 and static_prefill:
            # a step's prompt positions are at most chunk_tokens, beside at most max_batch decode tokens
            runner.capture_step_graphs(config.chunk_tokens + config.max_batch, config.max_batch, table_width,
                                       progress=config.progress, capture=capture)
        add_graph_sets(cost, [runner.graphs, runner.step_graphs])
    return runner
