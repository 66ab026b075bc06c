"""A tensor-parallel worker process (ranks 1..tp-1): it builds its rank as rank 0 builds its own, then runs rank 0's
calls (engine/tp/runner.py) until told to stop. Whatever fails in it is sent to rank 0 before the process exits."""
from __future__ import annotations

from typing import TYPE_CHECKING

import datetime
import io
import os
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import layers as tp_layers
from ..model import ModelShape
from ..request import Request
from ..scheduler import Chunk
from .shard import STARTUP_TIMEOUT_S, Group, PlanReceiver, ShardRunner, kv_page_problems

if TYPE_CHECKING:      # a value the facade hands down, not an import of it
    from ..config import EngineConfig


@dataclass
class WorkerSpec:
    """What a worker needs to build its rank (picklable)."""
    config: EngineConfig      # with the worker's own device
    tp: int
    shape: ModelShape
    source: object            # a model load_model() can name (loaded by the worker), or None: see `state`
    state: bytes | None       # the rank's shard (torch.save) when the caller's model has no name to load by
    num_pages: int
    max_kv: int
    table_width: int
    threads: int
    port: int
    setup: object = None


def dump_stacks_on_usr1() -> None:
    """SIGUSR1 prints every thread's stack and the worker goes on: where a hung rank waits (`timeout -s USR1` signals
    the whole process group, rank 0 and its workers alike)."""
    import faulthandler
    import signal
    import sys
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:
        # the process's own stderr: a captured sys.stderr (pytest's) has no file descriptor to write to
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def _watch_parent() -> None:
    """A worker whose caller died exits, even while blocked in a collective that will never complete."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)
    threading.Thread(target=watch, daemon=True, name="stepgate-tp-parent-watch").start()


def _load_shard(spec: WorkerSpec, rank: int, group: Group, dtype):
    device = spec.config.device
    if spec.state is not None:
        state = torch.load(io.BytesIO(spec.state), weights_only=True)
    else:
        from ..loader import load_model
        full = load_model(spec.source, dtype, device)[0]
        state = tp_layers.shard_state(full.state_dict(), spec.shape, spec.tp, rank)
        del full
    return tp_layers.local_model(state, spec.shape, spec.tp, rank, group, device, dtype)


def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    _watch_parent()
    dump_stacks_on_usr1()
    try:
        if spec.setup is not None:
            spec.setup(rank)
        torch.set_num_threads(spec.threads)
        from ..dtypes import torch_dtype
        from ..runner import build_runner
        cfg, dtype = spec.config, torch_dtype(spec.config.dtype)
        device = torch.device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("ok", os.getpid()))
        store = dist.TCPStore("127.0.0.1", spec.port, spec.tp, False,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        group = Group(rank, spec.tp, store, device)
        model = _load_shard(spec, rank, group, dtype)
        conn.send(("ok", "loaded"))
        group.connect(device)
        runner = build_runner(model, cfg, dtype, spec.num_pages, spec.max_kv, spec.table_width,
                              graphs=bool(cfg.cuda_graphs), runner_cls=ShardRunner, group=group,
                              vocab_first=tp_layers.vocab_rows(spec.shape, spec.tp, rank).start)
        group.set_timeout(cfg.tp_timeout)
        conn.send(("ok", "ready"))
        serve(conn, runner, rank)
        group.shutdown()
    except EOFError:      # the caller went away
        os._exit(0)
    except BaseException:  # noqa: BLE001 (whatever it is, rank 0 must hear it, then this rank is gone)
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)


def serve(conn, runner: ShardRunner, rank: int) -> None:
    """Run rank 0's calls until it says stop. Calls that return something answer; the others do not (poisoning
    freed pages follows every step, and a failure there surfaces at the next answer)."""
    plans = PlanReceiver()

    def run(msg, forward_mode, use_graphs):
        plan, pages_of = plans.decode(msg)
        runner.run(plan, pages_of, forward_mode, use_graphs=use_graphs)
        return runner.choice

    def score(rid, tokens, pages, last_only):
        runner.score(Chunk(Request(rid, tokens, 1), 0, len(tokens)), pages, last_only)
        return True

    calls = {"run": run, "score": score, "poison": runner.poison_pages, "perturb": runner.perturb_page,
             "check": lambda free: kv_page_problems(runner, rank, free)}
    while True:
        op, *args = conn.recv()
        if op == "stop":
            return
        answer = calls[op](*args)
        if answer is not None:
            conn.send(("ok", answer))
