"""What users' clients do on the request side while an engine serves, and the checks that it moved nothing else:
cancels at every point of a step, requests refused at submit, results asked for too early. Driven between steps and
through the engine's step hook (engine/engine.py: STEP_POINTS), so a call lands during a step's forward and while the
step after it is launched ahead, as a call from another thread would. Used by gates/test_requests.py (every engine
configuration as served) and the prefill share's cancellation gate (gates/test_prefill_share.py)."""
from __future__ import annotations

from engine import errors, foresight
from engine.engine import Engine
from engine.request import State

from .prefill_share_check import assert_no_problems, check_identical
from .schedule_check import engine_problems, provenance_problems, topk_problems

# after which step (its index) a request is cancelled, and which: the first request the predicate takes
CANCELS = {
    2: ("waiting", lambda r: r.state is State.WAITING),
    3: ("mid-prefill", lambda r: r.state is State.PREFILL and r.num_cached > 0),
    5: ("mid-decode", lambda r: r.state is State.DECODE and len(r.output) >= 2),
    9: ("mid-prefill", lambda r: r.state is State.PREFILL and r.num_cached > 0),
    14: ("admitted, no chunk yet", lambda r: r.state is State.PREFILL and r.num_cached == 0),
    20: ("mid-decode", lambda r: r.state is State.DECODE and len(r.output) >= 5),
}
FORWARD_CANCELS = range(6, 30)     # the first of these steps with a decode row left cancels one during its forward
# the cancels a run must have made, or it proves nothing about them
BETWEEN_STEPS = {"waiting", "mid-prefill", "mid-decode"}
DURING_FORWARD = {"during the forward", "during its first decode step's forward"}
AHEAD = "while the step after it is launched ahead"
REFUSE_BETWEEN = 1                 # after this step (requests waiting and rows running), every refusal is tried


def snapshot(e: Engine) -> tuple:
    """What a refused call must leave as it was: the requests held and their prompts, the queue, the running rows, the
    pool's pages and owners, the arrival count, the step count."""
    return (sorted(e.requests), [r.request_id for r in e.scheduler.waiting],
            [r.request_id for r in e.scheduler.running], e.pool.num_free,
            {k: list(v) for k, v in e.pool.owned.items()}, e.scheduler.next_arrival, e.scheduler.step_index,
            {rid: (list(r.prompt), r.budget, r.state, len(r.output)) for rid, r in e.requests.items()})


def refusals(e: Engine) -> list[tuple[str, type, str, dict]]:
    """(what, the error it must raise, words its message must hold, submit's arguments): one of each way the engine
    refuses a request at submit, sized by this engine (its vocabulary, max positions, pool). Each gets an id of its
    own (unused), but the id case."""
    vocab = e.shape.vocab_size
    running = e.scheduler.running[0].request_id if e.scheduler.running else next(iter(e.requests))
    out = [
        ("an empty prompt", errors.EmptyPromptError, "empty prompt", dict(prompt=[], budget=3)),
        # after both ends of the vocabulary, which are token ids: the message names the first token outside it
        ("a token past the vocabulary", errors.TokenOutOfVocabError, f"prompt[2] = {vocab} is outside the vocabulary",
         dict(prompt=[0, vocab - 1, vocab], budget=3)),
        ("a negative token", errors.TokenOutOfVocabError, "prompt[0] = -1 is outside the vocabulary",
         dict(prompt=[-1, 6], budget=3)),
        ("a token that is not an integer", errors.BadPromptError, "prompt[1] = 2.5 (float) is not a token id",
         dict(prompt=[5, 2.5], budget=3)),
        ("a budget of 0", errors.BadBudgetError, "got 0", dict(prompt=[5, 6], budget=0)),
        ("a request past the max positions", errors.ExceedsMaxPositionsError,
         f"= {e.max_model_len + 1} exceeds the max positions served ({e.max_model_len}",
         dict(prompt=[1] * e.max_model_len, budget=1)),
        ("an id in use", errors.DuplicateRequestIdError, f"{running!r} is already in use",
         dict(prompt=[5, 6], budget=3, request_id=running)),
        ("an empty id", errors.BadRequestIdError, "got ''", dict(prompt=[5, 6], budget=3, request_id="")),
        ("an arrival time of nan", errors.BadArrivalTimeError, "got nan",
         dict(prompt=[5, 6], budget=3, arrival_time=float("nan"))),
    ]
    slots = e.pool.capacity * e.pool.page_size
    if slots < e.max_model_len:     # else the max positions refuse it first
        out.append(("a request larger than the whole pool", errors.NeverFitsError, "it could never be admitted",
                    dict(prompt=[1] * slots, budget=1)))
    for i, (what, err, words, kw) in enumerate(out):
        kw.setdefault("request_id", f"refused-{i}")
    return out


