"""pytest setup for the gates and the tests: threads, hypothesis profiles, and the stepgate plugins.

The options (`--device`, `--dtype`, `--backend`, `--engine`, `--model`, `--golden-dir`, `--tie-threshold`,
`--flip-cap`, `--regen-golden`, `--gate-summary`, `--gate-summary-md`, `--allow-skipped-files`, `--tp`) are declared
and checked in gates/options.py; gates/snapshot.py fails a plain run that changes the goldens; gates/summary.py
summarises the gates (JSON, Markdown); gates/workers.py places xdist workers and times out a hung gate.
"""
from __future__ import annotations

import os

pytest_plugins = ["pytester", "gates.workers", "gates.options", "gates.snapshot", "gates.summary"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    # The small model's steps are far too small to gain from intra-op threads, and on a shared 2-core runner
    # they lose badly to oversubscription (seen: 5-20 ms a step with 1 thread, 700-1000 ms with 2 under load).
    import torch
    torch.set_num_threads(int(os.environ.get("STEPGATE_THREADS", "1")))
    # STEPGATE_COMPILE_CACHE=DIR: every compile of the session (flex, the elementwise pieces) uses a kept folder
    from kernels.compile_cache import use_compile_cache
    use_compile_cache()

try:    # hypothesis profiles: bounded and seeded in CI (.ci/run sets CI=1), longer locally with HYPOTHESIS_PROFILE=long
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
