"""Where a gate run's processes gate, from the command line and the machine alone (no pytest hooks): each xdist
worker's device and KV budget (its Placement), the work unit a gate belongs to, the serial gates left out. The
plugin that applies it is gates/workers.py; gates/options.py and gates/summary.py read it here, so that the three
form no circle."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

from engine.config import KV_CACHE_BYTES

from .candidates import CANDIDATES

KV_ENV = "STEPGATE_KV_BYTES"
PLACEMENT_KEY = "stepgate_placement"    # workerinput: the worker's Placement, chosen by the controller
SERIAL_KEY = "stepgate_serial"          # workeroutput: the serial gates a worker deselected
UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}

@dataclass(frozen=True)
class Placement:
    device: str                # the device this process gates on, as its gates name it
    visible: str | None        # CUDA_VISIBLE_DEVICES of the worker (its own GPU); None: the controller's
    sharers: int               # processes of this run gating on that device (1: its own)
    kv_bytes: int | None       # the KV budget of every engine the gates build; None: the engine's default
    where: str                 # for the header: how it was chosen


def kv_bytes_from(value: str) -> int:
    """STEPGATE_KV_BYTES: bytes, or a number with a KiB/MiB/GiB (or K/M/G) suffix."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in UNITS:
        raise pytest.UsageError(f"{KV_ENV}={value!r}: not a size (bytes, or a number with KiB, MiB or GiB)")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n < 1 << 20:
        raise pytest.UsageError(f"{KV_ENV}={value!r}: {n} bytes is under 1 MiB, too small for one page of a model")
    return n


def gpu_ids(gpus: int, env=os.environ) -> list[str]:
    """The GPUs the controller sees, as CUDA_VISIBLE_DEVICES names them (its own mask kept: "2,3" stays 2 and 3)."""
    given = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return given[:gpus] if len(given) >= gpus else [str(i) for i in range(gpus)]


def placement(device: str, tp: int, worker: int | None, workers: int, gpus: int, env=os.environ) -> Placement:
    """Where worker `worker` of `workers` gates (None: a run without xdist), given the `--device` asked for and the
    GPUs the controller sees."""
    explicit = kv_bytes_from(env[KV_ENV]) if env.get(KV_ENV) else None
    if worker is None or not device.startswith("cuda"):
        return Placement(device, None, 1, explicit, KV_ENV if explicit else "")
    visible = None
    if device == "cuda" and tp == 1 and gpus > 1:
        index = worker % gpus
        visible = gpu_ids(gpus, env)[index]
        sharers = len(range(index, workers, gpus))
        where = f"worker {worker} of {workers} on GPU {visible} of {gpus}"
    else:       # a named device, one GPU, or tensor parallel from the first GPU: every worker shares
        sharers = workers
        where = f"worker {worker} of {workers} sharing {device}" + (f" (tp {tp})" if tp > 1 else "")
    kv = explicit or (KV_CACHE_BYTES["cuda"] // sharers if sharers > 1 else None)
    return Placement(device, visible, sharers, kv, where)


def placement_of(config, device: str, tp: int) -> Placement:
    """This process's placement: the one its controller sent (an xdist worker), else a plain run's."""
    sent = getattr(config, "workerinput", {}).get(PLACEMENT_KEY)
    return Placement(**sent) if sent else placement(device, tp, None, 0, 0)


def xdist_workers(config) -> int:
    """The workers this run's controller starts (0: no xdist)."""
    try:
        return int(config.getoption("numprocesses") or 0)
    except (ValueError, KeyError):       # pytest-xdist not installed (KeyError: a test's stand-in config)
        return 0


def dist_asked(config) -> bool:
    """Whether the command line names xdist's distribution mode itself (then it is kept as given)."""
    return any(a == "-d" or a.startswith("--dist") for a in config.invocation_params.args)


def serial_command(config) -> str:
    """The command that runs the gates marked serial, under this run's own -m expression."""
    expr = config.getoption("markexpr", "") or ""
    return f"pytest gates/ -m {f'serial and ({expr})' if expr else 'serial'!r} (without -n)"


def gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.4g} MiB"


def worker_group(nodeid: str, per_file: bool = False) -> str:
    """The work unit a gate belongs to under `-n` alone: one engine configuration's gates (its id in the test's
    parameters, as in `test_tiny_pool[chunked-torch-64]`), so that its memoised runs and warm-ups are made once
    per run rather than once per worker that draws one of its gates; the kernel gates by backend and kind; the rest
    by file. `per_file` (--work-units configuration-file): a configuration's gates of one file. From the node id
    alone: the controller sees nothing else of a test."""
    path, _, name = nodeid.partition("::")
    param = name.partition("[")[2].removesuffix("]")
    stem = path.rsplit("/", 1)[-1].removesuffix(".py")
    if stem == "test_kernels":
        return "-".join(["kernels", *param.split("-")[:2]])
    for engine, backend in CANDIDATES:
        if re.search(rf"(^|-){engine}-{backend}(-|$)", param):
            return f"{engine}-{backend}/{stem}" if per_file else f"{engine}-{backend}"
    return stem


_SERIAL = pytest.StashKey[int]()

def serial_note(config) -> str | None:
    """What a run over workers left out, and the command that runs it; None when it left nothing out."""
    n = config.stash.get(_SERIAL, 0)
    if not n:
        return None
    return f"{n} gate(s) marked serial were deselected under xdist: run them with {serial_command(config)}"
