"""Paged decode attention split by work, in Triton: the `flash` backend's decode kernel
(EngineConfig(decode_kernel="flash") takes flash-attn's split-KV instead).

Why: flash-attn 2's split-KV decode divides the block table's WIDTH into num_splits parts for every row alike. In a
step of the mixed draw (rows of 4,114 and of 200 positions) most splits of most rows are empty, the longest row's
splits each walk a chain of key blocks, and the combine kernel reduces num_splits partials for every row: on the H200
the 32-row pure decode step's attention took 0.68 ms of split-KV and 0.19 ms of combine for 0.75 GB of K/V, a third
of the bandwidth (docs/RESULTS.md). Here each row's cached keys are cut into items of CHUNK positions, so the work
items are as many as the keys need (a 4,114-position row makes 17 of 256, a 200-position row one), every item is a
program per key/value head that attends all of that head's query heads (GQA) over its keys, and a combine reduces
each row's own items only (a one-item row is copied).

Graph-safe: the item list is made on the device from the cache lengths by make_items (no host sync), in arrays
sized by the batch's shape and the pool's size; attend_items is a persistent grid (PROGRAMS_PER_SM a multiprocessor)
whose programs loop over the step's items up to its last one, read on the device, so neither the table's width nor
the pool's size adds programs that only exit.

The step's new key and value (new_kv, the append) are attended from registers by each row's last item, which also
writes them to their cache slot; no program reads that slot, so no ordering between programs is needed.

With the append, the step's rotary embedding is applied here too (rope=(cos, sin); the flash backend's
rotates_decode): every item rotates its row's queries as it loads them and the row's last item the new key before it
attends and writes it, so a pure decode step launches no rotary kernel (28 fewer on the 1.5B shape; measured on the
H200 in session 21: 0.998x [0.969, 1.031] of the step before, no measurable gain, docs/RESULTS.md k16).

The combine stays a kernel of its own. Merging in attend_items' launch instead (each row's last item to arrive, by
an atomic count, combining the row) was measured on the H200 in session 21 and was slower: the 32-row pure decode
step 1.088x [1.061, 1.117] (gates.ab, 5 process pairs), its attention 0.70 ms against 0.51, as the longest row's
last item then merges its group's six heads one after another at the end of the launch (docs/RESULTS.md, k16).

The work items are made by one Triton kernel a step (make_items; torch ops made them in 15 small kernels until
session 39), which also gives each item's end and the page holding it, so an attend_items program loads its item's
numbers together and its first keys one load after, where it waited on its row's length and page first. Measured on
an H100 (session 39, docs/RESULTS.md k31): the pure decode step's small kernels 0.060 ms of device time against 0.080,
attend_items unchanged. Attending each program's first item before the step's item count was read as well (one load
fewer again) was 1.1% faster for the pure decode step and 0.8% slower for the loaded one (its attend_items 503 us a
step against 445): not kept. The split by equal shares of key blocks (stream-K's partition, session 38) was slower on
an H100 and removed: 18.5 against 17.2 us a layer at 32 rows, 80.1 against 75.3 at 200 (its items cross page edges,
so every key block waited on a table load).

Correctness is tested on CPU through Triton's interpreter, and the GPU path is compiled to sm_90 PTX there
(tests/test_triton_decode.py); on the H200 the same tests and the flash token, graph and page-safety gates pass with
it, and the 32-row pure decode step's attention took 0.63 ms of device time against split-KV's 0.87
(docs/RESULTS.md).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

CHUNK = 256             # keys an item attends: one 256-slot page (flash's page size); a multiple of BLOCK_N
BLOCK_N = 64            # keys a program loads at a time; divides the page size
ITEM_BLOCK = 32         # items the combine loads at once (kernels/triton_decode_kernels.py's ITEM_BLOCK)
MIN_GROUP = 16          # tl.dot needs at least 16 rows: the query heads of a group are padded to it
# attend_items' launch. scripts/probes/triton_sweep.py measured 54 tilings at 32 rows on the H200 (docs/RESULTS.md,
# k14): all within 6% (21.3 against 20.0 us a layer), so the 32-row step's third-of-bandwidth is not its tiling. At
# 200 rows (session 32, k24: the 512-row serving bench's decode steps, where the attention is half the step's device
# time) 8 warps and 3 stages took 70.1 us a layer against Triton's defaults' (4, 3) 75.2, and 17.2 against 17.3 at
# 32 rows: 8 warps keep more of a program's key and value loads in flight
LAUNCH: dict = {"num_warps": 8, "num_stages": 3}
# combine_items' launch: one warp a program. A program merges one head of one row, a few items of 128 values; at
# 200 rows that is 2,400 programs, and at one warp each more of them are resident at once (the sweep's
# --combine-warps on the H100 in session 32, k25: 76.6 us a layer for the whole decode at 1 warp, 78.9 at 2, 82.2 at
# 4; at 32 rows 18.0 at 1 warp, 19.5 at 4)
COMBINE_LAUNCH: dict = {"num_warps": 1}
# attend_items' persistent grid: programs a multiprocessor (over all key/value heads). At three stages a program
# holds 71.7 KB of shared memory (compiled for sm_90 as the JIT compiles it, session 32), room for 3 on a
# multiprocessor of 227 KB, but at 8 warps its 128 registers a thread leave room for 2 (Nsight Compute on an H100,
# session 38), and the grid's third and fourth run as the first two end. A 32-row step of the mixed draw has about
# 120-190 items a key/value head: one trip each, in one or two waves; a 200-row step (about 780 items a head)
# loops. Measured (the sweep's --programs-per-sm, an H100 in session 33): at 200 rows 2, 4, 6 and 8 programs a
# multiprocessor took 76.3, 74.9, 75.3 and 74.9 us a layer (3: 83.2), at 32 rows all 17.7: the late programs' wait
# costs nothing measurable, so 4 stays. Session 38 (k30) swept it with every tiling (best 17.2 at 32 rows) and capped
# the registers so that 3 reside (maxnreg 80 / 96: 18.0-18.9): no change pays
PROGRAMS_PER_SM = 4


def max_items(rows: int, width_slots: int, pool_slots: int, chunk: int) -> int:
    """The grid's items: no step can need more than every row at the table's width, nor more than one item a row
    plus the pool's slots in items."""
    return max(1, min(rows * -(-width_slots // chunk), rows + -(-pool_slots // chunk)))


class Items(NamedTuple):
    """A step's work items (work_items): per item its row (rows: past the step's last item), first key position,
    end (its last key + 1), the page holding its first key, and whether it is its row's last item; per row its
    first item and item count. int32 device tensors."""
    row: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    page: torch.Tensor
    last: torch.Tensor
    firsts: torch.Tensor
    counts: torch.Tensor


ITEMS_BLOCK = 64        # items a make_items program writes
ITEMS_ROW_BLOCK = 128   # rows it compares them against at a time


def work_items(cached: torch.Tensor, grid_items: int, chunk: int, table: torch.Tensor, page_size: int) -> Items:
    """Device tensors for one step (Items): each row's cached keys (`cached`: int32 [rows], without the step's new
    one where it is appended) cut into items of `chunk` keys, a row with none still one item, `grid_items` items in
    all (max_items), those past the step's last with row = rows. `table`: the rows' block table [rows, width] (each
    item's page). One Triton kernel (make_items), where torch ops made 15 a step (each a few microseconds in a
    captured step), and it also gives each item's end and page, so attend_items' programs load no row length or
    table entry before their first keys."""
    make_items = _kernels()[2]
    rows, dev = cached.shape[0], cached.device
    out = [torch.empty(grid_items, device=dev, dtype=torch.int32) for _ in range(5)]
    firsts, counts = (torch.empty(rows, device=dev, dtype=torch.int32) for _ in range(2))
    make_items[(-(-grid_items // ITEMS_BLOCK),)](
        cached, table, *out, firsts, counts, rows, table.stride(0), page_size, grid_items,
        CHUNK=chunk, BLOCK=ITEMS_BLOCK, ROW_BLOCK=ITEMS_ROW_BLOCK, ROW_BLOCKS=-(-rows // ITEMS_ROW_BLOCK))
    return Items(*out, firsts, counts)


def _kernels():
    """The three Triton kernels (kernels/triton_decode_kernels.py), imported on first use: triton is needed only when
    this kernel is asked for. Their compiled code goes to $STEPGATE_COMPILE_CACHE where that is set."""
    from .compile_cache import use_compile_cache
    use_compile_cache()
    from .triton_decode_kernels import attend_items, combine_items, make_items
    return attend_items, combine_items, make_items


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 cached: torch.Tensor, scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 chunk: int | None = None, items: Items | None = None, block_n: int | None = None,
                 pdl: bool = False,
                 launch: dict | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 programs: int | None = None, combine_launch: dict | None = None, out: torch.Tensor | None = None,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [rows, heads, d]; caches [pages, page_size, kv_heads, d]; block_table int32 [rows, width]; cached int32
    [rows]: keys in the cache (the new one excluded where new_kv is given, which is then attended and written at
    position `cached`). `items`: work_items(...) made once per step (else made here). `block_n`, `launch`
    (num_warps, num_stages): attend_items' tiling, BLOCK_N and LAUNCH unless given. `rope`: (cos, sin) [rows, d],
    each row's rotary embedding, with new_kv only: q and the new key are then given unrotated, and rotated here
    (the new key as it is written to the cache). `programs`: attend_items' persistent programs a key/value head
    (None: persistent_programs). `combine_launch`: combine_items' (num_warps), COMBINE_LAUNCH unless given.
    `out` [rows, heads, d] (its last dimension contiguous): written instead of a new tensor; with `out_rows`, an
    int32 [1] device tensor, only its rows below that count (a captured loaded step's decode rows: no merge kernel
    after). `pdl`: both kernels launched with programmatic dependent launch (kernels/pdl_kernels.py). -> [rows,
    heads, d] (`out` where given)."""
    attend_items, combine_items, _ = _kernels()
    from .pdl import pdl_args
    chunk = chunk or CHUNK
    block_n = block_n or BLOCK_N
    rows, heads, d = q.shape
    pages, page_size, kv_heads, _ = k_cache.shape
    if page_size % block_n or chunk % block_n or heads % kv_heads or d & (d - 1):
        raise ValueError(f"triton decode: page size {page_size} and item {chunk} (multiples of {block_n}), heads "
                         f"{heads} over {kv_heads} key/value heads, head dim {d} (a power of two)")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError(f"triton decode: out {tuple(out.shape)} must be q's shape {tuple(q.shape)}, its last "
                         f"dimension contiguous")
    if out_rows is not None and out is None:
        raise ValueError("triton decode: out_rows limits the rows written into a given out")
    if rope is not None and new_kv is None:
        raise ValueError("triton decode: rope (cos, sin) only with new_kv: a key written to the cache elsewhere "
                         "must have been rotated there")
    group = heads // kv_heads
    if items is None:
        items = work_items(cached, max_items(rows, block_table.shape[1] * page_size, pages * page_size, chunk),
                           chunk, block_table, page_size)
    n_items = items.row.shape[0]
    o_part = torch.empty(n_items, heads, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(n_items, heads, device=q.device, dtype=torch.float32)
    new_k, new_v = new_kv if new_kv is not None else (k_cache, v_cache)     # unread without the append
    cos, sin = rope if rope is not None else (q, q)                           # unread without rope
    if rope is not None and (cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    # the combine's static trip count, for the interpreter only: on the GPU it loops to each row's count, so no
    # table width compiles a kernel of its own (one block of ITEM_BLOCK items a trip)
    max_count = combine_bound(block_table.shape[1] * page_size, chunk) if not q.is_cuda else ITEM_BLOCK
    if programs is None:
        programs = persistent_programs(q.device, kv_heads)
    programs = max(1, min(programs, n_items))
    attend_items[(programs, kv_heads)](
        q, k_cache, v_cache, block_table, items.row, items.start, items.end, items.page, items.last, items.firsts,
        items.counts, new_k, new_v,
        o_part, lse, cos, sin, scale, rows, block_table.stride(0), page_size, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *(t.stride(i) if new_kv is not None else 0 for t in (new_k, new_v) for i in (0, 1)),
        o_part.stride(0), o_part.stride(1), lse.stride(0), cos.stride(0) if rope is not None else 0,
        GROUP=group, GROUP_PAD=max(MIN_GROUP, 1 << math.ceil(math.log2(group))), D=d, CHUNK=chunk,
        BLOCK_N=block_n, APPEND=new_kv is not None, STATIC_LOOP=not q.is_cuda, ONE_PAGE=page_size % chunk == 0,
        ROPE=rope is not None, ITERS=-(-n_items // programs) if not q.is_cuda else 1, **pdl_args(pdl),
        **(LAUNCH if launch is None else launch))
    if out is None:
        out = torch.empty_like(q)
    combine_items[(rows, heads)](o_part, lse, items.firsts, items.counts, out,
                                 items.counts if out_rows is None else out_rows,
                                 o_part.stride(0), o_part.stride(1), lse.stride(0), out.stride(0), out.stride(1),
                                 D=d, MAX_COUNT=max_count, STATIC_LOOP=not q.is_cuda, LIMIT_ROWS=out_rows is not None,
                                 **pdl_args(pdl), **(COMBINE_LAUNCH if combine_launch is None else combine_launch))
    return out


def persistent_programs(device: torch.device, kv_heads: int) -> int:
    """attend_items' programs a key/value head: PROGRAMS_PER_SM a multiprocessor over all key/value heads (on the
    GPU), each looping over the items; off the GPU (Triton's interpreter) one an item (the grid is cut to the
    items)."""
    if device.type != "cuda":
        return 1 << 30
    return max(1, -(-multiprocessors(device.index) * PROGRAMS_PER_SM // kv_heads))


@functools.lru_cache(maxsize=None)
def multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count


def combine_bound(width_slots: int, chunk: int) -> int:
    """The combine's static trip count under Triton's interpreter (on the GPU it loops to each row's count): the
    table's width in items, rounded up to a power of two. Each captured decode step has its own table width, and a
    compile-time constant per width compiled the kernels again for each (after one GPU gate run with the unrounded
    width, Triton's cache held 66 MB). Items past a row's count are skipped."""
    items = max(1, -(-width_slots // chunk))
    return 1 << (items - 1).bit_length()


__all__ = ["CHUNK", "Items", "combine_bound", "max_items", "paged_decode", "work_items"]