"""Host-side packing of one step into flat integer arrays (numpy, written in place): prompt-chunk positions first,
decode tokens last. The eager forward (`ModelRunner.build`) and the captured ones (`DecodeGraphs`, `StepGraphs`)
share it, so a graphed step's tokens, positions and slots are the eager step's by construction. No torch here, and
no Python loop per position: per prompt chunk one slice each, per decode row one list element each."""
from __future__ import annotations

from itertools import chain

import numpy as np


def pack(chunks, decodes, pages_of: dict[str, list[int]], page_size: int, tokens: np.ndarray,
         positions: np.ndarray, slots: np.ndarray, logit_rows: np.ndarray, all_logits: bool = False) -> tuple[int, int]:
    """Write the step's packed tokens, positions and cache slots (each array at least T long) and the packed rows
    whose logits are sampled: the last position of each chunk that completes its prompt (every chunk position with
    `all_logits`), then every decode row. Returns (T, number of logit rows)."""
    ps = page_size
    o = nrows = 0
    for c in chunks:
        r, n = c.request, c.length
        end = o + n
        tokens[o:end] = r.prompt[c.start:c.start + n]
        pos = positions[o:end]
        pos[:] = np.arange(c.start, c.start + n)
        pages = np.asarray(pages_of[r.request_id])
        slots[o:end] = pages[pos // ps] * ps + pos % ps
        if all_logits:
            logit_rows[nrows:nrows + n] = np.arange(o, end)
            nrows += n
        elif c.completes_prompt:
            logit_rows[nrows] = end - 1
            nrows += 1
        o = end
    d = len(decodes)
    if d:
        end = o + d
        pos = [r.num_cached for r in decodes]
        positions[o:end] = pos
        tokens[o:end] = [r.output[-1] for r in decodes]
        slots[o:end] = [pages_of[r.request_id][p // ps] * ps + p % ps for r, p in zip(decodes, pos)]
        logit_rows[nrows:nrows + d] = np.arange(o, end)
        nrows += d
        o = end
    return o, nrows


def logit_row_count(chunks, decodes, all_logits: bool) -> int:
    if all_logits:
        return sum(c.length for c in chunks) + len(decodes)
    return sum(c.completes_prompt for c in chunks) + len(decodes)


def page_rows(lists, lengths: list[int] | None, out: np.ndarray, fill: int) -> None:
    """out[i, :lengths[i]] = lists[i][:lengths[i]] (whole lists if lengths is None), and `fill` after: block-table
    rows in one masked assignment (no numpy call per row)."""
    out[:] = fill
    if not lists:
        return
    if lengths is None:
        lengths = [len(p) for p in lists]
        flat = chain.from_iterable(lists)
    else:
        flat = chain.from_iterable(p[:n] for p, n in zip(lists, lengths))
    lens = np.array(lengths)
    w = int(lens.max())     # the mask spans the longest row, not the table's width (128 pages on the 1.5B shape)
    out[:, :w][_columns(w) < lens[:, None]] = np.fromiter(flat, np.int64, int(lens.sum()))


_COLUMNS: dict[int, np.ndarray] = {}


def _columns(width: int) -> np.ndarray:
    if width not in _COLUMNS:
        _COLUMNS[width] = np.arange(width)[None, :]
    return _COLUMNS[width]


__all__ = ["logit_row_count", "pack", "page_rows"]
