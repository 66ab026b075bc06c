"""The prefix cache's bookkeeping: full pages keyed by a hash chained from their prefix, and the least-recently-used
order of the cached pages nobody holds. No tensors; the page pool owns one (engine/pool.py) and keeps the counts.

A page's key is blake2b-128 over (its parent page's key, its own token ids): the key names the page's whole prefix,
so a page with the same token ids after a different prefix gets another key. Why blake2b and not Python's hash() of a
tuple: it is the same in every process and run, so a key in a failure message or a log means the same page content
tomorrow; and 128 bits put a chance collision out of reach, where a 64-bit hash over millions of pages would not. A
hit also compares what was hashed (the parent key and the ids), so a collision cannot hand out a page whose own
tokens differ.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .copying import copy_fields
from .errors import PoolInvariantError

KEY_BYTES = 16
ROOT = b"\0" * KEY_BYTES      # the parent of a sequence's first page


@dataclass(frozen=True)
class CachedPage:
    page: int
    key: bytes
    hashed: tuple             # (parent key, token ids): what the key was computed from, compared on a hit

    def __deepcopy__(self, memo) -> "CachedPage":
        """Immutable all the way down, so a copy of the cache shares it (engine/foresight.py copies the scheduler
        every step it launches ahead in poison mode; a page's token ids made most of that copy)."""
        return self


@dataclass
class Chain:
    """One request's keys, page by page (a prefix of its pages), and how many of its pages are in the cache."""
    keys: list[bytes] = field(default_factory=list)
    registered: int = 0

    __deepcopy__ = copy_fields      # engine/copying.py


def short(key: bytes | None) -> str:
    """A key as failure messages print it."""
    return "none" if key is None else key.hex()[:12]


class PrefixCache:
    __deepcopy__ = copy_fields      # engine/copying.py: its maps rebuilt at C speed, its entries shared

    def __init__(self):
        self.by_key: dict[bytes, CachedPage] = {}
        self.by_page: dict[int, CachedPage] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # cached pages no request holds, least recently used first
        self.evicted_keys: dict[int, bytes] = {}           # page -> the key it had when last evicted (diagnosis)
        self.lookups = 0          # prompt pages that could have been found (at admission)
        self.hits = 0             # of those, found: pages neither computed nor taken from the pool
        self.evictions = 0

    # -- keys ------------------------------------------------------------------------------------------------------
    def hash_input(self, parent: bytes, tokens) -> tuple:
        """What a page's key is computed from, and what a hit compares: the parent's key and the page's ids."""
        return (parent, tuple(tokens))

    def key(self, hashed: tuple) -> bytes:
        parent, tokens = hashed
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def extend(self, chain: Chain, tokens, page_size: int, pages: int) -> None:
        """Extend `chain` to the keys of the first `pages` pages of `tokens` (a sequence at least that long)."""
        keys = chain.keys
        while len(keys) < pages:
            k = len(keys)
            hashed = self.hash_input(keys[-1] if keys else ROOT, tokens[k * page_size:(k + 1) * page_size])
            keys.append(self.key(hashed))

    def hashed_of(self, chain: Chain, tokens, page_size: int, k: int) -> tuple:
        return self.hash_input(chain.keys[k - 1] if k else ROOT, tokens[k * page_size:(k + 1) * page_size])

    # -- lookup and registration -----------------------------------------------------------------------------------
    def match(self, chain: Chain, tokens, page_size: int, pages: int) -> list[int]:
        """The cached pages holding the first pages of `tokens`, up to `pages`: stops at the first page not found."""
        self.extend(chain, tokens, page_size, pages)
        found = []
        for k in range(pages):
            entry = self.by_key.get(chain.keys[k])
            if entry is None or entry.hashed != self.hashed_of(chain, tokens, page_size, k):
                break
            found.append(entry.page)
        return found

    def register(self, page: int, key: bytes, hashed: tuple) -> None:
        """Cache `page` under `key`, unless the key already has its page (one page per hash: this one stays private,
        and nothing changes)."""
        if key in self.by_key:
            return
        if page in self.by_page:    # the pool's invariant: typed, so that `python -O` keeps it
            raise PoolInvariantError(f"page {page} is already cached (hash {short(self.by_page[page].key)})")
        entry = CachedPage(page, key, hashed)
        self.by_key[key] = entry
        self.by_page[page] = entry

    def key_of(self, page: int) -> bytes | None:
        entry = self.by_page.get(page)
        return entry.key if entry else None

    # -- the LRU of pages nobody holds ------------------------------------------------------------------------------
    def park(self, page: int) -> None:
        """A cached page's last holder let it go: it becomes the most recently used evictable page."""
        self.lru[page] = None

    def unpark(self, page: int) -> None:
        """A cached page got a holder (a hit): it can no longer be evicted."""
        self.lru.pop(page, None)

    def evict(self) -> int:
        """Drop the least recently used page nobody holds: its key goes; the caller poisons its slots."""
        page, _ = self.lru.popitem(last=False)
        entry = self.by_page.pop(page)
        del self.by_key[entry.key]
        self.evicted_keys[page] = entry.key
        self.evictions += 1
        return page

    def stats(self) -> dict:
        return dict(prefix_lookup_pages=self.lookups, prefix_hit_pages=self.hits,
                    prefix_hit_rate=self.hits / self.lookups if self.lookups else 0.0,
                    prefix_evictions=self.evictions, prefix_cached_pages=len(self.by_page))
