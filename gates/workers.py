"""The gates over pytest-xdist workers, a pytest plugin: which GPU each worker gates on and how much KV cache its
engines may take, the gates that need their device(s) to themselves (marked `serial`), and a timeout on every gate.

`pytest gates/ -n 4 --device cuda`: on a machine of several GPUs the controller gives worker k the GPU k mod GPUs as
its only visible one (CUDA_VISIBLE_DEVICES, set in the worker before any CUDA call); workers that share a GPU split
the engine's CUDA KV budget between them, so that their pools fit together. STEPGATE_KV_BYTES sets the budget of
every engine the gates build instead (bytes, or with a KiB/MiB/GiB suffix). Gates marked `serial` (step timings:
pytest-benchmark turns itself off under xdist, and a shared device makes them noise; tensor parallel: it spans GPUs
other workers own) are deselected under xdist: `pytest gates/ -m serial` runs them."""
from __future__ import annotations

import os
import threading
from dataclasses import asdict

import pytest

from .placement import (KV_ENV, PLACEMENT_KEY, SERIAL_KEY, Placement, _SERIAL, dist_asked, gib,  # noqa: F401
                        gpu_ids, kv_bytes_from, placement, placement_of, serial_command, serial_note,
                        worker_group, xdist_workers)

WORKERS_PER_GPU = 4         # `-n auto` on CUDA: the suite is bound by host work (compiling, packing) more than the GPU
# a gate that runs longer than this has hung (a kernel that never returns): it fails with every thread's stack.
# --timeout N (or PYTEST_TIMEOUT, or the ini's timeout) sets every gate's; @pytest.mark.timeout(N) one gate's.
GATE_TIMEOUT_S = {"cuda": 600, "cpu": 1800}



