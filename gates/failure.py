"""GateFailure: the one failure that gate checks outside test modules raise."""
from __future__ import annotations


class GateFailure(AssertionError):
    """A gate check failed; the message names the broken invariant and its values.

    Library modules raise it rather than `assert`: pytest rewrites the asserts of test modules and conftest files
    only, and `python -O` drops every other assert, so a check written as one would let its bug through. It is an
    AssertionError, so pytest reports it as a failed check and `pytest.raises(AssertionError)` still catches it."""
