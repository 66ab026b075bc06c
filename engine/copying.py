"""Copies of bookkeeping objects for a look ahead: engine/foresight.py runs a step's end on a deep copy of the
scheduler every step launched ahead in poison mode (every flash gate run). Most of what it copies is lists, deques
and dicts of page ids, token ids and owner names, which `copy.deepcopy` walks one element at a time in Python (on
the H200: 3,300 objects a copy, the largest part of a flash gate run's host time under the profiler, session 23).
`copy_fields` rebuilds such containers itself (a flat one of atoms in one C call); objects are deep-copied as
before. Aliasing is kept: every copy is registered in deepcopy's memo, so a list two objects share is copied once and
stays shared."""
from __future__ import annotations

import copy
from collections import OrderedDict, deque
from enum import Enum
from itertools import chain

ATOMS = frozenset((int, str, bytes, float, bool, type(None)))
FLAT = (list, deque, set)


def atoms_only(values) -> bool:
    """Every element an atom, checked in C (map, then issuperset stops at the first other type): a Python loop over
    the pool's free list, thousands of page ids on a GPU, cost more than the copy itself."""
    return ATOMS.issuperset(map(type, values))


def immutable_values(values) -> bool:
    """Every value an atom or a tuple of atoms, which a copy shares (as deepcopy does), checked in C: the pool's
    last owners map each page ever freed to an (owner, step) pair, thousands of them on a GPU."""
    types = set(map(type, values))
    return types <= ATOMS or (types == {tuple} and atoms_only(chain.from_iterable(values)))


def copied(value, memo: dict):
    """A deep copy of `value`: lists, deques, sets, tuples and dicts are rebuilt here (a flat one of atoms in one C
    call), anything else by copy.deepcopy (which calls copy_fields where a class says so)."""
    t = type(value)
    if t in ATOMS:
        return value
    hit = memo.get(id(value))
    if hit is not None:
        return hit
    if t in FLAT:
        new = t(value) if atoms_only(value) else t(copied(x, memo) for x in value)
    elif t is dict or t is OrderedDict:     # keys: atoms (page ids, owner names, keys' bytes); order kept
        new = t(value) if immutable_values(value.values()) else \
            t((k, copied(v, memo)) for k, v in value.items())
    elif t is tuple:
        if atoms_only(value):
            return value        # immutable all the way down: shared, as deepcopy shares it
        new = tuple(copied(x, memo) for x in value)
    elif issubclass(t, Enum):
        return value            # a member is its own copy (Enum.__deepcopy__), without deepcopy's dispatch
    else:
        return copy.deepcopy(value, memo)
    memo[id(value)] = new
    return new


def copy_fields(obj, memo: dict):
    """`obj.__deepcopy__`: a new object of its class whose every field is `copied`."""
    new = object.__new__(type(obj))
    memo[id(obj)] = new
    for name, value in vars(obj).items():
        object.__setattr__(new, name, copied(value, memo))
    return new
