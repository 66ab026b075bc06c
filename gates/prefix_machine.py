"""The prefix cache's state machine (a gate library module): hypothesis drives PagePool(prefix_cache=True) and the
Scheduler through submits of prompts that share prefixes (built from a few page-sized blocks, exact repeats, next
turns that extend an earlier request's prompt and output), steps, cancellations (between steps and mid-step) and
drains, against a plain-Python model that knows every page's content by the tokens that wrote it.

After every rule (docs/DESIGN.md, "Prefix cache"):
- free + cached + owned = total (pool.check() and the model's count); a page's count equals its holders;
- no referenced page is evicted: no held page is evictable (in the LRU), every eviction takes a page nobody holds;
- no referenced or cached page is written: each position a step computes lands in an uncached page of its own;
- a hit holds the request's own prefix: every page found holds the prompt's tokens up to that page's end (a false
  hit fails here, whatever the hash);
- one page per hash; the pages cached are exactly the model's (the first page computed for each content);
- eviction in LRU order (pages whose last holder left longest ago first; a request's pages last page first);
- reservations exact: hits = the longest cached prefix of whole pages, at most (prompt - 1) // page_size; the rest
  from free pages, then from evictions;
- strict FCFS unchanged: arrival order, the head blocks the rest and waits only when rows or pages are short;
- the statistics: lookups = each admitted prompt's whole pages but its last position's, hits = the pages found;
- every request completes; afterwards nobody holds a page;
- the pages foreseen freed (engine/foresight.pages_freed_by, poison mode's look ahead, on a copy of the scheduler
  with its prefix cache) are the step's own, and the copy changes nothing real (gates/foresight_check.py).
A step's tokens are a function of the request's tokens so far, as a model's would be, so that equal prefixes
continue alike. `make_prefix_machine(pool_cls, scheduler_cls, page_size)` builds it for any classes, so that
tests/test_planted_prefix.py runs this very gate against planted bugs.
"""
from __future__ import annotations

from hypothesis import event, strategies as st
from hypothesis.stateful import initialize, rule

from engine.errors import PoolInvariantError
from engine.pool import PagePool
from engine.prefix_cache import short
from engine.request import Request
from engine.scheduler import Scheduler

from .foresight_check import ForesightWatch
from .prefix import stats_problems
from .prefix_model import (BLOCKS, COMPLETES, COUNT, EXACT, FCFS, LRU, ONE_PER_HASH, PLAN, REFERENCED, RESERVE,
                           RETURN, STATE, STATS, TOTAL, WRITTEN, Model, next_token)
from .stepping import PHASE_OF, SteppingMachine, check, violated


