"""Typed errors. A bad request raises one of these at submit and nothing else changes: the engine keeps serving."""
from kernels.errors import ConfigError  # noqa: F401  (re-exported: defined at the bottom, see kernels/errors.py)


class RequestError(ValueError):
    """A request was refused at submit; the engine state is unchanged."""


class EmptyPromptError(RequestError):
    pass


class TokenOutOfVocabError(RequestError):
    pass


class ExceedsMaxPositionsError(RequestError):
    pass


class BadBudgetError(RequestError):
    pass


class NeverFitsError(RequestError):
    """The request needs more pages than the whole pool holds: it could never be admitted."""


class DuplicateRequestIdError(RequestError):
    pass


class BadPromptError(RequestError):
    """The prompt is not a one-dimensional sequence of integer token ids (a float, a bool, bytes, a string, a
    mapping, an array of another dimension); the message names the position and the type."""


class BadRequestIdError(RequestError):
    """A request id must be a non-empty string or an integer."""


class BadArrivalTimeError(RequestError):
    """An arrival time must be a finite real number of seconds on the engine's clock."""


class UnknownRequestError(RequestError, KeyError):
    """pop_result() of an id the engine does not hold (never submitted, or already popped)."""

    def __str__(self) -> str:       # KeyError's own __str__ would quote the message
        return str(self.args[0]) if self.args else ""


class RequestNotDoneError(RequestError):
    """pop_result() of a request still waiting or running (a cancelled one counts as running until the end of the
    step that retires it)."""


class PoolTooLargeError(ConfigError):
    """num_pages (or kv_cache_bytes) asks for a KV pool larger than the device's memory: refused before anything
    is allocated."""


class NoRoomError(RequestError):
    """Engine.score() found no room in the pool now: its pages are held by requests being served. Nothing changed;
    it fits the pool, so call it again once steps have freed pages."""


class PoolInvariantError(RuntimeError):
    """The page pool's bookkeeping broke one of its invariants (a bug, never bad input). Raised in every
    interpreter mode, `python -O` included."""


class PoisonedLogitsError(RuntimeError):
    """In poison mode a step produced non-finite logits: some kernel read a freed or never-written slot."""

    def __init__(self, step: int, rows: list, message: str, reader: str | None = None, slot: int | None = None,
                 page: int | None = None, owner: str | None = None, reads: list | None = None):
        super().__init__(message)
        self.step = step
        self.rows = rows
        self.reader = reader      # the first request with non-finite logits
        self.slot = slot          # a poisoned flat cache slot (page * page_size + offset) it read, if one was found
        self.page = page
        self.owner = owner        # whose that slot is or was, in words
        self.reads = reads or []  # every slot found, one per page


class WorkerError(RuntimeError):
    """A tensor-parallel worker rank died, hung or failed. The engine cannot go on: close it."""

    def __init__(self, ranks: list[int], message: str):
        super().__init__(message)
        self.ranks = ranks


class RankDisagreementError(RuntimeError):
    """Tensor-parallel ranks chose different tokens for the same row of a step: their greedy choices must agree."""

    def __init__(self, step: int, rows: list, message: str):
        super().__init__(message)
        self.step = step
        self.rows = rows


class EngineDeadError(RuntimeError):
    """The engine failed half-way through a step's bookkeeping (a bug, or a poisoned step) and its state can no
    longer be trusted: every later call raises this, naming the first cause (`.cause`, also `__cause__`), rather
    than serve a token that might be wrong. Make a new engine. An exception during a step's forward is not this:
    that step is undone and the next step() redoes it."""

    def __init__(self, message: str, cause: BaseException | None = None, step: int | None = None):
        super().__init__(message)
        self.cause = cause
        self.step = step
