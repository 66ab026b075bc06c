"""Engine configuration, and the engine lineage as named configurations of one engine (not copies of it)."""
from __future__ import annotations

import math
import operator
import re
from dataclasses import asdict, dataclass, replace

from .dtypes import canonical_dtype
from .errors import ConfigError
from .scheduler import CHUNK_TOKENS

FORWARD_MODES = ("chunked", "fused")
KV_CACHE_BYTES = {"cpu": 256 << 20, "cuda": 16 << 30}   # the KV budget by device type where none is given
DEVICE_FORMS = ("cpu", "cuda", "cuda:N")


def cuda_devices() -> int:
    """CUDA devices torch sees."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_problem(device, count: int | None = None) -> str | None:
    """Why `device` cannot serve here (None: it can): not cpu, cuda or cuda:N, no CUDA device, or an index past the
    last. `count`: the CUDA devices to assume (None: those torch sees)."""
    m = re.fullmatch(r"cuda(?::(\d+))?", str(device))
    if str(device) != "cpu" and not m:
        return f"unknown device; known: {', '.join(DEVICE_FORMS)}"
    if m:
        n = cuda_devices() if count is None else count
        if n == 0:
            import torch
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            return f"torch {torch.__version__} ({build}) sees no CUDA device"
        if m.group(1) is not None and int(m.group(1)) >= n:
            return f"torch sees {n} CUDA device(s): cuda:0 to cuda:{n - 1}"
    return None


def choice(name: str, value, known: tuple) -> None:
    if value not in known:
        raise ConfigError(f"{name}={value!r}: must be one of {', '.join(map(repr, known))}")


def integer(name: str, value, least: int, none: str | None = None) -> None:
    """An int (not a bool) >= least; None allowed where `none` says what None means."""
    if value is None and none is not None:
        return
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= least
    except TypeError:
        ok = False
    if not ok:
        also = f" (or None: {none})" if none is not None else ""
        raise ConfigError(f"{name}={value!r}: must be an integer >= {least}{also}")


def flag(name: str, value, none: bool = False) -> None:
    if not (isinstance(value, bool) or none and value is None):
        raise ConfigError(f"{name}={value!r}: must be True or False{' (or None: automatic)' if none else ''}")


def number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r}: must be a real number")


# The layers' Triton kernels: EngineConfig field -> whether None picks the kernel where it can run (CUDA). Each
# field's module (layer_kernel_module) says its KERNELS and why_unavailable(device).
LAYER_KERNELS = {"mlp_kernel": True, "linear_kernel": False}


# EngineConfig.pdl's None: whether a step's Triton kernels are launched with programmatic dependent launch where the
# device can (kernels/pdl.py). Off: on an H100 in session 37 it did not pay (gates.ab, 5 process pairs: the pure
# decode step 1.001x [0.994, 1.015], the loaded step 1.000x; with the split-K projections 1.125x; docs/RESULTS.md
# k29): the captured step's kernels leave about 0.1 ms of gaps between them, and PDL hides a part of those only)
PDL_DEFAULT = False


def layer_kernel_module(name: str):
    import kernels.linear
    import kernels.mlp
    return {"mlp_kernel": kernels.mlp, "linear_kernel": kernels.linear}[name]


@dataclass(frozen=True)
class EngineConfig:
    forward: str = "fused"          # "chunked": two forwards per loaded step; "fused": one
    backend: str = "torch"          # attention backend (kernels/)
    page_size: int = 64
    max_batch: int = 32
    chunk_tokens: int = CHUNK_TOKENS
    num_pages: int | None = None    # the pool's pages (null page included); None: from kv_cache_bytes
    kv_cache_bytes: int | None = None   # None: KV_CACHE_BYTES of the device type
    poison: bool = False            # NaN in every freed or never-written slot; finite-logit check each step
    record_topk: int = 0            # record top-k logits of every emitted token (gates)
    dtype: str = "float32"
    device: str = "cpu"
    sync_trace: bool = False        # synchronise the device around each step for the trace's timings
    prefill_share: float = 1.0      # share p of wall time for long-prompt work while others decode (1: no debt)
    short_prompt_positions: int = 512   # a prompt with at most this many positions left never waits, goes first
    compile_warmup: bool | None = None   # compile the backend's every reachable shape at construction (None: on CUDA)
    max_model_len: int | None = None     # longest prompt + budget served (None: the model's max positions)
    cuda_graphs: bool | None = None      # replay captured pure decode steps (None: on CUDA when the backend allows)
    # False: the graphed steps' same forward (packed buffers, one attention call per layer) runs eagerly, uncaptured;
    # the graph gates compare it with the captured run, so capture is gated apart from the packed attention's numerics
    capture_graphs: bool = True
    compile_elementwise: bool | None = None   # fuse norm / rotary / SiLU with torch.compile (None: on CUDA)
    progress: bool = True                # progress bars for slow construction work (graph capture)
    tp: int = 1                          # tensor-parallel ranks, one process (and one GPU) each (engine/tp/)
    tp_timeout: float = 60.0             # seconds a step waits for a worker rank before the run fails naming it
    trace_limit: int | None = None       # keep the last this many steps in Engine.trace (None: every step)
    prefix_cache: bool = True            # share full prompt/decode pages across requests (engine/prefix_cache.py)
    # launch a step before the step before it is read back, when the scheduler can foresee it (Engine.step); None: on
    # where steps are captured on CUDA at tp 1. Poison mode keeps it on (freed pages are poisoned before the launch)
    overlap: bool | None = None
    # the backend's kernels (kernels/): its decode kernel (None: the backend's default: flash 'triton', flex 'rows',
    # torch 'gather'); flash-attn's split count where it decodes (None: per call); the decode kernel writing a pure
    # decode step's K/V itself (None: where the backend can); flex compiling dynamic lengths (None: on CUDA)
    decode_kernel: str | None = None
    decode_splits: int | None = None
    decode_append: bool | None = None
    flex_dynamic: bool | None = None
    # the MLP's gate/up GEMM and SiLU-mul at a step of at most kernels.mlp.FUSED_ROWS positions: "triton", one fused
    # kernel (kernels/mlp.py: CUDA only); "torch", F.linear and the SiLU-mul piece (None: triton on CUDA)
    mlp_kernel: str | None = None
    # the q/k/v, o and down projections at a step of at most kernels.linear.SKINNY_ROWS positions: "triton", the
    # split-K kernel of kernels/linear.py (CUDA only); "torch", F.linear (None: torch; the kernel made the H200's
    # pure decode step 1.071x slower in session 36)
    linear_kernel: str | None = None
    # programmatic dependent launch of a step's Triton kernels (decode, MLP, split-K projections: kernels/pdl.py,
    # CUDA sm_90 and later): each starts while the kernel before it ends and waits for it before reading its output
    # (None: PDL_DEFAULT where the device can: off, as measured)
    pdl: bool | None = None

    def __post_init__(self):
        """Every field checked when the config is made: a ConfigError names the field and the value. What needs the
        model (a pool that holds one longest request) is checked when the Engine is built."""
        choice("forward", self.forward, FORWARD_MODES)
        from kernels import BACKENDS
        choice("backend", self.backend, tuple(BACKENDS))
        for name in ("page_size", "max_batch", "chunk_tokens", "tp"):
            integer(name, getattr(self, name), 1)
        integer("num_pages", self.num_pages, 2, none="the pool's pages from kv_cache_bytes")
        integer("kv_cache_bytes", self.kv_cache_bytes, 1, none="256 MiB on CPU, 16 GiB on CUDA")
        integer("max_model_len", self.max_model_len, 1, none="the model's max positions")
        integer("record_topk", self.record_topk, 0)
        integer("short_prompt_positions", self.short_prompt_positions, 0)
        integer("trace_limit", self.trace_limit, 1, none="every step kept")
        for name in ("poison", "sync_trace", "progress", "prefix_cache", "capture_graphs"):
            flag(name, getattr(self, name))
        for name in ("compile_warmup", "cuda_graphs", "compile_elementwise", "overlap", "decode_append",
                     "flex_dynamic", "pdl"):
            flag(name, getattr(self, name), none=True)
        integer("decode_splits", self.decode_splits, 0, none="per call, from the table's width and the rows")
        if self.decode_kernel is not None and not isinstance(self.decode_kernel, str):
            raise ConfigError(f"decode_kernel={self.decode_kernel!r}: must be a kernel's name (or None: the "
                              f"backend's default)")
        try:
            self.backend_options()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.check_layer_kernels()
        if self.pdl and device_problem(self.device) is None and (why := pdl_problem(self.device)):
            raise ConfigError(f"pdl=True on {self.device}: {why}")
        try:
            canonical_dtype(self.dtype)
        except ValueError as e:
            raise ConfigError(f"dtype={self.dtype!r}: {e}") from None
        problem = device_problem(self.device)
        if problem:
            raise ConfigError(f"device={self.device!r}: {problem}")
        # outside [0.01, 1] (or NaN) it falls back to 1 (docs/DESIGN.md, "Prefill share"); a non-number is a mistake
        number("prefill_share", self.prefill_share)
        number("tp_timeout", self.tp_timeout)
        if not 0 < self.tp_timeout < math.inf:
            raise ConfigError(f"tp_timeout={self.tp_timeout!r}: must be a finite number of seconds > 0")

    def check_layer_kernels(self) -> None:
        for name in LAYER_KERNELS:
            value = getattr(self, name)
            if value is None:
                continue
            module = layer_kernel_module(name)
            choice(name, value, module.KERNELS)
            why = module.why_unavailable(self.device) if value == "triton" else None
            if why and device_problem(self.device) is None:
                raise ConfigError(f"{name}={value!r} on {self.device}: {why}")

    def resolved_layer_kernel(self, name: str) -> str:
        """A layer kernel field (LAYER_KERNELS) with None decided: its Triton kernel where it can run (CUDA) and it
        is the default, else torch's."""
        value = getattr(self, name)
        if value is not None:
            return value
        triton = LAYER_KERNELS[name] and layer_kernel_module(name).why_unavailable(self.device) is None
        return "triton" if triton else "torch"

    def resolved_pdl(self) -> bool:
        """pdl with None decided: PDL_DEFAULT where the device can launch with it."""
        if self.pdl is not None:
            return self.pdl
        return PDL_DEFAULT and pdl_problem(self.device) is None

    def with_(self, **kw) -> "EngineConfig":
        return replace(self, **kw)

    def backend_options(self) -> dict:
        """The backend's kernel choices, every None decided (kernels.AttentionBackend.options)."""
        from kernels import backend_class
        return backend_class(self.backend).options(self.decode_kernel, self.decode_splits, self.decode_append,
                                                   self.flex_dynamic, device_type=device_type(self.device))

    def resolved(self, graphs: bool | None = None, overlap: bool | None = None) -> "EngineConfig":
        """This configuration with every None that picks what runs decided for its device: the kernels, captured
        steps, overlap, the compiled elementwise pieces and warm-up (the pool's size and max_model_len need the
        model: Engine.served). `graphs`, `overlap`: as an engine decided them (None: decide here)."""
        on_cuda = device_type(self.device) == "cuda"
        if graphs is None:
            graphs = graphs_problem(self) is None and self.cuda_graphs is not False
        if overlap is None:
            overlap = self.overlap if self.overlap is not None else (
                graphs and self.capture_graphs and on_cuda and self.tp == 1)
        opts = self.backend_options()
        return replace(self, cuda_graphs=graphs, overlap=bool(overlap), capture_graphs=graphs and self.capture_graphs and on_cuda,
                       compile_elementwise=on_cuda if self.compile_elementwise is None else self.compile_elementwise,
                       compile_warmup=on_cuda if self.compile_warmup is None else self.compile_warmup,
                       decode_kernel=opts["decode_kernel"], decode_splits=opts["decode_splits"],
                       decode_append=opts["decode_append"], flex_dynamic=opts["dynamic"],
                       pdl=self.resolved_pdl(),
                       **{name: self.resolved_layer_kernel(name) for name in LAYER_KERNELS})

    def describe(self) -> dict:
        """Every field, as given (None where undecided): `resolved().describe()` says what runs."""
        return asdict(self)

    def key(self) -> str:
        """A resolved configuration's choices that pick what runs, in one short line for a benchmark row:
        forward/backend/page size/decode kernel(+append)/captured or eager/overlap/prefix cache/chunk/rows/tp (then
        the prefill share where not 1, mlp-triton where the MLP's fused kernel runs, linear-triton where the
        projections' split-K kernel does, pdl where the Triton kernels launch with programmatic dependent launch)."""
        c = self
        kernel = f"{c.decode_kernel}{'+append' if c.decode_append else ''}"
        if c.decode_splits is not None:
            kernel += f"/splits{c.decode_splits}"
        return "/".join([c.forward, c.backend, f"p{c.page_size}", kernel,
                         "graphs" if c.cuda_graphs else "eager", "overlap" if c.overlap else "serial",
                         "prefix" if c.prefix_cache else "noprefix", f"chunk{c.chunk_tokens}", f"rows{c.max_batch}",
                         f"tp{c.tp}"] + ([f"share{c.prefill_share:g}"] if c.prefill_share != 1.0 else [])
                        + [f"{name.removesuffix('_kernel')}-triton" for name in LAYER_KERNELS
                           if getattr(c, name, None) == "triton"] + (["pdl"] if c.pdl else []))


