"""Engine configuration, and the engine lineage as named configurations of one engine (not copies of it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

FORWARD_MODES = ("chunked", "fused")


@dataclass(frozen=True)
class EngineConfig:
    forward: str = "fused"          # "chunked": two forwards per loaded step; "fused": one
    backend: str = "torch"          # attention backend (kernels/)
    page_size: int = 64
    max_batch: int = 32
    chunk_tokens: int = 512
    num_pages: int | None = None    # the pool's pages (null page included); None: from kv_cache_bytes
    kv_cache_bytes: int | None = None   # None: 256 MiB on CPU, 16 GiB on CUDA
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
    tp: int = 1                          # tensor-parallel ranks, one process (and one GPU) each (engine/parallel.py)
    tp_timeout: float = 60.0             # seconds a step waits for a worker rank before the run fails naming it
    prefix_cache: bool = True            # share full prompt/decode pages across requests (engine/prefix_cache.py)

    def __post_init__(self):
        if self.forward not in FORWARD_MODES:
            raise ValueError(f"forward must be one of {FORWARD_MODES}, got {self.forward!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {self.tp!r}")
        if not self.tp_timeout > 0:
            raise ValueError(f"tp_timeout must be > 0 seconds, got {self.tp_timeout!r}")

    def with_(self, **kw) -> "EngineConfig":
        return replace(self, **kw)

    def describe(self) -> dict:
        return asdict(self)


# The lineage: each generation is a golden reference for the next. `hf` is transformers itself (gates/reference.py).
LINEAGE = {
    "chunked": dict(forward="chunked", backend="torch", page_size=64),
    "fused": dict(forward="fused", backend="torch", page_size=64),
    "flash": dict(forward="fused", backend="flash", page_size=256),
}
PREDECESSOR = {"fused": "chunked", "flash": "fused"}


def lineage_config(name: str, **kw) -> EngineConfig:
    try:
        base = LINEAGE[name]
    except KeyError:
        raise KeyError(f"unknown engine configuration {name!r}; known: {sorted(LINEAGE)}") from None
    return EngineConfig(**{**base, **kw})
