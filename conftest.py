"""pytest options and markers for the gates and the tests.

Options (all have defaults that run on a CPU-only machine with the embedded small model):
  --device cpu|cuda   --dtype float32|float16|bfloat16   --backend torch|flex|flash|all
  --engine chunked|fused|flash|all   --golden-dir DIR   --tie-threshold 0.02   --flip-cap N
  --regen-golden      write goldens (atomically) instead of checking them, and print what moved
  --model small|qwen2.5-1.5b-random|PATH
  --tp N              the engine runs tensor parallel over N ranks (gloo on CPU, NCCL on CUDA); goldens stay tp 1
"""
from __future__ import annotations

import os


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    # The small model's steps are far too small to gain from intra-op threads, and on a shared 2-core runner
    # they lose badly to oversubscription (seen: 5-20 ms a step with 1 thread, 700-1000 ms with 2 under load).
    import torch
    torch.set_num_threads(int(os.environ.get("STEPGATE_THREADS", "1")))

try:    # hypothesis profiles: bounded in CI, longer locally with HYPOTHESIS_PROFILE=long
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=40, stateful_step_count=40, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow], derandomize=True)
    settings.register_profile("dev", max_examples=100, stateful_step_count=50, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("long", max_examples=2000, stateful_step_count=100, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
except ImportError:  # pragma: no cover
    pass


def pytest_addoption(parser):
    from gates.compare import TIE_THRESHOLD
    g = parser.getgroup("stepgate")
    g.addoption("--device", default="cpu", help="device the engine runs on (cpu, cuda)")
    g.addoption("--dtype", default=None, help="float32 / float16 / bfloat16 (default: float32 on cpu, float16 on cuda)")
    g.addoption("--backend", default="all", help="attention backend(s) to gate: torch, flex, flash, or all present")
    g.addoption("--engine", default="all", help="engine configuration(s) to gate: chunked, fused, flash, or all")
    g.addoption("--golden-dir", default=None, help="where goldens live (default: golden/ in the repo)")
    g.addoption("--tie-threshold", type=float, default=TIE_THRESHOLD,
                help="raw-logit gap under which a flip is a tie")
    g.addoption("--flip-cap", type=int, default=3, help="most distinct flip sites a gate accepts")
    g.addoption("--regen-golden", action="store_true", help="write goldens instead of checking them")
    g.addoption("--model", default="small", help="small (embedded), qwen2.5-1.5b-random, or a checkpoint dir")
    g.addoption("--tp", type=int, default=1, help="tensor-parallel ranks of the engine under test (goldens: tp 1)")
    g.addoption("--gate-summary", default="gate-summary.json", help="where the JSON gate summary is written")
