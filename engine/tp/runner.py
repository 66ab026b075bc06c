"""Tensor parallel over torch.distributed, rank 0's side: the worker processes (engine/tp/worker.py) started,
watched and stopped, and the runner the engine sees.

Rank 0 lives in the caller's process and keeps the one scheduler; ranks 1..tp-1 are worker processes that the engine
starts (torch.multiprocessing) and stops. Each step rank 0 sends the workers its plan as plain data over a pipe;
every rank runs the same forward on its shard of the weights and of the KV pool (the same page ids everywhere),
meeting the others in the all-reduces; every rank makes the greedy choice from the gathered vocabulary shards, and
the workers send theirs back, so rank 0 checks at every step that all ranks chose the same tokens. A worker that
dies, raises or does not answer within `tp_timeout` becomes a WorkerError naming its rank."""
from __future__ import annotations

from typing import TYPE_CHECKING

import datetime
import io
import os
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels import envs

from . import layers as tp_layers
from ..errors import RankDisagreementError, WorkerError
from ..readback import StepOutput
from ..scheduler import Chunk, StepPlan
from .shard import STARTUP_TIMEOUT_S, Group, PlanSender, ShardRunner, kv_page_problems, rank_devices
from .worker import WorkerSpec, worker_main

if TYPE_CHECKING:      # a value the facade hands down, not an import of it
    from ..config import EngineConfig

# forkserver: a worker is forked from a server that has imported torch once (a fresh import per worker costs seconds
# on a small CPU), and no process that forks has touched CUDA. STEPGATE_TP_START=spawn for a fresh interpreter each.
START_METHOD = envs.get("STEPGATE_TP_START")
WORKER_SETUP = None      # tests: a picklable callable(rank) every worker runs first (to plant a bug in a worker)
POLL_S = 0.05            # how often a wait looks at the workers' processes
GRACE_S = 2.0            # after a failed collective: how long the other ranks get to report what happened


# -- rank 0 ---------------------------------------------------------------------------------------------------------
def collective_failure(e: BaseException) -> bool:
    """A collective that failed because of a peer (its connection closed, or it timed out), not rank 0's own bug."""
    text = str(e).lower()
    return isinstance(e, (TimeoutError, getattr(dist, "DistError", TimeoutError))) or "gloo" in text or "nccl" in text


def _stop(procs, conns, patient: list[bool]) -> None:
    """Stop every worker: ask (unless a failure left one that may never read), then terminate, then kill."""
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + (5.0 if patient[0] else 0.0)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in conns:
        conn.close()


class Workers:
    """Ranks 1..tp-1 seen from rank 0: start them, talk to them, and turn whatever goes wrong into a WorkerError
    that names the rank."""

    def __init__(self, specs: list[WorkerSpec]):
        ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            ctx.set_forkserver_preload(["engine.tp.worker"])
        self.procs, self.conns = [], []
        for rank, spec in enumerate(specs, start=1):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, spec, child), name=f"stepgate-tp-rank{rank}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.patient = [True]
        self._stop = weakref.finalize(self, _stop, self.procs, self.conns, self.patient)

    def ranks(self):
        return enumerate(zip(self.procs, self.conns), start=1)

    def send(self, msg: tuple, doing: str) -> None:
        for rank, (p, conn) in self.ranks():
            try:
                conn.send(msg)
            except (OSError, ValueError):
                raise self.failure(doing) or WorkerError([rank], f"tensor-parallel rank {rank}'s pipe is closed "
                                                                 f"while {doing}") from None

    def answers(self, doing: str, timeout: float) -> list:
        """One answer from every worker, in rank order."""
        deadline = time.monotonic() + timeout
        out = []
        for rank, (p, conn) in self.ranks():
            while not conn.poll(POLL_S):
                if not p.is_alive() and not conn.poll():
                    raise self.failure(doing) or WorkerError([rank], f"tensor-parallel rank {rank} is gone while "
                                                                     f"{doing}")
                if time.monotonic() > deadline:
                    raise WorkerError([rank], f"tensor-parallel rank {rank} (pid {p.pid}) did not answer within "
                                              f"{timeout:g} s while {doing}: it hangs (tp_timeout)")
            out.append(self._read(rank, conn, doing))
        return out

    def _read(self, rank, conn, doing):
        try:
            tag, payload = conn.recv()
        except (EOFError, OSError):
            raise self.failure(doing) or WorkerError([rank], f"tensor-parallel rank {rank}'s pipe closed while "
                                                             f"{doing}") from None
        if tag == "error":
            raise WorkerError([rank], f"tensor-parallel rank {rank} failed while {doing}:\n{payload}")
        return payload

    def failure(self, doing: str, cause: BaseException | None = None) -> WorkerError | None:
        """What happened to the workers after something failed while `doing`: a rank that died (its exit code), one
        that raised (its traceback), or, after a failed collective, one that stays silent (it hangs). None: every
        worker finished its part, so the failure was rank 0's own."""
        deadline = time.monotonic() + GRACE_S
        dead, raised, silent = [], [], []
        for rank, (p, conn) in self.ranks():
            if conn.poll(max(0.0, deadline - time.monotonic())):
                try:
                    tag, payload = conn.recv()
                except (EOFError, OSError):
                    tag, payload = "dead", None
                if tag == "error":
                    raised.append((rank, payload))
                    continue
                if tag == "ok":
                    continue
            p.join(max(0.0, deadline - time.monotonic()))
            if not p.is_alive():
                dead.append((rank, p.pid, p.exitcode))
            elif cause is not None:
                silent.append(rank)
        lines = [f"tensor-parallel rank {r} (pid {pid}) died (exit code {code}) while {doing}"
                 for r, pid, code in dead]
        lines += [f"tensor-parallel rank {r} failed while {doing}:\n{tb}" for r, tb in raised]
        lines += [f"tensor-parallel rank {r} did not answer while {doing}: it hangs" for r in silent]
        if not lines:
            return None
        if cause is not None:
            lines.append(f"(rank 0 saw: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})")
        ranks = sorted([r for r, *_ in dead] + [r for r, _ in raised] + silent)
        return WorkerError(ranks, "\n".join(lines))

    def close(self, patient: bool = True) -> None:
        """Stop the workers (once; also at exit or when collected). patient=False: terminate at once."""
        self.patient[0] = patient
        self._stop()


