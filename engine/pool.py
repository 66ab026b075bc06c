"""The KV page pool: fixed pages, a free list, reserve on admit, eviction at the end of the step. Bookkeeping only.

Page 0 is the null page: never handed out, always zero. Kernels that pad a gather point padding at it, so they never
touch a slot another request owns (see kernels/torch_backend.py).
"""
from __future__ import annotations

from collections import deque

NULL_PAGE = 0


def pages_for(slots: int, page_size: int) -> int:
    """Whole pages for `slots` KV slots, rounded up."""
    return -(-slots // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (one is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.free: deque[int] = deque(range(1, num_pages))
        self.owned: dict[str, list[int]] = {}
        self.pending: list[tuple[str, list[int]]] = []   # released during a step, returned at its end
        self.in_step = False
        self.step = 0       # the open (or next) step: begin_step/end_step pairs, so the scheduler's step index
        self.last_owner: dict[int, tuple[str, int]] = {}   # page -> (owner, step at whose end it was freed)

    @property
    def capacity(self) -> int:
        """Pages a request can ever own (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_owned(self) -> int:
        return sum(len(p) for p in self.owned.values()) + sum(len(p) for _, p in self.pending)

    def pages_needed(self, slots: int) -> int:
        return pages_for(slots, self.page_size)

    def can_reserve(self, slots: int) -> bool:
        return self.pages_needed(slots) <= self.num_free

    def reserve(self, owner: str, slots: int) -> list[int]:
        """Give `owner` all the pages it will ever need; they stay its own until released."""
        n = self.pages_needed(slots)
        assert owner not in self.owned, f"{owner} already owns pages"
        assert n <= self.num_free, f"reserve of {n} pages with {self.num_free} free"
        pages = [self.free.popleft() for _ in range(n)]
        self.owned[owner] = pages
        return pages

    def begin_step(self) -> None:
        self.in_step = True

    def release(self, owner: str) -> None:
        """Hand back `owner`'s pages; they reach the free list at the end of the current (or next) step, never sooner."""
        pages = self.owned.pop(owner)
        self.pending.append((owner, pages))
        for p in pages:
            self.last_owner[p] = (owner, self.step)

    def end_step(self) -> list[int]:
        """Eviction at the end of the step: returns the pages that just became free (the runner poisons them)."""
        freed = [p for _, pages in self.pending for p in pages]
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

    def check(self) -> None:
        """The pool's own invariants: free + owned = capacity, no page with two owners, the null page never out."""
        seen = list(self.free) + [p for pages in self.owned.values() for p in pages] + \
            [p for _, pages in self.pending for p in pages]
        assert len(seen) == self.capacity, f"free + owned = {len(seen)} pages, capacity {self.capacity}"
        assert len(set(seen)) == len(seen), "a page has two owners (or is free and owned)"
        assert NULL_PAGE not in seen, "the null page was handed out"