# Fields that say how a run is observed or sized, not what it computes: two configurations that differ only in
# these serve the same tokens at the same steps (pool sizes are checked by the gates' own workloads).
# The device and dtype are in a golden's name already (a gate run may say cuda:1 for cuda).
OBSERVING_FIELDS = ("poison", "record_topk", "sync_trace", "progress", "trace_limit", "tp_timeout", "num_pages",
                    "kv_cache_bytes", "max_model_len", "compile_warmup", "device", "dtype")


def config_differences(recorded: dict, current: dict) -> list[str]:
    """'field: recorded -> current' for each field that picks what runs and differs. A field the record lacks
    (written before it existed) is not a difference; nor, in a record made before configurations were resolved (it
    has no decode_kernel), is a None: it meant the default of its day, which the record does not say."""
    resolved = "decode_kernel" in recorded
    return [f"{k}: {recorded[k]!r} -> {current[k]!r}" for k in sorted(current)
            if k not in OBSERVING_FIELDS and k in recorded and recorded[k] != current[k]
            and (resolved or recorded[k] is not None)]


def pdl_problem(device) -> str | None:
    """Why a step's Triton kernels cannot launch with programmatic dependent launch on `device` (None: they can)."""
    from kernels.pdl import why_unavailable
    return why_unavailable(device)


