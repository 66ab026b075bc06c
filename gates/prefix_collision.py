"""The prefix cache's collision guard, as a gate library: hash collisions forced on purpose, and no false hit from them.

A page's key is blake2b-128 of (its parent page's key, its token ids); a hit also compares that pair (the `hashed`
record), so that a key collision cannot hand out a page whose own content differs (engine/prefix_cache.py). No run
ever meets a real blake2b-128 collision, so without forcing one the guard is never exercised: a mutation campaign
showed that breaking it (comparing no token ids, comparing the page's own key for its parent's) or going on past a
missed page (`continue` for `break`) passed every other gate. Here a cache whose key() returns a chosen key for
chosen inputs makes two collisions, each of one page only (a collision of a parent's key would also collide its
children's keys, which the design rules out by the hash's width, not by the guard):

- **own tokens differ**: X = A B C is served and cached; Y = A B' C, where (key(A), B') is forced onto key(A B).
  Y must find page A alone: its page 1 collides (a different page under the same parent) and page 2, whose key
  follows from the collided one, must not be looked at past the miss.
- **parent differs**: X = A and Z = A2 B are cached; Y = A B, where (key(A), B) is forced onto key(A2 B). Y must find
  page A alone: the cached page 1 has Y's ids but another parent.

Both run through the page pool and the scheduler the engine serves with (any classes: tests plant bugs into them);
each step's tokens are a function of the request's tokens, as a greedy model's are.
"""
from __future__ import annotations

from engine.pool import PagePool
from engine.prefix_cache import ROOT, PrefixCache, short
from engine.request import Request
from engine.scheduler import Scheduler

from .failure import GateFailure

PS = 4          # slots per page: pages of a few tokens keep the scenarios readable


def block(first: int) -> tuple[int, ...]:
    return tuple(range(first, first + PS))


A, A2, B, B2, C = block(10), block(20), block(30), block(40), block(50)


def colliding(cache_cls: type[PrefixCache]) -> type[PrefixCache]:
    class Colliding(cache_cls):
        """key() of a chosen (parent key, token ids) input is a chosen key: a collision made on purpose."""
        forced: dict[tuple, bytes] = {}

        def key(self, hashed: tuple) -> bytes:
            return self.forced.get(hashed) or super().key(hashed)
    return Colliding


def serve(sched, pool, requests: list[Request], steps: int = 200) -> None:
    for r in requests:
        sched.add(r)
    for _ in range(steps):
        if not sched.has_work:
            return
        plan = sched.schedule()
        pool.take_evicted()
        plan.apply([7 + sum(r.prompt + r.output) % 5 for r in plan.sampled], 0.0)
        sched.finish_step()
    raise GateFailure(f"the collision scenario did not finish in {steps} steps (a hang)")


def scenario(name: str, cached: list[tuple], forced: tuple[tuple, tuple], probe: tuple, want_pages: int,
             pool_cls, scheduler_cls, cache_cls) -> list[str]:
    """Serve `cached` (each prompt + one token), then force key(forced[0] input) onto key(forced[1] prefix), then
    serve `probe`: it must find exactly its first `want_pages` pages, each holding its own prefix."""
    pool = pool_cls(16, PS, prefix_cache=True)
    cache = pool.cache = colliding(cache_cls)()
    cache.forced = {}
    sched = scheduler_cls(pool, max_batch=1, chunk_tokens=4 * PS)

    def key_of(prefix: tuple) -> bytes:
        parent = ROOT
        for k in range(len(prefix) // PS):
            parent = cache.key(cache.hash_input(parent, prefix[k * PS:(k + 1) * PS]))
        return parent

    content: dict[int, tuple] = {}
    for i, prompt in enumerate(cached):
        r = Request(f"{name}-cached{i}", list(prompt) + [1], 1)
        serve(sched, pool, [r])
        for k, page in enumerate(r.pages[:len(prompt) // PS]):
            content.setdefault(page, prompt[:(k + 1) * PS])
    (parent_prefix, ids), onto = forced
    cache.forced = {cache.hash_input(key_of(parent_prefix), ids): key_of(onto)}
    y = Request(f"{name}-probe", list(probe) + [2], 1)
    serve(sched, pool, [y])
    found = y.pages[:y.cached_prefix // PS]
    got = [content.get(p) for p in found]
    want = [probe[:(k + 1) * PS] for k in range(want_pages)]
    if got != want:
        return [f"a forced hash collision ({name}: key({short(key_of(parent_prefix))}, {list(ids)}) made equal to the "
                f"key of prefix {list(onto)}) gave a false hit: {y.request_id} (prompt {list(probe)}) found pages "
                f"{found} holding prefixes {got}; it should find its first {want_pages} page(s) {want}: a hit must "
                f"compare the parent key and the page's own ids, and stop at the first page not found"]
    try:
        pool.check()
    except Exception as e:      # the pool's invariants, named by its own message
        return [f"{name}: the pool broke after a forced collision: {e}"]
    return []


def collision_problems(pool_cls=PagePool, scheduler_cls=Scheduler, cache_cls=PrefixCache) -> list[str]:
    """Both scenarios; each problem names the collision, what the probe found and what it should have."""
    parts = (pool_cls, scheduler_cls, cache_cls)
    return (scenario("own tokens differ", [A + B + C], ((A, B2), A + B), A + B2 + C, 1, *parts) +
            scenario("parent differs", [A, A2 + B], ((A, B), A2 + B), A + B, 1, *parts))