def score_refusals(e: Engine) -> list[tuple[str, type, str, list]]:
    """(what, the error it must raise, words its message must hold, the tokens): one of each way Engine.score()
    (teacher forcing) refuses a sequence, sized by this engine. Each message names "score" as submit's names the
    request."""
    vocab, n = e.shape.vocab_size, e.max_model_len + 1
    out = [
        ("an empty sequence", errors.EmptyPromptError, "score: empty prompt", []),
        ("a token past the vocabulary", errors.TokenOutOfVocabError,
         f"score: prompt[1] = {vocab} is outside the vocabulary", [vocab - 1, vocab]),
        ("a negative token", errors.TokenOutOfVocabError, "score: prompt[0] = -1 is outside the vocabulary", [-1, 6]),
        ("a token that is not an integer", errors.BadPromptError, "score: prompt[1] = 2.5 (float) is not a token id",
         [5, 2.5]),
        # one past the edge: exactly the max positions is served (Traffic.score_at)
        ("a sequence past the max positions", errors.ExceedsMaxPositionsError,
         f"score: {n} positions exceed the max positions served ({e.max_model_len}", [1] * n),
    ]
    slots = e.pool.capacity * e.pool.page_size
    if slots < e.max_model_len:     # else the max positions refuse it first
        out.append(("a sequence larger than the whole pool", errors.NeverFitsError,
                    f"score: needs {e.pool.capacity + 1} pages of {e.pool.page_size} slots (prompt {slots + 1} + "
                    f"budget 0)", [1] * (slots + 1)))
    return out


def unpoisoned_freed_pages(e: Engine, plan) -> list[int]:
    """In poison mode, while the step after `plan`'s is launched ahead: the pages `plan`'s end frees (as the
    scheduler foresees it, engine/foresight.py) that are not NaN in every layer's K and V. The engine poisons them
    before that launch, as it would between two serial steps; left finite, a step launched ahead that reads one reads
    stale values unseen. (Off poison mode, or a runner without its caches here: nothing to check.)"""
    caches = getattr(e.runner, "kv_caches", None)
    if not e.config.poison or not caches:
        return []
    pages = foresight.pages_freed_by(e.scheduler, plan)
    return [p for p in pages if not all(t[p].isnan().all() for kv in caches for t in kv)]


