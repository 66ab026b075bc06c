"""The KV-cache manager: the scheduler's one seam to the pages (as vLLM v1's KVCacheManager over its BlockPool).
The scheduler asks it whether a request can be admitted and admits it (reserve on admit, a prompt prefix found
cached counted as computed), tells it which pages a step completed (registered in the prefix cache, keyed by the
hash chain it keeps on each request), and releases a retiring request's pages; the pool (engine/pool.py) stays
storage: free list, owners, counts, the cached pages in LRU order. Bookkeeping only."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .copying import copy_fields
from .pool import PagePool
from .prefix_cache import Chain
from .request import Request

if TYPE_CHECKING:      # the manager reads a step's plan; the scheduler, above it, makes the plan
    from .scheduler import StepPlan


class KVCacheManager:
    __deepcopy__ = copy_fields      # engine/copying.py

    def __init__(self, pool: PagePool):
        self.pool = pool

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def caching(self) -> bool:
        return self.pool.cache is not None

    # -- admission -------------------------------------------------------------------------------------------
    def shareable_pages(self, r: Request) -> int:
        """Whole pages of the prompt a request may find cached: at least its last prompt position is computed, so
        that the step that completes the prompt has logits to sample."""
        return (r.prompt_len - 1) // self.pool.page_size

    def hits(self, r: Request) -> list[int]:
        """The cached pages the request's prompt begins with (none without the prefix cache); its hash chain is
        kept on the request from here on."""
        cache = self.pool.cache
        if cache is None:
            return []
        if r.chain is None:
            r.chain = Chain()
        return cache.match(r.chain, r.prompt, self.pool.page_size, self.shareable_pages(r))

    def can_admit(self, r: Request, hits: list[int]) -> bool:
        """Reserve on admit: the pool holds the whole prompt and budget, less the pages found cached."""
        return self.pool.can_reserve(r.slots_needed, hits)

    def admit(self, r: Request, hits: list[int]) -> None:
        """The request's pages reserved, the prefix found cached counted as computed."""
        r.pages = self.pool.reserve(r.request_id, r.slots_needed, hits)
        r.num_cached = r.cached_prefix = len(hits) * self.pool.page_size
        cache = self.pool.cache
        if cache is not None:
            r.chain.registered = len(hits)
            cache.lookups += self.shareable_pages(r)
            cache.hits += len(hits)

    def lru(self) -> list[int] | None:
        """The cached pages nobody holds, least recently used first (None: no prefix cache): what unadmit restores."""
        return list(self.pool.cache.lru) if self.pool.cache is not None else None

    def unadmit(self, admitted: list[Request], evicted: list[int], lru: list[int] | None) -> None:
        """Undo admit() for a step that failed before its end (Engine.step redoes it): the pages go back where they
        were taken (pool.unreserve), the prefix-cache counts back; the requests hold nothing, computed nothing."""
        ps, cache = self.pool.page_size, self.pool.cache
        self.pool.unreserve([(r.request_id, r.cached_prefix // ps) for r in admitted], evicted, lru)
        for r in admitted:
            if cache is not None:
                cache.lookups -= self.shareable_pages(r)
                cache.hits -= r.cached_prefix // ps
            r.pages, r.cached_prefix = [], 0

    # -- a step --------------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.pool.begin_step()

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def register(self, plan: StepPlan, running: list[Request]) -> None:
        """Cache the pages `plan`'s step completed (prompt and decode pages alike: each position is computed once and
        never rewritten), in admission order (`running`'s), so that of two equal pages computed in one step the
        earlier request's is kept."""
        cache, ps = self.pool.cache, self.pool.page_size
        if cache is None:
            return
        # only a chunk's request, or a decode row that just filled its page (its one new position is a page's last),
        # can have completed a page: look at those, not at every row
        filled = {id(c.request) for c in plan.chunks}
        filled.update(id(r) for r in plan.decodes if r.num_cached % ps == 0)
        for r in [r for r in running if id(r) in filled] if filled else ():
            chain = r.chain
            full = r.num_cached // ps
            if chain is None or full <= chain.registered:
                continue
            # position p holds tokens[p]; a page within the prompt needs no copy of the prompt and output
            tokens = r.prompt if full * ps <= r.prompt_len else r.prompt + r.output
            cache.extend(chain, tokens, ps, full)
            for k in range(chain.registered, full):
                self.pool.register(r.request_id, k, chain.keys[k], cache.hashed_of(chain, tokens, ps, k))
            chain.registered = full

    def forget(self, r: Request) -> None:
        """A request that retires (or leaves the queue): its hash chain goes with it."""
        r.chain = None


__all__ = ["KVCacheManager"]
