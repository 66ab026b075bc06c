"""One tensor-parallel rank: its process group, its runner and page check, and the step plan as plain data between
the ranks.

Every rank (rank 0 in the caller's process, the others in worker processes) serves with a ShardRunner: the model
runner over its shard of the weights and of the KV pool, whose model outputs the whole vocabulary's greedy choice
(tp_layers.ChoiceModel). Rank 0 sends each step's plan with a PlanSender; a worker rebuilds it with a
PlanReceiver."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from . import layers as tp_layers
from ..pool import NULL_PAGE
from ..request import Request, State
from ..readback import StepOutput
from ..runner import ModelRunner
from ..scheduler import Chunk, StepPlan

STARTUP_TIMEOUT_S = 900  # loading, compiling and capturing take minutes on a GPU


class Group:
    """This engine's ranks: a process group made without torch.distributed's global default group (as vLLM's
    stateless groups are), so several engines can live in one process. gloo on CPU, NCCL on CUDA. Made with the
    startup timeout (connecting, capturing); serving sets the step timeout (set_timeout)."""

    def __init__(self, rank: int, size: int, store, device: torch.device):
        from torch.distributed import PrefixStore, ProcessGroup
        self.rank, self.size = rank, size
        store = PrefixStore("stepgate-tp", store)
        td = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
        pg = ProcessGroup(store, rank, size)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            backend, kind = dist.ProcessGroupNCCL(store, rank, size, opts), ProcessGroup.BackendType.NCCL
        else:
            backend, kind = dist.ProcessGroupGloo(store, rank, size, timeout=td), ProcessGroup.BackendType.GLOO
        pg._set_default_backend(kind)
        backend._set_sequence_number_for_group()
        pg._register_backend(torch.device(device.type), kind, backend)
        self.pg, self.backend = pg, backend

    def connect(self, device) -> None:
        """The first collective: NCCL makes its communicator here (blocking until every rank arrives), at a point of
        the startup where every rank has just said it is alive, rather than in the first step."""
        self.all_reduce(torch.zeros(1, device=device))

    def set_timeout(self, seconds: float) -> None:
        """gloo: how long a collective waits for a silent peer before it raises. NCCL keeps the startup timeout: rank
        0 never blocks on the device (TPRunner polls it), and a shorter watchdog would tear the process down."""
        if isinstance(self.backend, dist.ProcessGroupGloo):
            setter = getattr(self.backend, "set_timeout", None) or self.backend._set_default_timeout
            setter(datetime.timedelta(seconds=seconds))

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.pg)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[size, *t.shape]: every rank's t, in rank order."""
        t = t.contiguous()
        out = t.new_empty((self.size * t.numel(),))
        _gather_into(out, t.view(-1), group=self.pg)
        return out.view(self.size, *t.shape)

    def shutdown(self) -> None:
        for name in ("abort", "shutdown"):   # abort: an NCCL kernel waiting on a dead peer must not block exit
            fn = getattr(self.pg, name, None)
            if fn is not None:
                try:
                    fn()
                    return
                except Exception:  # noqa: BLE001 (best effort on a group that may already be broken)
                    pass


_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rank_devices(device: str, tp: int) -> list[str]:
    """One device per rank: cuda:k, cuda:k+1, ... from the engine's cuda:k; every rank on the CPU otherwise."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return [str(dev)] * tp
    first = dev.index or 0
    have = torch.cuda.device_count()
    if first + tp > have:
        raise ValueError(f"tp={tp} from {device} needs GPUs {first}..{first + tp - 1}, but {have} are visible")
    return [f"cuda:{first + r}" for r in range(tp)]


class ShardRunner(ModelRunner):
    """One rank's runner. Its forward ends in the gathered greedy choice, so sampling is a readback; the choice is
    kept in `choice` (a worker sends it to rank 0, which checks that the ranks agree)."""

    def __init__(self, model, *args, group, vocab_first: int, **kw):
        super().__init__(tp_layers.ChoiceModel(model, group, vocab_first, kw.get("record_topk", 0)), *args, **kw)
        self.group = group
        self.choice: list[int] = []
        self.before_readback = None   # rank 0 on CUDA: watch the workers while the device finishes the step

    def sample_async(self, packed: torch.Tensor) -> StepOutput:
        return self.sample(packed)      # the workers' agreement check needs the choice now

    def sample(self, packed: torch.Tensor) -> StepOutput:
        self.choice = []
        if packed.shape[0] == 0:
            return StepOutput([])
        if self.before_readback is not None:
            self.before_readback()
        rows = packed.tolist()    # one host readback
        k = self.record_topk
        out = StepOutput([int(r[0]) for r in rows])
        if self.poison:
            out.nonfinite = [r[1] > 0 for r in rows]
        if k:
            out.topk_vals = [r[2:2 + k] for r in rows]
            out.topk_ids = [[int(x) for x in r[2 + k:]] for r in rows]
        self.choice = out.tokens
        return out

    @torch.inference_mode()
    def score(self, chunk: Chunk, pages: list[int], last_only: bool = False) -> torch.Tensor:
        """The whole vocabulary's logits (gathered from every rank), as ModelRunner.score."""
        tokens, positions, ctx, rows = self.build([chunk], [], {chunk.request.request_id: pages},
                                                  all_logits=not last_only)
        local = self.model.shard(tokens, positions, self.kv_caches, ctx, rows)     # [T, V/tp]
        whole = self.group.all_gather(local)                                       # [tp, T, V/tp]
        return whole.permute(1, 0, 2).reshape(local.shape[0], -1).cpu()