class TPRunner:
    """Rank 0's runner when tp > 1 (the engine sees only this one), a Runner (engine/runner.py) written out in full:
    each call goes to the workers first, as plain data, then runs on rank 0's own shard; the workers' answers are
    checked (the token choices must agree). What it reports of itself (device, backend, graphs, kv_caches) is rank
    0's. It launches no step ahead: a step launched ahead would run on rank 0 alone (can_launch_ahead is False)."""

    can_launch_ahead = False

    def __init__(self, local: ShardRunner, workers: Workers, timeout: float, source=None):
        self.local = local
        self.workers = workers
        self.timeout = timeout
        # what the workers loaded the model from: a name or directory, or None: rank 0 sent each its shard of the
        # model the engine was given (a gate's engine must serve the model object it is given, on every rank)
        self.source = source if isinstance(source, (str, os.PathLike)) else None
        self.plans = PlanSender()
        self.doing = "starting"
        self.agreed_rows = 0        # (row, rank) choices checked against rank 0's
        self.broken: WorkerError | None = None
        if local.device.type == "cuda":
            local.before_readback = self._watch_device

    # -- what rank 0 reports of itself --------------------------------------------------------------------------
    @property
    def device(self):
        return self.local.device

    @property
    def backend(self):
        return self.local.backend

    @property
    def pdl(self):
        return self.local.pdl

    @property
    def graphs(self):
        return self.local.graphs

    @property
    def step_graphs(self):
        return self.local.step_graphs

    @property
    def page_size(self) -> int:
        return self.local.page_size

    @property
    def pad_page(self):
        return self.local.pad_page

    @property
    def poison(self) -> bool:
        return self.local.poison

    @property
    def kv_caches(self):
        return self.local.kv_caches

    @property
    def model(self):
        return self.local.model

    def path_census(self) -> list[dict]:
        return self.local.path_census()

    def launch_ahead(self, step, pages_of, source, forward_mode):
        """Never: every rank would have to launch it (can_launch_ahead)."""
        return None

    def poisoned_reads(self, plan, pages_of, forward_mode, row, max_reads: int = 1):
        """Not at tp > 1: the bisection re-runs the step on one rank, which the others would not follow."""
        return None

    @classmethod
    def start(cls, config: EngineConfig, model, dtype, num_pages: int, max_kv: int, table_width: int,
              source=None) -> "TPRunner":
        """Start ranks 1..tp-1 and build rank 0. `model`: the whole model (rank 0 shards it); `source`: a name or
        directory the workers load it from themselves (anything else: rank 0 sends each worker its shard)."""
        from ..runner import build_runner
        tp, shape = config.tp, model.shape
        tp_layers.check_tp(shape, tp)
        devices = rank_devices(config.device, tp)
        state = model.state_dict()
        store = dist.TCPStore("127.0.0.1", 0, tp, True, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
                              wait_for_workers=False)
        specs = []
        for rank in range(1, tp):
            shard = None
            if not isinstance(source, (str, os.PathLike)):
                buf = io.BytesIO()   # clones: a slice would save the whole weight it views
                torch.save({k: v.detach().cpu().clone() for k, v in
                            tp_layers.shard_state(state, shape, tp, rank).items()}, buf)
                shard = buf.getvalue()
            specs.append(WorkerSpec(config.with_(device=devices[rank]), tp, shape, source, shard, num_pages, max_kv,
                                    table_width, torch.get_num_threads(), store.port, WORKER_SETUP))
        workers = Workers(specs)
        try:
            workers.answers("starting", STARTUP_TIMEOUT_S)
            group = Group(0, tp, store, torch.device(devices[0]))
            local = tp_layers.local_model(tp_layers.shard_state(state, shape, tp, 0), shape, tp, 0, group,
                                          devices[0], dtype)
            workers.answers("loading the model", STARTUP_TIMEOUT_S)
            group.connect(devices[0])
            # config.cuda_graphs is decided (Engine.use_cuda_graphs), so every rank captures or none does
            runner = build_runner(local, config, dtype, num_pages, max_kv, table_width,
                                  graphs=bool(config.cuda_graphs), runner_cls=ShardRunner,
                                  group=group, vocab_first=0)
            workers.answers("building its runner (warm-up, graph capture)", STARTUP_TIMEOUT_S)
            group.set_timeout(config.tp_timeout)
        except BaseException:
            workers.close()
            raise
        return cls(runner, workers, config.tp_timeout, source)

    # -- calls that every rank runs ----------------------------------------------------------------------------
    def _everywhere(self, msg: tuple, doing: str, local_call, answer: bool):
        """Send `msg` to the workers, run `local_call` on rank 0, collect their answers if `answer`. After any
        failure the ranks are out of step: the engine refuses every later call (close it)."""
        self.doing = doing
        if self.broken is not None:
            raise WorkerError(self.broken.ranks, f"the engine's ranks failed earlier (close it):\n{self.broken}")
        try:
            self.workers.send(msg, doing)
            try:
                out = local_call()
            except WorkerError:
                raise
            except Exception as e:
                err = self.workers.failure(doing, e if collective_failure(e) else None)
                if err is None:    # the workers are fine: the failure is rank 0's own
                    self.broken = WorkerError([0], f"rank 0 failed while {doing}: {type(e).__name__}: {e}")
                    raise
                raise err from e
            return out, (self.workers.answers(doing, self.timeout) if answer else None)
        except WorkerError as e:
            self.broken = e
            raise

    def run(self, plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str,
            use_graphs: bool = True) -> StepOutput:
        doing = f"step {plan.index} ({plan.kind})"
        out, answers = self._everywhere(("run", self.plans.encode(plan, pages_of), forward_mode, use_graphs), doing,
                                        lambda: self.local.run(plan, pages_of, forward_mode, use_graphs), True)
        self.check_agreement(plan, out.tokens, answers)
        return out

    def launch(self, plan: StepPlan, pages_of: dict[str, list[int]], forward_mode: str,
               use_graphs: bool = True) -> StepOutput:
        """As ModelRunner.launch, read back at once (the ranks' choices are compared when the step ends)."""
        return self.run(plan, pages_of, forward_mode, use_graphs)

    def check_agreement(self, plan: StepPlan, tokens: list[int], answers: list[list[int]]) -> None:
        rows = plan.sampled
        bad = []
        for rank, theirs in enumerate(answers, start=1):
            if len(theirs) != len(tokens):
                bad.append(f"rank {rank} chose {len(theirs)} tokens, rank 0 {len(tokens)}")
                continue
            bad += [f"request {rows[i].request_id} (row {i}): rank 0 chose {a}, rank {rank} chose {b}"
                    for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b]
        if bad:
            raise RankDisagreementError(plan.index, bad, f"step {plan.index} ({plan.kind}): tensor-parallel ranks "
                                        f"chose different tokens:\n  " + "\n  ".join(bad[:8]))
        self.agreed_rows += len(tokens) * len(answers)

    def poison_pages(self, pages: list[int]) -> None:
        if not (self.local.poison and pages):
            return
        self._everywhere(("poison", list(pages)), "poisoning freed pages", lambda: self.local.poison_pages(pages),
                         False)

    def score(self, chunk: Chunk, pages: list[int], last_only: bool = False) -> torch.Tensor:
        r = chunk.request
        assert chunk.start == 0 and chunk.length == r.prompt_len, "score() runs one whole sequence"
        out, _ = self._everywhere(("score", r.request_id, r.prompt, pages, last_only), "scoring a sequence",
                                  lambda: self.local.score(chunk, pages, last_only), True)
        return out

    def perturb_page(self, page: int, scale: float = 1.0, seed: int = 0) -> None:
        self._everywhere(("perturb", page, scale, seed), "perturbing a page",
                         lambda: self.local.perturb_page(page, scale, seed), False)

    def page_problems(self, free_pages: list[int]) -> list[str]:
        """Every rank's KV pool against rank 0's free list (shard.kv_page_problems)."""
        mine, answers = self._everywhere(("check", list(free_pages)), "checking its pages",
                                         lambda: kv_page_problems(self.local, 0, free_pages), True)
        return mine + [p for a in answers for p in a]

    def _watch_device(self) -> None:
        """Wait for the device by polling, so that a worker that died or hangs (its peers' NCCL kernels then wait
        forever) becomes a WorkerError instead of a readback that never returns."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.timeout
        check = time.monotonic() + POLL_S
        while not done.query():
            now = time.monotonic()
            if now > check:
                check = now + POLL_S
                dead = [r for r, (p, _) in self.workers.ranks() if not p.is_alive()]
                if dead or now > deadline:   # a worker that raised has sent why, then exited
                    cause = None if dead else TimeoutError(f"the device did not finish within {self.timeout:g} s")
                    raise self.workers.failure(self.doing, cause) or WorkerError(dead, f"ranks {dead} are gone")
            time.sleep(0)

    def close(self) -> None:
        self.workers.close(patient=self.broken is None)
        self.local.group.shutdown()
