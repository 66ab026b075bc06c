"""The path census: which execution paths a run's steps took, counted per step by the model runner. A path is the step
kind, the kernel paths its attention calls ran (kernels.base.KernelPath: backend, prefill or decode, kernel, the
fused append), whether it replayed a captured step (and at which rows and table width), ran the captured steps'
path uncaptured, or ran eagerly, whether it was launched ahead, and whether it admitted a request with a prefix hit.
The gates compare the kernel paths taken with those the kernel gate checked (gates/coverage.py)."""
from __future__ import annotations

from typing import NamedTuple


class StepPath(NamedTuple):
    kind: str                   # pure-decode, loaded, chunk-only (engine.scheduler.StepKind's values)
    kernels: tuple[str, ...]    # KernelPath names, prefill first
    mode: str                   # captured, uncaptured (the captured steps' path run eagerly), eager
    bucket: str                 # a captured step's key: rows x table width (decode), tokens x width (loaded); "-"
    ahead: bool                 # launched before the step before it was read back
    prefix_hit: bool            # the step admitted a request whose prompt began with cached pages

    def row(self, count: int) -> dict:
        return {**self._asdict(), "kernels": list(self.kernels), "steps": count}


def step_kind(chunks: bool, decodes: bool) -> str:
    return "loaded" if chunks and decodes else ("chunk-only" if chunks else "pure-decode")


def kernel_paths(backend, chunks: bool, decodes: bool, forward_mode: str) -> tuple[str, ...]:
    """The kernel paths of one step's attention calls. A decode call appends its rows' keys and values itself only
    in a forward without prompt chunks: a pure decode step, or the chunked forward's second forward."""
    out = []
    if chunks:
        out.append(backend.path("prefill").name)
    if decodes:
        alone = not chunks or forward_mode == "chunked"
        out.append(backend.path("decode", append=bool(backend.appends_decode_kv and alone)).name)
    return tuple(out)


def merge(into: dict, rows: list[dict]) -> None:
    """Add census rows (StepPath.row) into `into`, keyed by the path: a run's engines summed."""
    for r in rows:
        key = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in r.items() if k != "steps")
        into[key] = into.get(key, 0) + r["steps"]


__all__ = ["StepPath", "kernel_paths", "merge", "step_kind"]
