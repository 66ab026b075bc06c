"""What an engine serves, decided once at its construction from the config, the model and the device: how many pages
its pool holds (within the memory free now), whether its steps are captured and launched ahead, and the refusals of
a config the model cannot serve. Apart from Engine because none of it is the engine's state: each decision is a
function of its inputs, and the engine records what came of them (Engine.served)."""
from __future__ import annotations

import torch

from . import errors
from .config import KV_CACHE_BYTES, EngineConfig, graphs_problem
from .pool import pages_for
from .runner import ModelRunner
from .tp.layers import rank_shape


def free_memory(device: str) -> int | None:
    """Bytes the KV pool may take on `device` now: free GPU memory, or the memory the OS says is available without
    swapping (None where neither can be read)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def pool_pages(config: EngineConfig, shape, max_model_len: int, dtype) -> int:
    """The pool's pages, null page included: num_pages, or as many as kv_cache_bytes holds, but no more than
    max_batch rows of the longest request can use."""
    # tp > 1: each rank holds its own key/value heads of every page, so the budget is per rank (per GPU)
    per_page = ModelRunner.bytes_per_page(rank_shape(shape, config.tp), config.page_size, dtype)
    if config.num_pages is not None:
        pages, field = config.num_pages, f"num_pages={config.num_pages}"
    else:
        kind = torch.device(config.device).type
        budget = config.kv_cache_bytes or KV_CACHE_BYTES.get(kind, KV_CACHE_BYTES["cpu"])
        if budget // per_page < 2:
            raise errors.ConfigError(f"kv_cache_bytes={config.kv_cache_bytes}: a page of {config.page_size} "
                                     f"slots takes {per_page} bytes on this model, and the pool needs at least 2 "
                                     f"pages (one is the null page): {2 * per_page} bytes")
        pages = min(budget // per_page, config.max_batch * pages_for(max_model_len, config.page_size) + 1)
        field = f"kv_cache_bytes={config.kv_cache_bytes}"
    # before anything is allocated: a pool of 10**8 pages would first build a free list of gigabytes, then fail
    # untyped in torch (or swap the machine to a halt)
    free = free_memory(config.device)
    if free is not None and pages * per_page > free:
        raise errors.PoolTooLargeError(
            f"{field}: {pages} pages of {config.page_size} slots take {pages * per_page / 2**30:.3g} GiB of KV "
            f"cache on this model ({per_page} bytes a page), more than the {free / 2**30:.3g} GiB free on "
            f"{config.device}: give fewer pages (or a smaller kv_cache_bytes)")
    return pages


def check_record_topk(config: EngineConfig, shape) -> None:
    """record_topk no larger than the vocabulary a rank samples from."""
    # at tp > 1 each rank takes the top k of its own vocabulary shard before they are merged
    most = shape.vocab_size // config.tp
    if config.record_topk > most:
        raise errors.ConfigError(f"record_topk={config.record_topk}: more than the {most} tokens of the model's "
                                 f"vocabulary" + (f" shard at tp={config.tp}" if config.tp > 1 else ""))


def check_max_model_len(config: EngineConfig, pool, max_model_len: int, num_pages: int) -> None:
    """A max_model_len given in the config: one request of that many positions fits the pool."""
    if config.max_model_len is not None and pool.pages_needed(max_model_len) > pool.capacity:
        raise errors.ConfigError(
            f"max_model_len={config.max_model_len}: one request of {max_model_len} positions needs "
            f"{pool.pages_needed(max_model_len)} pages of {config.page_size} slots, but the pool holds "
            f"{pool.capacity} (num_pages={num_pages}, one of them the null page): give more pages or a "
            f"smaller max_model_len")


def use_cuda_graphs(config: EngineConfig) -> bool:
    """cuda_graphs None: on where they can run (CUDA, a backend whose decode is graph-safe, tp 1); True: required
    (on a CPU: the captured steps' path run uncaptured, for a backend whose kernels allow it)."""
    reason = graphs_problem(config)
    if config.cuda_graphs and reason:
        raise errors.ConfigError(f"cuda_graphs=True but {reason}")
    return reason is None and config.cuda_graphs is not False


def use_overlap(config: EngineConfig, runner) -> bool:
    """overlap None: on where the runner can launch a step ahead (its graphs exist) and they are captured; True:
    required. Poison mode keeps it: the pages a step frees are poisoned before the step launched after it."""
    reason = None
    if not runner.can_launch_ahead:
        reason = ("launching a step ahead needs the captured pure decode steps (cuda_graphs) on one rank: "
                  "at tp > 1 every rank would have to launch it")
    if config.overlap and reason:
        raise errors.ConfigError(f"overlap=True but {reason}")
    if config.overlap is None:
        return reason is None and runner.graphs.capture_graphs
    return bool(config.overlap)
