"""The engine's request side: submit, cancel, pop a result, read the results, and the checks of a request's input.
Engine's own methods (engine/engine.py): a base class, so that the step and its recovery stay together there. What
it reads of the engine: its lock and Ctrl-C holder, requests, scheduler, pool, clock, shape and max_model_len."""
from __future__ import annotations

from . import errors, inputs
from .request import Request, RequestResult
from .scheduler import CancelResult


class RequestIntake:
    def submit(self, prompt, budget, request_id=None, arrival_time: float | None = None) -> str:
        """Queue a request and return its id; any thread may call it, also while another steps (it joins the queue
        for the next step's admission). Bad input raises a RequestError subclass and changes nothing.
        `prompt`: any iterable of token ids or a one-dimensional integer array, read once. `request_id`: a non-empty
        string or an integer, stored as its decimal string (7 and "7" are one id); None: "req-N", N counting up from 0
        past every id held. An id is in use until pop_result() releases it. `arrival_time`: seconds on the engine's
        clock (None: now)."""
        self.alive()
        rid = None if request_id is None else inputs.request_id_of(request_id)
        tokens, budget = self.validate(prompt, budget, rid or "request")
        at = None if arrival_time is None else inputs.arrival_of(arrival_time, rid or "request")
        with self.lock, self._sigint:   # a request is held and queued, or neither
            if rid is None:
                while f"req-{self._auto_id}" in self.requests:
                    self._auto_id += 1
                rid = f"req-{self._auto_id}"
            elif rid in self.requests:
                raise errors.DuplicateRequestIdError(f"request id {rid!r} is already in use")
            r = Request(rid, tokens, budget, self.now() if at is None else at)
            self.requests[rid] = r
            self.scheduler.add(r)
        return rid

    def validate(self, prompt, budget, request_id: str) -> tuple[list[int], int]:
        """(the prompt as a list of token ids, the budget as an int), or a RequestError. Reads no mutable state."""
        tokens = self.token_ids(prompt, request_id)
        budget = inputs.budget_of(budget, request_id)
        if len(tokens) + budget > self.max_model_len:
            raise errors.ExceedsMaxPositionsError(
                f"{request_id}: prompt ({len(tokens)}) + budget ({budget}) = {len(tokens) + budget} exceeds the "
                f"max positions served ({self.max_model_len}; the model's: {self.shape.max_positions})")
        self.pool.check_fits(request_id, len(tokens), budget)
        return tokens, budget

    def token_ids(self, prompt, who: str) -> list[int]:
        """The prompt as a non-empty list of token ids inside the vocabulary, or a RequestError naming `who`."""
        tokens = inputs.prompt_of(prompt, who)
        if not tokens:
            raise errors.EmptyPromptError(f"{who}: empty prompt")
        vocab = self.shape.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:     # at C speed; the loop only to name the first one outside
            i, t = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab)
            raise errors.TokenOutOfVocabError(f"{who}: prompt[{i}] = {t} is outside the vocabulary [0, {vocab})")
        return tokens

    def cancel(self, request_id) -> CancelResult:
        """Stop a request; any thread may call it, also while another steps. It keeps what it emitted and emits
        nothing more: a cancel that lands during a step's forward takes effect at the end of that step (its row's
        token is dropped); its pages return at the end of that step (or of the next one, between steps); nobody
        else's tokens change. An unknown, finished or already cancelled id is a no-op: CancelResult.outcome says
        which ("unknown", "already-finished", "already-cancelled"), .noop is True."""
        self.alive()
        rid = inputs.request_id_of(request_id)
        with self.lock, self._sigint:
            res = self.scheduler.cancel(rid, self.requests)
            if res.cancelled:
                self.requests[rid].finish_time = self.now()
        return res

    def pop_result(self, request_id) -> RequestResult:
        """Take a finished or cancelled request's result and forget the request (its record, its top-k records):
        the id can be submitted again. A request still waiting or running (a cancelled one until the end of the
        step that retires it) raises RequestNotDoneError; an id the engine does not hold, UnknownRequestError."""
        self.alive()
        rid = inputs.request_id_of(request_id)
        with self.lock, self._sigint:
            r = self.requests.get(rid)
            if r is None:
                raise errors.UnknownRequestError(f"no request {rid!r} (never submitted, or its result was popped)")
            if not r.done or any(x is r for x in self.scheduler.running):
                raise errors.RequestNotDoneError(
                    f"{rid} is {r.state.value}" + (" and holds its pages until the end of the step" if r.done
                                                    else "") + ": its result is not final yet")
            del self.requests[rid]
            self.topk.pop(rid, None)
            return RequestResult.of(r)

    def results(self) -> dict[str, RequestResult]:
        """Every request the engine holds (not popped), by id."""
        self.alive()
        with self.lock:
            return {rid: RequestResult.of(r) for rid, r in self.requests.items()}