class PrefixCacheMachine(SteppingMachine):
    """The prefix cache machine without its setup and submit rule, whose strategies depend on the page size
    (make_prefix_machine)."""
    ps: int
    # -- the model's arithmetic --------------------------------------------------------------------------------
    def holders(self, page: int) -> list[str]:
        return [rid for rid in self.running if page in self.model[rid].table]

    def key(self, page: int) -> str:
        c = self.pool.cache
        return short(c.key_of(page) if page in c.by_page else c.evicted_keys.get(page))

    def describe_page(self, page: int) -> str:
        who = self.holders(page)
        last = self.last_holders.get(page)
        return (f"page {page} (hash {self.key(page)}; held by {who or 'nobody'}"
                + (f"; last held by {[f'{r} ({self.model[r].phase})' for r in last]}" if last and not who
                   else "")
                + (f"; computed by {self.writer[page]}" if page in self.writer else "") + ")")

    def expected_hits(self, m: Model) -> list[int]:
        out = []
        for k in range((len(m.prompt) - 1) // self.ps):
            page = self.page_of.get(tuple(m.prompt[:(k + 1) * self.ps]))
            if page is None:
                break
            out.append(page)
        return out

    def fits(self, m: Model, hits: list[int]) -> bool:
        need = -(-(len(m.prompt) + m.budget) // self.ps) - len(hits)
        return need <= self.free + len(self.lru) - sum(p in self.lru for p in hits)

    def add_request(self, prompt: list[int], budget: int) -> None:
        if -(-(len(prompt) + budget) // self.ps) > self.cap:
            event("never fits: not submitted (the admission gate covers it)")
            return
        rid = f"r{len(self.model)}"
        r = Request(rid, prompt, budget)
        self.sched.add(r)
        self.requests[rid] = r
        self.model[rid] = Model(rid, list(prompt), budget, tokens=list(prompt))
        self.queue.append(rid)
        self.live.add(rid)

    @rule(which=st.integers(0, 63), over=st.integers(0, 1))
    def submit_at_the_edge(self, which, over):
        """An earlier prompt again, with the budget that makes it fit the pool exactly as it stands (over=0) or miss
        by one page (over=1), counting its hits: the boundary of reserve on admit where cached pages nobody holds
        are both a request's hits and the pool's evictable room (a random budget seldom lands on it)."""
        self.busy = True
        if self.model and not self.queue:
            base = list(self.model.values())[which % len(self.model)]
            hits = self.expected_hits(base)
            room = self.free + len(self.lru) - sum(p in self.lru for p in hits)
            budget = (room + len(hits) + over) * self.ps - len(base.prompt)
            if budget >= 1:
                event(f"a prompt at the edge of the pool ({'one page over' if over else 'exact'})")
                self.add_request(list(base.prompt), budget)
        self.busy = False

    @rule(kind=st.sampled_from(["running", "waiting", "any"]), which=st.integers(0, 63))
    def cancel(self, kind, which):
        self.busy = True
        pools = {"running": [rid for rid in self.running if not self.model[rid].done], "waiting": self.queue,
                 "any": list(self.model)}
        candidates = pools[kind] or list(self.model)
        if candidates:
            rid = candidates[which % len(candidates)]
            m = self.model[rid]
            res = self.sched.cancel(rid, self.requests)
            self.foresight.disturb()        # a cancel during a step frees more than its end foresaw
            check(res.cancelled == (not m.done), STATE, lambda: f"cancel({rid}) of a {m.phase} request: {res}")
            if res.cancelled:
                event(f"cancel {m.phase}{' mid-step' if self.in_step else ''}")
                if m.phase == "waiting":
                    self.queue.remove(rid)
                m.phase = "cancelled"
        self.busy = False

    def begin_step(self):
        i = self.step_index
        try:
            plan = self.sched.schedule()
        except (KeyError, IndexError, PoolInvariantError) as e:
            raise violated(RESERVE, f"step {i}: schedule() raised {e!r} admitting {self.queue[:1]}: an admission "
                                    f"took pages the pool does not have (the model has {self.free} blank + "
                                    f"{len(self.lru)} evictable pages)") from e
        evicted = self.pool.take_evicted()
        self.in_step = True
        expected_evicted = []
        for r in plan.admitted:
            rid = r.request_id
            check(self.queue and rid == self.queue[0], FCFS,
                  lambda: f"step {i} admitted {rid} while {self.queue[:1]} waits ahead of it")
            m = self.model[rid]
            table = list(self.pool.owned.get(rid, []))
            h = r.cached_prefix // self.ps
            for k, page in enumerate(table[:h]):
                want = tuple(m.prompt[:(k + 1) * self.ps])
                got = self.content.get(page)
                check(got == want, EXACT,
                      lambda: f"step {i}: {rid} found {self.describe_page(page)} as its page {k}, but that page "
                              f"holds " + (f"positions [0, {len(got)}) ending {list(got[-self.ps:])}" if got else
                                           "no cached prefix") +
                              f" while {rid}'s prompt to that page's end is positions [0, {len(want)}) ending "
                              f"{list(want[-self.ps:])}: a false hit")
            hits = self.expected_hits(m)
            check(table[:h] == hits, RESERVE,
                  lambda: f"step {i}: {rid} (prompt {len(m.prompt)}) was admitted with hits {table[:h]}; the "
                          f"longest cached prefix of whole pages (at most {(len(m.prompt) - 1) // self.ps}) is {hits}")
            pages = -(-(len(m.prompt) + m.budget) // self.ps)
            check(len(table) == pages, RESERVE,
                  lambda: f"step {i}: {rid} holds {len(table)} pages {table}; prompt {len(m.prompt)} + budget "
                          f"{m.budget} needs {pages}, {h} of them found cached")
            # the model's reservation: pin the hits, then blank pages, then evict the least recently used
            self.lru = [p for p in self.lru if p not in hits]
            blank = min(self.free, pages - h)
            n_evict = pages - h - blank
            self.free -= blank
            gone, self.lru = self.lru[:n_evict], self.lru[n_evict:]
            for p in gone:
                self.page_of.pop(self.content.pop(p), None)
                self.writer.pop(p, None)
            expected_evicted += gone
            for p in table[h:]:
                check(not self.holders(p) and (p not in self.content or p in gone), REFERENCED,
                      lambda: f"step {i}: {rid} got {self.describe_page(p)} as a new page, but it is held or "
                              f"still cached")
            for what, seen in (("a hit", h), ("an eviction", n_evict),
                               ("a hit on a page decode tokens filled",
                                any(len(self.content[p]) > len(self.model[self.writer[p]].prompt) for p in hits)),
                               ("a hit on a page another request holds", any(self.holders(p) for p in hits))):
                if seen:
                    event(f"admission with {what}")
            self.queue.pop(0)
            m.phase, m.holds, m.table, m.registered, m.cached = "prefill", True, table, h, h * self.ps
            self.running.append(rid)
            check(len(self.running) <= self.max_batch, FCFS,
                  lambda: f"step {i}: {len(self.running)} requests hold rows, max_batch {self.max_batch}")
        for p in evicted:
            check(p in expected_evicted, REFERENCED,
                  lambda: f"step {i} evicted {self.describe_page(p)}, which the model holds referenced or "
                          f"not evictable; evictable pages, least recently used first: {self.lru}")
        check(evicted == expected_evicted, LRU,
              lambda: f"step {i} evicted pages {evicted} (hashes {[self.key(p) for p in evicted]}); least "
                      f"recently used first, it should have evicted {expected_evicted}")
        if self.queue and len(self.running) < self.max_batch:
            head = self.model[self.queue[0]]
            check(not self.fits(head, self.expected_hits(head)), FCFS,
                  lambda: f"step {i} left the head {head.rid} waiting although it fits ({self.free} blank + "
                          f"{len(self.lru)} evictable pages, it finds {self.expected_hits(head)})")
        self.check_writes(plan, i)
        self.check_plan(plan, i)
        tokens = [next_token(self.model[r.request_id].tokens) for r in plan.sampled]
        self.foresight.foresee(self.sched, plan)      # before the plan's bookkeeping, as Engine.step does
        plan.apply(tokens, 0.0)
        for c in plan.chunks:
            self.model[c.request.request_id].cached += c.length
        for r in plan.decodes:
            self.model[r.request_id].cached += 1
        for r, tok in zip(plan.sampled, tokens):
            m = self.model[r.request_id]
            m.tokens.append(tok)
            m.phase = "finished" if m.emitted == m.budget else "decode"
        self.stepped = {c.request.request_id for c in plan.chunks} | {r.request_id for r in plan.decodes}

    def check_writes(self, plan, i):
        writes = [(c.request.request_id, c.start, c.start + c.length) for c in plan.chunks] + \
                 [(r.request_id, r.num_cached, r.num_cached + 1) for r in plan.decodes]
        for rid, a, b in writes:
            table = self.pool.owned.get(rid, [])
            for k in range(a // self.ps, (b - 1) // self.ps + 1):
                page = table[k]
                check(self.holders(page) == [rid] and page not in self.content and
                      self.pool.refs.get(page) == 1, WRITTEN,
                      lambda: f"step {i}: {rid} writes positions [{a}, {b}) into {self.describe_page(page)} "
                              f"(its page {k}, count {self.pool.refs.get(page)}): a cached or shared page")

    def check_plan(self, plan, i):
        C, short_left = self.chunk_tokens, getattr(self.sched, "short_prompt_positions", 512)
        prefilling = [rid for rid in self.running if self.model[rid].phase == "prefill"]
        left = {rid: len(self.model[rid].prompt) - self.model[rid].cached for rid in prefilling}
        chunks, budget = [], C
        for rid in [r for r in prefilling if left[r] <= short_left] + \
                [r for r in prefilling if left[r] > short_left]:
            m = self.model[rid]
            n = min((m.cached // C + 1) * C, len(m.prompt)) - m.cached
            if n <= budget:
                chunks.append((rid, m.cached, n))
                budget -= n
        decodes = [rid for rid in self.running if self.model[rid].phase == "decode"]
        got = [(c.request.request_id, c.start, c.length) for c in plan.chunks]
        got_d = [r.request_id for r in plan.decodes]
        check(got == chunks and got_d == decodes, PLAN,
              lambda: f"step {i}: chunks {got}, decodes {got_d}; expected chunks {chunks} (from each prompt's "
                      f"first position not found cached), decodes {decodes}")

    def finish_step(self):
        i = self.step_index
        freed = self.sched.finish_step()
        self.foresight.check_freed(i, freed)
        # the model caches what the step completed, in admission order (the first page of a content wins)
        for rid in self.running:
            m = self.model[rid]
            if rid not in self.stepped:
                continue
            for k in range(m.registered, m.cached // self.ps):
                content, page = tuple(m.tokens[:(k + 1) * self.ps]), m.table[k]
                if content not in self.page_of:
                    self.page_of[content], self.content[page], self.writer[page] = page, content, rid
            m.registered = max(m.registered, m.cached // self.ps)
        retiring = [rid for rid in self.running if self.model[rid].done]
        count = {}
        for rid in self.running:
            for p in self.model[rid].table:
                count[p] = count.get(p, 0) + 1
        expected = []
        for rid in retiring:      # in release order, each request's pages last page first
            self.running.remove(rid)
            self.model[rid].holds = False
            for p in reversed(self.model[rid].table):
                self.last_holders[p] = [rid]
                count[p] -= 1
                if count[p]:
                    continue
                if p in self.content:
                    self.lru.append(p)
                else:
                    expected.append(p)
        self.free += len(expected)
        self.in_step = False
        self.step_index += 1
        self.check_counts()
        check(sorted(freed) == sorted(expected), RETURN,
              lambda: f"finish_step() of step {i} returned {sorted(freed)} as freed (to be poisoned); the "
                      f"retired requests {retiring} leave {sorted(expected)} uncached and unheld")

    def outstanding_steps(self) -> int:
        """Each step with work left computes at least one prompt position or decode token."""
        return sum(max(0, len(m.prompt) - m.cached) + m.budget - m.emitted + 1 for m in self.model.values()
                   if not m.done) + 2

    def check_drained(self, bound: int):
        left = [rid for rid, m in self.model.items() if not m.done]
        check(not self.sched.has_work and not left, COMPLETES,
              lambda: f"after {bound} more steps work is left: unfinished {left}, waiting "
                      f"{[r.request_id for r in self.sched.waiting]}, {self.pool.num_free} of {self.cap} "
                      f"pages free or evictable (a hang)")
        check(not self.pool.owned and not self.pool.refs and self.pool.num_free == self.cap, COMPLETES,
              lambda: f"every request is done, but pages are still held: owned {self.pool.owned}, counts "
                      f"{self.pool.refs}")

    def check_counts(self):
        for p in range(1, self.cap + 1):
            who = self.holders(p)
            check(self.pool.refs.get(p, 0) == len(who), COUNT,
                  lambda: f"{self.describe_page(p)} has count {self.pool.refs.get(p, 0)}, but "
                          f"{len(who)} requests hold it")

    def check_all(self):
        pool, cache = self.pool, self.pool.cache
        self.check_counts()
        for p in cache.lru:
            check(not self.holders(p), REFERENCED,
                  lambda: f"{self.describe_page(p)} is evictable (in the LRU) while requests hold it")
        check(list(cache.lru) == self.lru, LRU,
              lambda: f"evictable pages, least recently used first: {list(cache.lru)}; expected {self.lru} "
                      f"(released longest ago first, a request's pages last page first)")
        check(len(cache.by_key) == len(cache.by_page) and
              all(cache.by_key.get(e.key) is e for e in cache.by_page.values()), ONE_PER_HASH,
              lambda: f"{len(cache.by_key)} hashes for {len(cache.by_page)} cached pages")
        check(set(cache.by_page) == set(self.content), ONE_PER_HASH,
              lambda: f"cached pages {sorted(cache.by_page)}, expected {sorted(self.content)} (one page per "
                      f"content, the first computed); extra: "
                      f"{[self.describe_page(p) for p in set(cache.by_page) - set(self.content)]}")
        try:
            pool.check()
        except PoolInvariantError as e:
            raise violated(TOTAL, f"pool.check(): {e}") from None
        wrong = stats_problems(cache, self.requests.values(), self.ps)
        check(not wrong, STATS, lambda: wrong[0])
        held = {p for rid in self.running for p in self.model[rid].table}
        check(len(pool.free) == self.free and len(held) + self.free + len(self.lru) == self.cap, TOTAL,
              lambda: f"{len(pool.free)} free + {len(cache.lru)} cached + {len(held)} held; the model has "
                      f"{self.free} + {len(self.lru)} + {len(held)} of {self.cap}")
        for rid in self.running:
            check(pool.owned.get(rid) == self.model[rid].table, RESERVE,
                  lambda: f"{rid} holds {pool.owned.get(rid)}, it was given {self.model[rid].table}")
        check([r.request_id for r in self.sched.running] == self.running, FCFS,
              lambda: f"rows {[r.request_id for r in self.sched.running]}, expected {self.running}")
        check([r.request_id for r in self.sched.waiting] == self.queue, FCFS,
              lambda: f"waiting {[r.request_id for r in self.sched.waiting]}, expected {self.queue}")
        for rid in list(self.live):
            m, r = self.model[rid], self.requests[rid]
            got = (PHASE_OF[r.state], r.num_cached, r.prompt + r.output)
            check(got == (m.phase, m.cached, m.tokens), STATE,
                  lambda: f"{rid}: (state, num_cached) = {got[:2]}, expected {(m.phase, m.cached)}")
            if m.done and not m.holds:
                self.live.discard(rid)


def make_prefix_machine(pool_cls=PagePool, scheduler_cls=Scheduler, page_size: int = 4):
    """The prefix cache machine over `pool_cls` and `scheduler_cls`, with pages of `page_size` slots."""
    ps = page_size

    def block(b: int) -> list[int]:
        return [1 + b * ps + i for i in range(ps)]

    def tail(n: int, variant: int) -> list[int]:
        return [1000 + variant * 2 * ps + i for i in range(n)]

    class Machine(PrefixCacheMachine):
        @initialize(num_pages=st.integers(3, 14), max_batch=st.integers(1, 4),
                    chunk_tokens=st.integers(max(1, ps // 2), 3 * ps))
        def setup(self, num_pages, max_batch, chunk_tokens):
            self.busy = True
            self.ps = ps
            self.pool = pool_cls(num_pages, ps, prefix_cache=True)
            self.sched = scheduler_cls(self.pool, max_batch=max_batch, chunk_tokens=chunk_tokens)
            self.cap, self.max_batch, self.chunk_tokens = num_pages - 1, max_batch, chunk_tokens
            self.requests: dict[str, Request] = {}
            self.model: dict[str, Model] = {}
            self.queue, self.running, self.live = [], [], set()     # waiting; holding rows; not yet retired
            self.free = self.cap                         # blank pages
            self.lru: list[int] = []                     # cached pages nobody holds, least recently used first
            self.content: dict[int, tuple] = {}          # cached page -> the tokens from position 0 to its end
            self.page_of: dict[tuple, int] = {}          # content -> its cached page
            self.writer: dict[int, str] = {}             # cached page -> the request that computed it
            self.last_holders: dict[int, list[str]] = {}
            self.step_index = 0
            self.foresight = ForesightWatch(max_batch)     # its freed-pages check (the prefix cache's pages kept)
            self.busy = False


        @rule(kind=st.sampled_from(["fresh", "repeat", "extend"]),
              blocks=st.lists(st.integers(0, BLOCKS - 1), max_size=3),
              tail_len=st.one_of(st.sampled_from([0, 1, ps - 1, ps, ps + 1]), st.integers(0, 2 * ps)),
              variant=st.integers(0, 2), which=st.integers(0, 63), budget=st.integers(1, 2 * ps))
        def submit(self, kind, blocks, tail_len, variant, which, budget):
            """A prompt sharing prefixes with others: blocks + a tail, an exact repeat, or a next turn that
            extends an earlier request's prompt and what it emitted so far."""
            self.busy = True
            earlier = list(self.model.values())
            if kind != "fresh" and earlier:
                base = earlier[which % len(earlier)]
                prompt = list(base.prompt) if kind == "repeat" else list(base.tokens) + tail(tail_len, variant)
            else:
                prompt = [t for b in blocks for t in block(b)] + tail(tail_len, variant)
            prompt = prompt or tail(1, variant)
            self.add_request(prompt, budget)
            self.busy = False

    Machine.__name__ = Machine.__qualname__ = \
        f"PrefixCache_{pool_cls.__name__}_{scheduler_cls.__name__}_page{page_size}"
    return Machine
