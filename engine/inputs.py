"""What a caller may submit, checked and normalised before it reaches the engine's state: request ids, prompts,
budgets and arrival times. A bad value raises a RequestError subclass naming it. No tensors: arrays are read through
their `ndim` and `tolist()`."""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Set

from . import errors

# containers whose iteration would give something other than token ids (characters, bytes' values, keys) or no
# order (sets): a caller passing one made a mistake, not a prompt
NOT_PROMPTS = ((str, "text, not token ids"), ((bytes, bytearray, memoryview), "bytes, not token ids"),
               (Mapping, "a mapping (iterating it gives its keys)"), (Set, "a set (it has no order)"))


def kind(x) -> str:
    """A value's type for messages: `float`, `numpy.float32`, `torch.Tensor`."""
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__.split('.')[0]}.{t.__name__}"


def request_id_of(x) -> str:
    """A non-empty string, or an integer stored as its decimal string (7 and "7" are the same id)."""
    if isinstance(x, str):
        if x:
            return x
    elif not isinstance(x, bool) and not is_bool_dtype(x):
        try:
            return str(operator.index(x))
        except TypeError:
            pass
    raise errors.BadRequestIdError(f"request id must be a non-empty string or an integer, got {x!r} ({kind(x)})")


def is_bool_dtype(x) -> bool:
    """numpy and torch booleans pass operator.index in some versions: they are still not integers here."""
    return "bool" in str(getattr(x, "dtype", ""))


def token_id(t, where: str, also: str = "") -> int:
    if not isinstance(t, bool) and not is_bool_dtype(t) and not isinstance(t, (str, bytes)):
        try:
            return operator.index(t)
        except TypeError:
            pass
    raise errors.BadPromptError(f"{where} = {t!r} ({kind(t)}) is not a token id: token ids are integers{also}")


def prompt_of(prompt, rid: str) -> list[int]:
    """The prompt as a list of ints, read once (a generator is consumed here, and only here). Any iterable of
    integers, or a one-dimensional integer array (numpy, torch)."""
    if type(prompt) is list and set(map(type, prompt)) <= {int}:
        # the usual prompt, checked at C speed (a bool's type is not int): per token, the general path below costs
        # about 0.5 us, which at the 1.5B bench's 320k prompt positions delayed the first step by 0.1 s
        return list(prompt)
    for types, why in NOT_PROMPTS:
        if isinstance(prompt, types):
            raise errors.BadPromptError(f"{rid}: prompt is {why} ({kind(prompt)}); give a list or a one-dimensional "
                                        f"integer array of token ids")
    ndim = getattr(prompt, "ndim", None)
    also = ""
    if ndim is not None:
        shape = tuple(getattr(prompt, "shape", ()))
        if ndim != 1:
            raise errors.BadPromptError(f"{rid}: prompt is a {ndim}-dimensional {kind(prompt)} of shape {shape}; "
                                        f"give one request's token ids in one dimension")
        also = f" (the prompt is a {kind(prompt)} of dtype {getattr(prompt, 'dtype', '?')})"
        prompt = prompt.tolist()
    if not isinstance(prompt, Iterable):
        raise errors.BadPromptError(f"{rid}: prompt must be a sequence of token ids, got {kind(prompt)}")
    return [token_id(t, f"{rid}: prompt[{i}]", also) for i, t in enumerate(prompt)]


def budget_of(budget, rid: str) -> int:
    try:
        n = None if isinstance(budget, bool) or is_bool_dtype(budget) else operator.index(budget)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise errors.BadBudgetError(f"{rid}: generation budget must be an integer >= 1, got {budget!r}")
    return n


def arrival_of(t, rid: str) -> float:
    """Seconds on the engine's clock: a finite real number."""
    if isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(float(t)):
        return float(t)
    raise errors.BadArrivalTimeError(f"{rid}: arrival_time must be a finite number of seconds on the engine's "
                                     f"clock, got {t!r} ({kind(t)})")
