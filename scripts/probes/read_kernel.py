"""The Triton kernel of scripts/probes/read_floor.py: a grid-stride read of a buffer (what any kernel that must read
those bytes costs at least, in that many programs). A module of its own: triton is imported only on the GPU. A
helper, not a command."""
import triton
import triton.language as tl


@triton.jit
def stream_read(ptr, n, out_ptr, BLOCK: tl.constexpr, TRIPS: tl.constexpr = 0):
    """Program p sums elements [p B, p B + B), [p B + P B, ...) of the n at ptr (B: BLOCK, P: the grid) into
    out[p], so no load is dead code. TRIPS > 0: that many trips of the grid, a static loop (Triton's interpreter,
    the CPU tests, takes no runtime loop bounds); 0 on the GPU: to n."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    if TRIPS > 0:
        for j in range(TRIPS):
            offs = (pid + j * tl.num_programs(0)) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    else:
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _record_slices(ptr, rows, first, g, ROW: tl.constexpr, STRIDE: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    r = first + tl.arange(0, BLOCK_ROWS)
    d = tl.arange(0, ROW)
    return tl.load(ptr + r[:, None].to(tl.int64) * STRIDE + g * ROW + d[None, :], mask=(r < rows)[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def strided_read(ptr, rows, out_ptr, ROW: tl.constexpr, STRIDE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 TRIPS: tl.constexpr = 0):
    """Program (p, g) sums element g ROW .. g ROW + ROW - 1 of each STRIDE-element record in its grid-stride share
    of `rows` records: a key/value head's slices of a K/V cache laid out [slots, heads, d] (ROW = d, STRIDE =
    heads x d), as the decode reads them, into out[p, g]. TRIPS: as stream_read's."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    acc = tl.zeros([BLOCK_ROWS, ROW], tl.float32)
    if TRIPS > 0:
        for j in range(TRIPS):
            acc += _record_slices(ptr, rows, (pid + j * tl.num_programs(0)) * BLOCK_ROWS, g, ROW, STRIDE, BLOCK_ROWS)
    else:
        for first in range(pid * BLOCK_ROWS, rows, tl.num_programs(0) * BLOCK_ROWS):
            acc += _record_slices(ptr, rows, first, g, ROW, STRIDE, BLOCK_ROWS)
    tl.store(out_ptr + pid * tl.num_programs(1) + g, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def l2_prefetch(ptr, n, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """The n elements (fp16) at ptr fetched into L2 (prefetch.global.L2, with evict_last priority if EVICT_LAST):
    program p issues lines p L, p L + P L, ... (L: LINES a trip, one 128-byte line a pointer). Nothing is read into
    the program, so it ends once its prefetches are issued."""
    pid = tl.program_id(0)
    lines = tl.cdiv(n, 64)
    for first in range(pid * LINES, lines, tl.num_programs(0) * LINES):
        line = first + tl.arange(0, LINES)
        ptrs = ptr + tl.minimum(line, lines - 1).to(tl.int64) * 64
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // dummy $0", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
