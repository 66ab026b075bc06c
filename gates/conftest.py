"""The gates' pytest plumbing: the session fixtures (options, the run cache), the gate order, and the selection of
what runs here. What the gate tests share lives in gates/runs.py."""
from __future__ import annotations

import pytest
import torch

from . import build_cost, prewarm
from .options import GateOptions, gate_options, is_gate_file
from .runs import Runs


@pytest.fixture(scope="session")
def opts(request) -> GateOptions:
    return gate_options(request.config)


@pytest.fixture(scope="session")
def runs(opts) -> Runs:
    return Runs(opts)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    short = getattr(config, "stepgate_short_of_gpus", None)
    if short:
        terminalreporter.write_line(f"stepgate: not run on {torch.cuda.device_count()} GPU(s), deselected: "
                                    f"{', '.join(short)}", yellow=True)
    for line in (*build_cost.report(config), prewarm.report(config)):
        if line:
            terminalreporter.write_line(f"stepgate: {line}")


def pytest_collection_finish(session):
    prewarm.begin(session)


def pytest_sessionfinish(session):
    prewarm.end(session)
    build_cost.finish_worker(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    build_cost.node_down(node)


# Cheap decisive gates first, slow ones last, so that a broken engine fails the run in seconds, not minutes. A file
# not named here keeps its place among them; tests keep their order within a file.
# test_redo.py and test_requests.py right after test_tokens.py: they reuse the mixed workload's undisturbed run.
GATE_ORDER = ["test_smoke.py", "test_kernels.py", "test_mlp.py", "test_linear.py", "test_admission.py", "test_tokens.py", "test_redo.py",
              "test_requests.py", "test_page_safety.py", "test_prefix_cache.py", "test_tp.py", "test_graphs.py", "test_prefill_share.py",
              "test_step_timings.py"]


def gate_order(items) -> list:
    """Items with the gate files in GATE_ORDER's order; any other file keeps its slot. Stable within a file."""
    rank = {name: i for i, name in enumerate(GATE_ORDER)}

    def named(path):
        return path.parent.name == "gates" and path.name in rank
    files = list(dict.fromkeys(item.path for item in items))
    in_order = iter(sorted(filter(named, files), key=lambda path: rank[path.name]))
    slot = {path: i for i, path in enumerate(next(in_order) if named(p) else p for p in files)}
    return sorted(items, key=lambda item: slot[item.path])


def candidate_of(item, o: GateOptions) -> tuple[str, str]:
    """The (engine, backend) a test is parametrised with; a selected one stands in for a missing parameter."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("engine", o.engines[0]), params.get("backend", o.backends[0])


def gpus_needed(item, o: GateOptions) -> int:
    """GPUs a gate needs on CUDA: a tensor-parallel gate's ranks, else one."""
    mark = item.get_closest_marker("tp_ranks")
    if mark is None:
        return 1
    n = mark.args[0] if mark.args else None
    return n if n is not None else max(o.tp, 2)


# gates that run by default on CUDA but only with -m slow on a CPU (see pytest_collection_modifyitems)
CPU_SLOW = ("test_prefill_share.py::test_tokens_and_chunks_identical_across_prefill_share[chunked-torch]",
            # shapes of their own: FlexAttention compiles each
            "test_kernels.py::test_kernel_wide[flex-rows]", "test_kernels.py::test_kernel_wide[flex-keys]",
            "test_kernels.py::test_kernel_wide[flex-items]")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """On CPU the flex engine configuration compiles a FlexAttention kernel per shape (about 2 minutes for the
    engine gates), so there it counts as slow: `pytest gates/ -m slow` runs it. The kernel gates still cover flex
    on CPU in the default run, and on CUDA the flex engine gates run by default. So does the prefill-share identity
    gate on the chunked engine (CPU_SLOW): the share is scheduler bookkeeping, the same for every forward, and the
    fused engine's run covers it within the CPU gate budget."""
    o = gate_options(config)
    if not config.getoption("order_as_given"):
        items[:] = prewarm.order(gate_order(items), prewarm.built_by_prewarm(config, o))
    # deselected, not skipped: a candidate the options leave out was asked to be left out, not hidden
    unselected = {item for item in items if is_gate_file(item.nodeid) and not o.selects(*candidate_of(item, o))}
    if o.is_cuda:
        # a machine with fewer GPUs than a tensor-parallel gate's ranks cannot run it: that is the machine, not a
        # broken install, so the gate is deselected (and said so), not skipped into a failing unrun file
        short = {item for item in items if gpus_needed(item, o) > max(torch.cuda.device_count(), 1)}
        if short:
            config.stepgate_short_of_gpus = sorted({f"{item.path.name} (tp={gpus_needed(item, o)})" for item in short})
        unselected |= short
    if unselected:
        config.hook.pytest_deselected(items=[item for item in items if item in unselected])
        items[:] = [item for item in items if item not in unselected]
    if o.is_cuda:
        return
    for item in items:
        if "fused-flex" in item.nodeid or item.nodeid.endswith(CPU_SLOW):
            item.add_marker(pytest.mark.slow)
