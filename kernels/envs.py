"""The process settings read from the environment, each with its doc and default: the one module under engine/ and
kernels/ that reads `os.environ` (like vLLM's `vllm/envs.py`).

Nothing here changes what an engine computes: a knob that does (a kernel, a split, a path) is an `EngineConfig`
field, recorded in goldens, the gate summary and benchmark rows. What stays here is where files go, how the process
is set up, and test seams. It lives in kernels/, the bottom layer, so that every layer above can read it."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    default: str
    doc: str


VARIABLES = {v.name: v for v in (
    Var("STEPGATE_COMPILE_CACHE", "", "folder for torch's and Triton's compile caches, kept across processes "
                                      "(kernels/compile_cache.py); empty: their own defaults"),
    Var("STEPGATE_FLASH_ATTN_PATH", "", "folders put first on sys.path before flash-attn is imported, separated by "
                                        "os.pathsep (a flash-attn built rather than installed)"),
    Var("STEPGATE_FLEX_CPU", "1", "0: the flex backend refuses CPUs (a test seam: its per-shape compiles take minutes "
                                  "there)"),
    Var("CXX", "", "the C++ compiler Inductor's CPU code is built with (the flex backend on CPU needs one)"),
    Var("STEPGATE_TP_START", "forkserver", "multiprocessing start method of the tensor-parallel worker ranks"),
    Var("STEPGATE_THREADS", "1", "torch's intra-op threads in the gate and test processes"),
    Var("STEPGATE_KV_BYTES", "", "the gate run's KV budget per engine on CUDA (bytes, or with a KiB/MiB/GiB "
                                 "suffix); empty: split between the xdist workers that share a GPU"),
    Var("STEPGATE_PROFILE_DIR", "", "each process of a gate run writes a cProfile of itself here"),
    Var("STEPGATE_BENCH_ROUNDS", "", "rounds of each step-timing benchmark (empty: the benchmark's own)"),
    Var("STEPGATE_PLANT_SLOWDOWN_MS", "", "test seam: milliseconds of sleep planted in every timed step, to show a "
                                          "benchmark alert firing"),
)}


def get(name: str) -> str:
    """The variable's value, or its default where unset or empty."""
    return os.environ.get(name) or VARIABLES[name].default


def set_process(name: str, value: str) -> None:
    """Set a variable that a library reads (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR): the one place this project
    writes the environment."""
    os.environ[name] = value


def describe() -> str:
    """Every variable, its default and doc, one per line (README and `python -m kernels.envs`)."""
    return "\n".join(f"{v.name} (default {v.default!r}): {v.doc}" for v in VARIABLES.values())


if __name__ == "__main__":
    print(describe())