def device_type(device) -> str:
    return str(device).split(":")[0]


def graphs_problem(config) -> str | None:
    """Why this configuration cannot run captured steps (None: it can). On a CPU nothing is captured, but a
    backend whose kernels are correct over the captured steps' static buffers (`static_steps`: the torch one) runs
    that path uncaptured when asked (cuda_graphs=True), so the CPU gates reach steps launched ahead too."""
    from kernels import backend_class
    cls = backend_class(config.backend)
    if device_type(config.device) != "cuda":
        if config.cuda_graphs and getattr(cls, "static_steps", False):
            return None
        return "CUDA graphs need a CUDA device" + (
            "" if getattr(cls, "static_steps", False) else f" (the {config.backend!r} backend's kernels do not run "
                                                           f"the captured steps' static buffers on a CPU)")
    if config.tp > 1 and config.cuda_graphs is None:
        # the one two-GPU run of captured steps at tp 2 (2026-12-01, docs/RESULTS.md) built its graphs, then stopped
        # answering mid-benchmark: eager unless asked for (cuda_graphs=True), until a two-GPU run shows them safe
        return ("captured steps at tp > 1 are off unless asked for (cuda_graphs=True): on two H200s a tp 2 engine "
                "with them built and then hung (docs/RESULTS.md)")
    if not cls.graph_safe_decode:
        return (f"the {config.backend!r} backend's decode is not graph-safe (its per-step tensors change shape); the "
                f"'flash' backend's is")
    return None