# -- the plugin's hooks --------------------------------------------------------------------------------------------
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` with --device cuda: WORKERS_PER_GPU per GPU (capped by the cores); on CPU, xdist's own count."""
    if not str(config.getoption("--device")).startswith("cuda"):
        return None
    from .options import cuda_devices
    return max(1, min(os.cpu_count() or 1, WORKERS_PER_GPU * max(1, cuda_devices())))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "serial: needs its device(s) to itself (step timings, tensor parallel): "
                            "deselected under xdist; run with pytest gates/ -m serial")
    worker = getattr(config, "workerinput", None)
    start_profile(config, worker["workerid"] if worker else "controller")
    if worker is None:
        return
    share = share_compile_threads(int(worker["workercount"]))
    share_intra_op_threads(int(worker["workercount"]))
    import sys
    if "torch._inductor.config" in sys.modules:     # it reads the variable at its import: set the live value too
        sys.modules["torch._inductor.config"].compile_threads = share
    sent = worker.get(PLACEMENT_KEY)
    if sent and sent["visible"] is not None:
        see_only(sent["visible"])


PROFILE_ENV = "STEPGATE_PROFILE_DIR"
_PROFILE = pytest.StashKey[tuple]()


def start_profile(config, name: str) -> None:
    """STEPGATE_PROFILE_DIR=DIR: each process of the run (every xdist worker, the controller or a plain run) profiles
    itself with cProfile from its configure to its end and writes DIR/<name>.prof (gw0.prof, ...; `python -m pstats`
    reads it): where a worker's start-up and first gate spend their time under `-n`."""
    where = os.environ.get(PROFILE_ENV)
    if not where:
        return
    import cProfile
    profile = cProfile.Profile()
    config.stash[_PROFILE] = (profile, os.path.join(where, f"{name}.prof"))
    profile.enable()


def pytest_unconfigure(config):
    profile, path = config.stash.get(_PROFILE, (None, None))
    if profile is not None:
        profile.disable()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        profile.dump_stats(path)


def share_compile_threads(workers: int, env=os.environ) -> int:
    """Give this worker its share of the host's cores for inductor's compile processes, started when they are
    needed. By default every process that compiles starts a pool of one process a core at its first compile, needed
    or not (a warm compile cache needs none): `-n 4` on 16 cores would start 64, each importing torch, while the
    workers' first gates run. TORCHINDUCTOR_COMPILE_THREADS and TORCH_WARM_POOL set by the user are kept. Returns the
    share in force."""
    env.setdefault("TORCH_WARM_POOL", "0")      # read at the first compile: the pool starts with the first job
    if "TORCHINDUCTOR_COMPILE_THREADS" in env:
        return int(env["TORCHINDUCTOR_COMPILE_THREADS"])
    share = max(1, (os.cpu_count() or 1) // max(1, workers))
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(share)
    return share


def share_intra_op_threads(workers: int, env=os.environ) -> int | None:
    """Give this worker its share of the host's cores for torch's own CPU threads: by default every process takes
    one a core, so `-n 4` on 16 cores runs 64 of them, and an op that spreads over a worker's 16 waits on the other
    workers' (under `-n 4` on the H200 each step of a gate run took 2.6 times its serial time, session 24: not yet
    measured with this share). OMP_NUM_THREADS set by the user is kept (None: nothing changed)."""
    if "OMP_NUM_THREADS" in env:
        return None
    import torch
    share = max(1, (os.cpu_count() or 1) // max(1, workers))
    torch.set_num_threads(share)
    return share


def see_only(gpu: str) -> None:
    """Make `gpu` this worker's only CUDA device. CUDA reads the mask once, at its first call in the process (a
    device count included), so one made earlier, by an import or a conftest, would leave every GPU visible."""
    from .options import cuda_devices
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    if cuda_devices() != 1:
        raise pytest.UsageError(f"CUDA_VISIBLE_DEVICES={gpu} set too late in this xdist worker: it sees "
                                f"{cuda_devices()} GPUs (something called CUDA while pytest loaded its plugins); "
                                f"run without -n, or name one device (--device cuda:0) to share it")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n` without `--dist`: work units by `worker_group`, the longest first by the committed durations of the
    device's gates (`longest_first`; without a durations file, in the gates' own order), each unit's gates in
    the gates' order (a configuration's smoke gate first). A `--dist` on the command line is kept as given.
    (xdist's `--dist loadgroup` cannot do this with pytest 9.2: it renames node ids through an attribute pytest no
    longer reads.)"""
    if dist_asked(config) or config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from .durations import durations_file, longest_first, read_durations
    per_file = config.getoption("--work-units") == "configuration-file"
    seconds = read_durations(durations_file(config.rootpath, config.getoption("--device")))

    class ByConfiguration(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid, per_file)

        ordered = not seconds

        def _assign_work_unit(self, node) -> None:
            # the first assignment comes right after the queue is built from the collection: order it once, here
            # (the workers' collections stay as they are: a unit's gates are sent as indexes into them)
            if not self.ordered:
                self.ordered = True
                queue = dict(self.workqueue)
                self.workqueue.clear()
                self.workqueue.update((u, queue[u]) for u in longest_first(queue, seconds))
            super()._assign_work_unit(node)

        def remove_node(self, node) -> str | None:
            """A worker ended: its unfinished gates go back to the queue, as xdist's own remove_node does, except
            the gate it crashed on (xdist's would queue that one again too: a hung gate would hang every worker
            that replaced the first, and the run would never end)."""
            workload = self.assigned_work.pop(node)
            pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items()
                       if not done]
            if not pending:
                return None
            scope, crashed = pending[0]
            workload[scope][crashed] = True
            self.workqueue.update({s: unit for s, unit in workload.items() if not all(unit.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    config.option.loadscopereorder = False
    return ByConfiguration(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """The controller places each worker as it starts it."""
    from .options import cuda_devices, gate_options
    o = gate_options(node.config)
    worker = int(str(node.workerinput["workerid"]).removeprefix("gw"))
    p = placement(o.device, o.tp, worker, int(node.workerinput["workercount"]), cuda_devices() if o.is_cuda else 0)
    node.workerinput[PLACEMENT_KEY] = asdict(p)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    from .candidates import is_gate_file
    if hasattr(config, "workerinput"):
        serial = [item for item in items if item.get_closest_marker("serial")]
        if serial:
            config.hook.pytest_deselected(items=serial)
            items[:] = [item for item in items if not item.get_closest_marker("serial")]
        config.workeroutput[SERIAL_KEY] = len(serial)
    add_timeouts(config, [item for item in items if is_gate_file(item.nodeid)])





@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Every worker deselects the same serial gates: the controller keeps their count for its reports."""
    n = getattr(node, "workeroutput", {}).get(SERIAL_KEY)
    if n is not None:
        node.config.stash[_SERIAL] = max(n, node.config.stash.get(_SERIAL, 0))