def kv_page_problems(runner: ModelRunner, rank: int, free_pages: list[int]) -> list[str]:
    """One rank's KV pool against rank 0's bookkeeping: the null page is zero, and in poison mode every free page
    holds NaN in every slot of every layer (freed pages were poisoned on this rank too)."""
    problems = []
    free = torch.tensor(sorted(free_pages), dtype=torch.long, device=runner.device)
    for layer, (k, v) in enumerate(runner.kv_caches):
        for name, t in (("K", k), ("V", v)):
            if not bool((t[NULL_PAGE] == 0).all()):
                problems.append(f"rank {rank}: layer {layer} {name}: the null page is not zero")
            if runner.poison and len(free):
                nan = torch.isnan(t[free]).flatten(1).all(1)
                if not bool(nan.all()):
                    bad = free[~nan][:5].tolist()
                    problems.append(f"rank {rank}: layer {layer} {name}: free pages {bad} hold values that are not "
                                    f"NaN (a freed page was not poisoned on this rank)")
    return problems


class PlanSender:
    """Rank 0's half of the plan protocol. What changes every step (chunk bounds, decode tokens and positions) is
    always sent; a request's prompt and pages only when the workers do not hold them: the receiver holds exactly the
    requests of the previous plan, so one that was not in it (or whose pages changed) is sent whole."""

    def __init__(self):
        self.held: dict[str, list[int]] = {}

    def encode(self, plan: StepPlan, pages_of: dict[str, list[int]]) -> tuple:
        held, new = {}, {}
        for r in [c.request for c in plan.chunks] + plan.decodes:
            pages = pages_of[r.request_id]
            if self.held.get(r.request_id) != pages:
                new[r.request_id] = (r.prompt, list(pages))
            held[r.request_id] = list(pages)
        self.held = held
        chunks = [(c.request.request_id, c.start, c.length, c.long) for c in plan.chunks]
        decodes = [(r.request_id, r.output[-1], r.num_cached) for r in plan.decodes]
        return plan.index, new, chunks, decodes


class PlanReceiver:
    """A worker's half: rebuilds the plan with stand-ins for rank 0's requests (what a runner reads of them),
    reusing those of the previous step."""

    def __init__(self):
        self.held: dict[str, tuple[Request, list[int]]] = {}

    def decode(self, msg: tuple) -> tuple[StepPlan, dict[str, list[int]]]:
        index, new, chunks, decodes = msg
        held = {}

        def row(rid: str) -> Request:
            if rid in new:
                prompt, pages = new[rid]
                held[rid] = (Request(rid, prompt, 1), pages)
            else:
                held[rid] = self.held[rid]
            return held[rid][0]

        plan = StepPlan(index)
        for rid, start, length, long in chunks:
            r = row(rid)
            r.state, r.num_cached = State.PREFILL, start
            plan.chunks.append(Chunk(r, start, length, long))
        for rid, token, num_cached in decodes:
            r = row(rid)
            r.state, r.num_cached, r.output = State.DECODE, num_cached, [token]
            plan.decodes.append(r)
        self.held = held
        return plan, {rid: pages for rid, (_, pages) in held.items()}