# The lineage: each generation is a golden reference for the next. `hf` is transformers itself (gates/reference.py).
# The reference generations run their layers in plain PyTorch on every device: no Inductor-compiled elementwise piece
# and no Triton MLP kernel, so they share none of those kernels with the flash engine they check (a bug there shows
# as flash against its references), and a gate process or worker that runs only them compiles nothing (under -n 4
# the workers' summed compile fell from 40.7 to 13.4 s on an H100; their host-bound steps on the small model ran 0-13%
# faster: docs/RESULTS.md, session 40). Their attention is their backend's.
REFERENCE_LAYERS = dict(compile_elementwise=False, mlp_kernel="torch")
LINEAGE = {
    "chunked": dict(forward="chunked", backend="torch", page_size=64, **REFERENCE_LAYERS),
    "fused": dict(forward="fused", backend="torch", page_size=64, **REFERENCE_LAYERS),
    "flash": dict(forward="fused", backend="flash", page_size=256),
}
PREDECESSOR = {"fused": "chunked", "flash": "fused"}


def lineage_layers(name: str) -> dict:
    """The layer kernel fields (REFERENCE_LAYERS' names) that configuration `name` sets: a state or probe that builds
    its engine over another configuration's backend runs this one's layers."""
    return {k: v for k, v in LINEAGE[name].items() if k in REFERENCE_LAYERS}


def lineage_config(name: str, **kw) -> EngineConfig:
    try:
        base = LINEAGE[name]
    except KeyError:
        raise KeyError(f"unknown engine configuration {name!r}; known: {sorted(LINEAGE)}") from None
    return EngineConfig(**{**base, **kw})