class Traffic:
    """Cancels (CANCELS between steps, two in FORWARD_CANCELS during a forward, and where the engine launches steps
    ahead one while such a step is in flight) and, with `refuse`, every refusal and early call between steps, during
    a forward, while a step launched ahead is in flight and after the last step. engine() builds the engine with
    this traffic's hook, serve() drives it to the end, check() says what moved."""

    def __init__(self, refuse: bool = False, label: str = ""):
        self.refuse, self.label = refuse, label
        self.e: Engine | None = None
        self.cancelled: dict[str, tuple[str, int]] = {}     # request id -> (where, tokens it had emitted)
        self.refused: set[str] = set()                      # where the refusals were tried
        self.tried: set[str] = set()                        # which refusals (refusals(): what)
        self.problems: list[str] = []

    def engine(self, ref) -> Engine:
        """An engine of `ref`'s configuration (gates/reference.EngineReference) whose step hook is this traffic."""
        self.e = ref.engine(step_hook=self.hook)
        return self.e

    # -- the calls --------------------------------------------------------------------------------------------
    def cancel(self, r, where: str) -> None:
        res = self.e.cancel(r.request_id)
        if not (res.cancelled and not res.noop and res.emitted == len(r.output)):
            self.problems.append(f"cancel({r.request_id!r}) {where}: {res}, expected cancelled after "
                                 f"{len(r.output)} tokens")
        self.cancelled[r.request_id] = (where, len(r.output))
        if self.refuse and where in DURING_FORWARD | {AHEAD}:
            self.refused_call("pop_result of a request cancelled during the step", where, errors.RequestNotDoneError,
                              f"{r.request_id} is cancelled and holds its pages until the end of the step",
                              lambda: self.e.pop_result(r.request_id))

    def refuse_all(self, where: str) -> None:
        """Every refusal, each checked to raise its typed error naming the cause and to change nothing; then the
        early calls: a running request's result, an unknown id's result, an unknown id's cancel."""
        e = self.e
        self.refused.add(where)
        known = len(self.problems)
        for what, err, words, kw in refusals(e):
            self.tried.add(what)
            # the message names the request as well as the cause (but where the id itself is refused)
            self.refused_call(f"submit with {what}", where, err, (words, kw["request_id"]), lambda: e.submit(**kw))
        # score() checks its sequence before it waits for the step in flight: refused at once, wherever it is asked
        for what, err, words, tokens in score_refusals(e):
            self.tried.add(f"score of {what}")
            self.refused_call(f"score of {what}", where, err, words, lambda: e.score(tokens))
        running = next((r for r in e.scheduler.running if not r.done), None)
        if running is not None:
            self.refused_call("pop_result of a running request", where, errors.RequestNotDoneError,
                              f"{running.request_id} is {running.state.value}: its result is not final yet",
                              lambda: e.pop_result(running.request_id))
        self.refused_call("pop_result of an unknown id", where, errors.UnknownRequestError, "no request 'nobody'",
                          lambda: e.pop_result("nobody"))
        before = snapshot(e)
        res = e.cancel("nobody")
        if not (res.noop and res.outcome == "unknown" and not res.cancelled) or snapshot(e) != before:
            self.problems.append(f"cancel of an unknown id {where}: {res}, "
                                 f"{'the engine changed' if snapshot(e) != before else 'not a no-op'}")
        if len(self.problems) > known:
            # now: a request accepted that must not be (a token past the vocabulary) would fail the steps after it
            # with an error of its own, far from its cause
            assert_no_problems(self.problems[known:], f"{self.label}: refused calls {where}")

    def score_at(self, n: int, what: str) -> None:
        """Between steps: score() of `n` positions (the last one's logits) is served, and leaves the engine as it
        was: the edge that score_refusals' sequence one longer is refused past."""
        e = self.e
        before = snapshot(e)
        try:
            logits = e.score([1] * n, last_only=True)
        except errors.RequestError as x:
            self.problems.append(f"score of {what} ({n} positions): refused with {type(x).__name__} ({x}), expected "
                                 f"served")
            return
        if tuple(logits.shape) != (1, e.shape.vocab_size) or not bool(logits.isfinite().all()):
            self.problems.append(f"score of {what} ({n} positions): logits of shape {tuple(logits.shape)}, finite: "
                                 f"{bool(logits.isfinite().all())}; expected [1, {e.shape.vocab_size}], finite")
        if snapshot(e) != before:
            self.problems.append(f"score of {what} ({n} positions): the engine changed")

    def refused_call(self, what: str, where: str, err: type, words: str | tuple[str, ...], call) -> None:
        """`call()` must raise `err`, a RequestError whose message holds `words` (each of them), and change
        nothing (snapshot)."""
        words = (words,) if isinstance(words, str) else words
        before = snapshot(self.e)
        try:
            call()
        except errors.RequestError as x:
            if not isinstance(x, err):
                self.problems.append(f"{what} {where}: raised {type(x).__name__} ({x}), expected {err.__name__}")
            elif not all(w in str(x) for w in words):
                self.problems.append(f"{what} {where}: {err.__name__} says {str(x)!r}, which does not name the "
                                     f"cause and the request ({' and '.join(map(repr, words))})")
        except Exception as x:     # noqa: BLE001 (any other error is the finding)
            self.problems.append(f"{what} {where}: raised {type(x).__name__} ({x}), not a RequestError "
                                 f"({err.__name__})")
        else:
            self.problems.append(f"{what} {where}: accepted, expected {err.__name__}")
        after = snapshot(self.e)
        if after != before:
            moved = [name for name, a, b in zip(("requests", "waiting", "running", "free pages", "owned pages",
                                                 "arrival count", "step count", "requests' prompts"), before, after)
                     if a != b]
            self.problems.append(f"{what} {where}: refused, but the engine changed: {', '.join(moved)}")

    # -- when ---------------------------------------------------------------------------------------------------
    def hook(self, point: str) -> None:
        e = self.e
        plan = e.scheduler.plan
        if plan is None or plan.index < FORWARD_CANCELS.start:
            return
        if point == "launched" and plan.index in FORWARD_CANCELS:
            if self.refuse and "during a forward" not in self.refused:
                self.refuse_all("during a forward")
            for where, pred in (("during its first decode step's forward", lambda n: n == 1),
                                ("during the forward", lambda n: n >= 2)):
                if where in self.wheres():
                    continue
                r = next((r for r in plan.decodes if r.request_id not in self.cancelled and pred(len(r.output))),
                         None)
                if r is not None:
                    self.cancel(r, where)
                    return          # one a step
        if point == "launched-ahead":
            left = unpoisoned_freed_pages(e, plan)
            if left:
                self.problems.append(f"step {plan.index}: pages {left}, which its end frees, were not poisoned before "
                                     f"the step launched after it, which poison mode must catch reading them")
            if self.refuse and "while a step launched ahead is in flight" not in self.refused:
                self.refuse_all("while a step launched ahead is in flight")
            if AHEAD not in self.wheres():
                # a row of this step that the step launched after it decodes too (it emits more than one more token)
                r = next((r for r in plan.decodes if r.request_id not in self.cancelled and r.state is State.DECODE
                          and len(r.output) >= 2 and len(r.output) + 2 < r.budget), None)
                if r is not None:
                    self.cancel(r, AHEAD)

    def after_step(self) -> None:
        e = self.e
        index = e.trace[-1].index
        if self.refuse and index == REFUSE_BETWEEN:
            self.refuse_all("between steps")
        if index in CANCELS:
            where, pred = CANCELS[index]
            r = next((r for r in e.requests.values() if pred(r) and r.request_id not in self.cancelled), None)
            if r is not None:
                self.cancel(r, where)

    def wheres(self) -> set[str]:
        return {w for w, _ in self.cancelled.values()}

    def serve(self, specs) -> Engine:
        """Submit `specs`, step to the end with this traffic; a cancelled request's pages must be back at the end
        of the step after its cancel."""
        e = self.e
        for s in specs:
            e.submit(s.prompt, s.budget, s.request_id)
        while e.scheduler.has_work:
            # cancelled before this step (between steps, or during the one before): no page left after it
            just = [rid for rid in self.cancelled if rid in e.pool.owned]
            e.step()
            for rid in just:
                if rid in e.pool.owned:
                    self.problems.append(f"{rid}: cancelled ({self.cancelled[rid][0]}) before step "
                                         f"{e.trace[-1].index}, still owns pages after it")
            self.after_step()
        if self.refuse:
            self.refuse_all("after the last step")
        return e

    # -- what moved ---------------------------------------------------------------------------------------------
    def check(self, full: dict, whole: bool = False) -> list[str]:
        """Problems (empty: none): `full`, the results of the same configuration's run without this traffic. A
        cancelled request keeps exactly a prefix of its tokens and chunks there, every other request's are identical,
        the pool is whole, no-op cancels say so; the cancels and refusals this run owed were made. `whole`: every
        scheduling invariant of the run (gates/schedule_check.py), else provenance and top-k only."""
        e, problems, label = self.e, list(self.problems), self.label
        ahead = e.overlap       # the engine launches steps ahead: one of them must have seen a cancel
        owed = BETWEEN_STEPS | DURING_FORWARD | ({AHEAD} if ahead else set())
        if not owed <= self.wheres():
            problems.append(f"{label}: the workload gave no chance to cancel {sorted(owed - self.wheres())} "
                            f"(cancelled: {self.cancelled}), so this run proves nothing about those")
        if self.refuse:
            points = {"between steps", "during a forward", "after the last step"} | \
                ({"while a step launched ahead is in flight"} if ahead else set())
            if not points <= self.refused:
                problems.append(f"{label}: no refusal was tried {sorted(points - self.refused)}")
        if e.pool.num_free != e.pool.capacity or e.pool.owned:
            problems.append(f"{label}: pages leaked after the cancels ({e.pool.capacity - e.pool.num_free} held, "
                            f"owners {sorted(e.pool.owned)})")
        e.pool.check()
        done = next((r for r in e.requests.values() if r.state is State.FINISHED), None)
        some = next(iter(self.cancelled), None)
        for rid, outcome in [("nobody", "unknown"), (done and done.request_id, "already-finished"),
                             (some, "already-cancelled")]:
            if rid is None:
                continue
            res = e.cancel(rid)
            if not (res.outcome == outcome and res.noop and not res.cancelled):
                problems.append(f"{label}: cancel({rid!r}) gave {res}, expected the no-op {outcome!r}")
        if done is not None and e.requests[done.request_id].state is not State.FINISHED:
            problems.append(f"{label}: a no-op cancel changed {done.request_id}'s state")
        res = e.results()
        for rid, r in res.items():
            f = full[rid]
            if rid in self.cancelled:
                where, n = self.cancelled[rid]
                if r.state != "cancelled" or len(r.tokens) != n:
                    problems.append(f"{rid} (cancelled {where} after {n} tokens) is {r.state} with {len(r.tokens)}")
                if r.tokens != f.tokens[:len(r.tokens)] or r.chunks != f.chunks[:len(r.chunks)]:
                    problems.append(f"{rid} (cancelled {where}): its tokens/chunks are not a prefix of the "
                                    f"uncancelled run's: {r.tokens[:8]} / {r.chunks[:4]} vs {f.tokens[:8]} / "
                                    f"{f.chunks[:4]}")
            else:
                problems += check_identical({rid: f}, {rid: r}, "without the traffic", "with it")
        if sorted(res) != sorted(full):
            problems.append(f"{label}: served {sorted(set(full) ^ set(res))} on one side only")
        if whole:
            problems += engine_problems(e)
        else:      # cancelled ones too, waiting ones included; record mode: a top-k entry per emitted token
            problems += provenance_problems(e.requests.values(), e.trace) + topk_problems(e)
        return problems

    def pop_all(self) -> list[str]:
        """After check(), as a server takes its results: each request's result popped is what results() listed, the
        engine forgets it (its top-k too; a second pop is UnknownRequestError), and the ids are free again: a popped
        id and an automatic one are served anew to their budgets, a result is popped while another request runs, a
        waiting one's is refused. Problems (empty: none)."""
        e, label, known = self.e, self.label, len(self.problems)
        held, problems = e.results(), []
        for rid, want in held.items():
            got = e.pop_result(rid)
            if got != want:
                problems.append(f"{label}: pop_result({rid!r}) gave {got}, results() listed {want}")
        if e.results() or e.topk:
            problems.append(f"{label}: after every pop the engine still holds results {sorted(e.results())} and "
                            f"top-k records {sorted(e.topk)}")
        rid = next(iter(held))
        self.refused_call("pop_result of a popped id", "after the pops", errors.UnknownRequestError,
                          f"no request {rid!r}", lambda: e.pop_result(rid))
        # served anew: a popped id; an explicit "req-0" (decoding longer) beside an automatic id, which must take
        # another; prompts of both ends of the vocabulary; and a request of exactly the max positions, accepted
        # (and cancelled while it waits)
        vocab = e.shape.vocab_size
        # the engine's first automatic id is "req-0" (submit's promise: N counts from 0), cancelled and popped at once
        first = e.submit([0, vocab - 1, 5], 2)
        if first != "req-0":
            problems.append(f"{label}: the engine's first automatic id is {first!r}, not 'req-0'")
        e.cancel(first)
        e.pop_result(first)
        again = e.submit(held[rid].prompt, 2, request_id=rid)
        longer = e.submit([vocab - 1, 0, 5], 6, request_id="req-0")
        auto = e.submit([0, vocab - 1, 5], 2)
        if auto in (again, longer):
            problems.append(f"{label}: an automatic id took {auto!r}, which a request already held")
        elif auto != "req-1":   # the counter's next id past the explicit "req-0"
            problems.append(f"{label}: the automatic id beside an explicit 'req-0' is {auto!r}, not 'req-1'")
        edge = e.submit([1] * (e.max_model_len - 1), 1, request_id="max-positions")
        self.refused_call("pop_result of a waiting request", "after the pops", errors.RequestNotDoneError,
                          f"{auto} is waiting: its result is not final yet", lambda: e.pop_result(auto))
        if not e.cancel(edge).cancelled:
            problems.append(f"{label}: a request of exactly the max positions, waiting, was not cancelled")
        popped = {}
        while e.scheduler.has_work:
            e.step()
            if again not in popped and e.requests[again].done and \
                    any(x.request_id == longer for x in e.scheduler.running):
                popped[again] = e.pop_result(again)      # finished while another request still runs
        if again not in popped:
            problems.append(f"{label}: {again!r} (2 tokens) did not finish before 'req-0' (6 tokens)")
        for r, n in ((again, 2), (longer, 6), (auto, 2), (edge, 0)):
            res = popped.get(r) or e.pop_result(r)
            if res.state != ("cancelled" if r == edge else "finished") or len(res.tokens) != n:
                problems.append(f"{label}: {r!r}, submitted after the pops, ended {res.state} with {len(res.tokens)} "
                                f"of {n} tokens")
        if e.requests or e.pool.num_free != e.pool.capacity or e.pool.owned:
            problems.append(f"{label}: after the last pop the engine holds requests {sorted(e.requests)}, "
                            f"{e.pool.capacity - e.pool.num_free} pages")
        return problems + self.problems[known:]
