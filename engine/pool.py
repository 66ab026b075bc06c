"""The KV page pool: fixed pages, a free list, reserve on admit, eviction at the end of the step. Bookkeeping only.

Page 0 is the null page: never handed out, always zero. Kernels that pad a gather point padding at it, so they never
touch a slot another request owns (see kernels/torch_backend.py).

With the prefix cache on (`PagePool(..., prefix_cache=True)`, engine/prefix_cache.py), full pages are shared: a page
carries a count of the requests holding it, and a cached page nobody holds stays cached, least recently used
first, until a reservation finds no free page; only then is it evicted (its key dropped; `take_evicted()` hands it
to the runner to poison before the step's forward). Every page but the null page is free, cached and unheld, or held.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from .copying import copy_fields
from .errors import NeverFitsError, PoolInvariantError
from .prefix_cache import PrefixCache, short

NULL_PAGE = 0


def require(ok: bool, message: str) -> None:
    """An invariant of the pool, checked in every interpreter mode (`python -O` drops an assert)."""
    if not ok:
        raise PoolInvariantError(message)


def pages_for(slots: int, page_size: int) -> int:
    """Whole pages for `slots` KV slots, rounded up."""
    return -(-slots // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (one is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.free: deque[int] = deque(range(1, num_pages))
        self.owned: dict[str, list[int]] = {}   # owner (a request id, or an engine-internal key) -> pages
        self.pending: list[tuple[str, list[int]]] = []   # released during a step, returned at its end
        self.refs: dict[int, int] = {}                   # page -> requests holding it (pending ones included)
        self.cache: PrefixCache | None = PrefixCache() if prefix_cache else None
        self.evicted: list[int] = []                     # evicted since the runner last poisoned them
        self.in_step = False
        self.step = 0       # the open (or next) step: begin_step/end_step pairs, so the scheduler's step index
        self.last_owner: dict[int, tuple[str, int]] = {}   # page -> (owner, step at whose end it was freed)

    __deepcopy__ = copy_fields      # engine/copying.py: its page lists copied at C speed

    @property
    def capacity(self) -> int:
        """Pages a request can ever own (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages a reservation can take now: free ones and cached ones nobody holds (evicted on demand)."""
        return len(self.free) + self.num_cached

    @property
    def num_cached(self) -> int:
        """Cached pages nobody holds."""
        return len(self.cache.lru) if self.cache else 0

    @property
    def num_owned(self) -> int:
        """Pages some request holds (a shared page counts once)."""
        return len(self.refs)

    def pages_needed(self, slots: int) -> int:
        return pages_for(slots, self.page_size)

    def check_fits(self, request_id: str, prompt_len: int, budget: int) -> None:
        """Refuse (NeverFitsError) a request that needs more pages than the whole pool holds: it could never be
        admitted, so it is refused at submit instead of waiting forever."""
        need = self.pages_needed(prompt_len + budget)
        if need > self.capacity:
            raise NeverFitsError(
                f"{request_id}: needs {need} pages of {self.page_size} slots (prompt {prompt_len} + budget "
                f"{budget}) but the whole pool holds {self.capacity}: it could never be admitted")

    def can_reserve(self, slots: int, hits: list[int] = ()) -> bool:
        """`hits`: cached pages the request will hold (pinned, not taken) as its first pages."""
        return self.pages_needed(slots) - len(hits) <= self.num_free - self.parked(hits)

    def parked(self, pages) -> int:
        """How many of `pages` are cached and unheld (so counted in num_free)."""
        return sum(p in self.cache.lru for p in pages) if self.cache else 0

    def reserve(self, owner: str, slots: int, hits: list[int] = ()) -> list[int]:
        """Give `owner` all the pages it will ever need; they stay its own until released. `hits` (cached pages of
        its prompt prefix) are its first pages, shared, each count + 1; the rest come from the free list, then from
        evicting the least recently used cached pages nobody holds."""
        n = self.pages_needed(slots) - len(hits)
        require(owner not in self.owned, f"{owner!r} already owns pages")
        require(n <= self.num_free - self.parked(hits),
                f"reserve of {n} pages with {self.num_free - self.parked(hits)} free")
        for p in hits:
            self.pin(p)
        pages = list(hits) + [self.take() for _ in range(n)]
        for p in pages[len(hits):]:
            self.refs[p] = 1
        self.owned[owner] = pages
        return pages

    def pin(self, page: int) -> None:
        require(page in self.cache.by_page, f"page {page} is not cached: it cannot be shared")
        self.refs[page] = self.refs.get(page, 0) + 1
        self.cache.unpark(page)

    def take(self) -> int:
        if self.free:
            return self.free.popleft()
        page = self.cache.evict()
        self.evicted.append(page)
        return page

    def take_evicted(self) -> list[int]:
        """Pages evicted since the last call: the runner fills them with NaN before anything writes them."""
        out, self.evicted = self.evicted, []
        return out

    def register(self, owner: str, index: int, key: bytes, hashed: tuple) -> None:
        """Cache page `index` of `owner` (full, just computed) under `key`, unless another page has that key."""
        page = self.owned[owner][index]
        if self.refs[page] != 1 or page in self.cache.by_page:     # the message only when it fails: once a page
            require(False, f"{owner}'s page {page} (#{index}) is shared or cached already (count "
                    f"{self.refs[page]}, hash {short(self.cache.key_of(page))}): it cannot have been computed by "
                    f"{owner}")
        self.cache.register(page, key, hashed)

    def unreserve(self, reserved: list[tuple[str, int]], evicted: list[int], lru: list[int] | None) -> None:
        """Undo this step's reserve() calls, for a step that failed before its end (Engine.step redoes it).
        `reserved`: (owner, its cached hits) in the order reserved; `evicted`: the cached pages those reservations
        evicted; `lru`: the evictable cached pages, in order, before them (None: the step reserved nothing). The
        pages go back where they were taken, so that the redone step takes the same ones, except that an evicted page
        comes back free, not cached: the step's forward may have written it. Every page taken is poisoned before the
        next forward (take_evicted), for the same reason."""
        taken = []
        for owner, hits in reversed(reserved):
            pages = self.owned.pop(owner)
            for p in pages:
                self.refs[p] -= 1
                if not self.refs[p]:
                    del self.refs[p]
            taken[:0] = pages[hits:]
        gone = set(evicted)
        # the free list was taken from the front, and ran empty before any eviction
        self.free.extendleft(reversed([p for p in taken if p not in gone]))
        self.free.extend(evicted)
        if lru is not None and self.cache is not None:
            self.cache.lru = OrderedDict.fromkeys(p for p in lru if p not in gone)
        self.evicted.extend(taken)

    def begin_step(self) -> None:
        self.in_step = True

    def release(self, owner: str) -> None:
        """Hand back `owner`'s pages; they reach the free list at the end of the current (or next) step, never sooner."""
        require(owner in self.owned, f"release of {owner!r}, which owns no pages")
        pages = self.owned.pop(owner)
        self.pending.append((owner, pages))
        for p in pages:
            self.last_owner[p] = (owner, self.step)

    def end_step(self) -> list[int]:
        """Eviction at the end of the step: counts drop; a page nobody holds any more becomes free (returned: the
        runner poisons it) or, if cached, the most recently used evictable page. A request's pages are parked last
        page first, so that a prefix's deeper pages are evicted before the pages that lead to them."""
        freed = []
        for _, pages in self.pending:
            for p in reversed(pages):
                self.refs[p] -= 1
                if self.refs[p]:
                    continue
                del self.refs[p]
                if self.cache is not None and p in self.cache.by_page:
                    self.cache.park(p)
                else:
                    freed.append(p)
        freed.reverse()
        self.pending.clear()
        self.free.extend(freed)
        self.step += self.in_step
        self.in_step = False
        return freed

    def holder(self, page: int) -> tuple[str | None, str]:
        """Who holds `page` now, for failure reports: (owner, "owned"), (owner, "released") while it waits for the
        step's end, (last owner, "freed") once free again, or (None, "never owned")."""
        for owner, pages in self.owned.items():
            if page in pages:
                return owner, "owned"
        if any(page in pages for _, pages in self.pending):
            return self.last_owner[page][0], "released"
        if page in self.last_owner:
            return self.last_owner[page][0], "freed"
        return None, "never owned"

    def holders(self) -> dict[int, list[str]]:
        """page -> the requests holding it (pending releases included)."""
        out: dict[int, list[str]] = {}
        for owner, pages in list(self.owned.items()) + self.pending:
            for p in pages:
                out.setdefault(p, []).append(owner)
        return out

    def check(self) -> None:
        """The pool's own invariants: free + cached + owned = capacity, a page's count equals its holders, only
        cached pages are shared, cached pages nobody holds are evictable and no held page is, one page per hash,
        the null page never out."""
        held = self.holders()
        lru = list(self.cache.lru) if self.cache else []
        bad = [p for p in lru if p in held]
        require(not bad, "; ".join(f"page {p} (hash {short(self.cache.key_of(p))}) is evictable (in the LRU) while "
                                   f"held by {held[p]}" for p in bad))
        seen = list(self.free) + lru + list(held)
        what = "free + cached + owned" if self.cache else "free + owned"
        require(len(seen) == self.capacity, f"{what} = {len(seen)} pages, capacity {self.capacity}")
        require(len(set(seen)) == len(seen), "a page has two owners (or is free and owned, or cached and owned)")
        require(NULL_PAGE not in seen, "the null page was handed out")
        for p, owners in held.items():
            key = short(self.cache.key_of(p)) if self.cache else "-"
            require(len(owners) == 1 or bool(self.cache and p in self.cache.by_page),
                    f"page {p} has two owners {owners} and is not a cached page")
            require(self.refs.get(p) == len(owners),
                    f"page {p} (hash {key}) has count {self.refs.get(p)} but is held by {len(owners)}: {owners}")
            require(len(set(owners)) == len(owners), f"page {p} appears twice in the pages of {owners}")
        stray = sorted(set(self.refs) - set(held))
        require(not stray, f"pages {stray} have counts {[self.refs[p] for p in stray]} but nobody holds them")
        if self.cache:
            c = self.cache
            require(len(c.by_key) == len(c.by_page) and all(c.by_key.get(e.key) is e for e in c.by_page.values()),
                    "the cache's key and page maps disagree: not one page per hash")
            loose = sorted(set(self.free) & set(c.by_page))
            require(not loose, f"free pages {loose} are still cached (hashes {[short(c.key_of(p)) for p in loose]})")
            require(all(p in c.by_page for p in lru), "an uncached page sits in the LRU")