def pytest_terminal_summary(terminalreporter, config):
    note = serial_note(config)
    if note:
        terminalreporter.write_line(f"stepgate: {note}", yellow=True)


def gate_timeout(config) -> tuple[float, str]:
    """(seconds, method) of every gate: pytest-timeout's own setting (--timeout, PYTEST_TIMEOUT, the ini) where
    given, else GATE_TIMEOUT_S for the device; the `thread` method unless another is named, because a kernel that
    never returns holds the main thread where no signal handler runs: the thread dumps every stack and exits."""
    from pytest_timeout import get_env_settings

    from .options import gate_options
    seconds = get_env_settings(config).timeout
    if seconds is None:
        seconds = GATE_TIMEOUT_S["cuda" if gate_options(config).is_cuda else "cpu"]
    method = config.getoption("timeout_method", None) or config.getini("timeout_method") or "thread"
    return seconds, method


def add_timeouts(config, items) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        return
    seconds, method = gate_timeout(config)
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(seconds, method=method))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's thread method, with the stacks where a reader finds them: on stderr (an xdist worker's
    stdout goes nowhere, its stderr reaches the controller's) and in the gate summary (gates/summary.py)."""
    if settings.method != "thread" or not settings.timeout:
        return None
    timer = threading.Timer(settings.timeout, timed_out, (item, settings))
    timer.name = f"stepgate timeout {item.nodeid}"
    timer.daemon = True

    def cancel():
        timer.cancel()
        timer.join()
    item.cancel_timeout = cancel
    timer.start()
    return True


class StackText:
    """What pytest_timeout.dump_stacks writes to, kept as text."""

    def __init__(self):
        self.parts: list[str] = []

    def sep(self, char: str, title: str) -> None:
        self.parts.append(f" {title} ".center(100, char) + "\n")

    def write(self, text: str) -> None:
        self.parts.append(text)


def timed_out(item, settings) -> None:
    """The timer ran out: every thread's stack to stderr and the gate summary, then the process ends (a kernel that
    never returns cannot be interrupted; under xdist the controller reports the crash and goes on)."""
    import pytest_timeout

    from . import summary
    if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
        return
    try:
        out = StackText()
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman:      # pytest holds fd 1 and 2 during a test: give them back, with what the test printed
            capman.suspend_global_capture(item)
            for name, text in zip(("stdout", "stderr"), capman.read_global_capture()):
                if text:
                    out.sep("~", f"Captured {name}")
                    out.write(text)
        pytest_timeout.dump_stacks(out)
        text = (f"+++ Timeout: {item.nodeid} ran past {settings.timeout:g} s (a hung kernel?); every thread's "
                f"stack follows +++\n" + "".join(out.parts))
        os.write(2, text.encode())
        summary.timed_out(item, text)
    finally:
        os._exit(1)


def pytest_report_header(config):
    from .options import gate_options
    o = gate_options(config)
    if config.pluginmanager.hasplugin("timeout"):
        seconds, method = gate_timeout(config)
        lines = [f"stepgate: every gate times out after {seconds:g} s ({method} method: every thread's stack, "
                 f"then the run stops); --timeout N to change it, --timeout 0 for none"]
    else:
        lines = ["stepgate: pytest-timeout is not installed: a hung gate hangs the run (pip install -e '.[test]')"]
    workers = xdist_workers(config)
    if workers:
        from .options import cuda_devices
        gpus = cuda_devices() if o.is_cuda else 0
        plan = [placement(o.device, o.tp, w, workers, gpus) for w in range(workers)]
        devices = sorted({p.device if p.visible is None else f"GPU {p.visible}" for p in plan})
        kv = {p.kv_bytes for p in plan}
        budget = ("the engine's default KV budget" if kv == {None} else
                  "KV budget " + ", ".join(gib(b) for b in sorted(b for b in kv if b)) + " per engine")
        lines.append(f"stepgate: {workers} xdist workers on {', '.join(devices)} ({budget}); gates marked serial "
                     f"are deselected here: run them with {serial_command(config)}")
    elif o.kv_bytes:
        lines.append(f"stepgate: KV budget {gib(o.kv_bytes)} per engine ({KV_ENV})")
    return lines
