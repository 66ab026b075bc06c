"""The Triton kernels of kernels/triton_decode.py (which says what they do and why). A module of their own: Triton's
interpreter (TRITON_INTERPRET=1, the CPU tests) finds `tl` in a kernel's module globals, and triton is imported only
when the kernel is asked for."""
import triton
import triton.language as tl

from kernels.pdl_kernels import launch_dependents, wait_for_prior


@triton.jit
def key_block(q, k_ptr, v_ptr, page, b, end, page_size, g, kv_stride_page, kv_stride_slot, kv_stride_head, scale,
              m_i, l_i, acc, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [b, min(b + BLOCK_N, end)) of one row (all in `page`: BLOCK_N divides the page size) into the online
    softmax of the group's queries q [GROUP_PAD, D]: returns the new running max, sum and weighted values."""
    d = tl.arange(0, D)
    pos = b + tl.arange(0, BLOCK_N)
    keep = pos < end
    base = page * kv_stride_page + (pos % page_size) * kv_stride_slot + g * kv_stride_head
    k = tl.load(k_ptr + base[:, None] + d[None, :], mask=keep[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale                              # [GROUP_PAD, BLOCK_N] fp32
    s = tl.where(keep[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    v = tl.load(v_ptr + base[:, None] + d[None, :], mask=keep[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def partner(D: tl.constexpr):
    """rotate_half's source of each element: element d + D/2 for the first half, d - D/2 for the second."""
    d = tl.arange(0, D)
    return (d + D // 2) % D


@triton.jit
def rotate(x, x_partner, cos, sin, D: tl.constexpr):
    """x cos + rotate_half(x) sin in fp32 (rotate_half(x) = [-x2, x1]); x_partner: x at partner(D). The last
    dimension is D; cos and sin [D] fp32."""
    sign = tl.where(tl.arange(0, D) < D // 2, -1.0, 1.0)
    return x.to(tl.float32) * cos + sign * x_partner.to(tl.float32) * sin


@triton.jit
def page_of(bt_ptr, row, bt_stride, b, page_size):
    """The page holding key position b of `row` (int64: a large pool passes 2**31 elements)."""
    return tl.load(bt_ptr + row * bt_stride + b // page_size).to(tl.int64)


@triton.jit(do_not_specialize=["rows", "bt_stride"])
def make_items(cached_ptr, bt_ptr, row_ptr, start_ptr, end_ptr, page_ptr, last_ptr, first_ptr, count_ptr,
               rows, bt_stride, page_size, n_items,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_BLOCKS: tl.constexpr):
    """A step's work items in one launch (kernels/triton_decode.py: work_items says what they are). Program b writes
    items [b BLOCK, (b + 1) BLOCK): for item i, its row is the number of rows whose items end at or before i, found
    by comparing i against every row's end (a row block at a time, the ends a running cumsum), and its row's first
    item, keys and item count come from the same comparison; program 0 also writes each row's first item and count.
    ROW_BLOCKS: the row blocks (a static trip count, which the interpreter needs; a compile per 128 rows at most)."""
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    row = tl.zeros([BLOCK], tl.int32)          # rows wholly before item i: its row (rows past the step's last item)
    first = tl.zeros([BLOCK], tl.int32)        # its row's first item
    keys = tl.zeros([BLOCK], tl.int32)         # its row's cached keys
    count = tl.zeros([BLOCK], tl.int32)        # its row's items
    carry = 0                                  # the items of the row blocks before
    for rb in range(ROW_BLOCKS):
        r = rb * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
        rm = r < rows
        k = tl.load(cached_ptr + r, mask=rm, other=0)
        n = tl.where(rm, tl.maximum((k + (CHUNK - 1)) // CHUNK, 1), 0)   # a row with no cached key still has one
        ends = tl.cumsum(n, 0) + carry
        firsts = ends - n
        if pid == 0:
            tl.store(first_ptr + r, firsts, mask=rm)
            tl.store(count_ptr + r, n, mask=rm)
        before = rm[None, :] & (ends[None, :] <= i[:, None])              # [BLOCK, ROW_BLOCK]
        mine = (firsts[None, :] <= i[:, None]) & (i[:, None] < ends[None, :])     # padding rows: firsts == ends
        row += tl.sum(before.to(tl.int32), 1)
        first += tl.sum(tl.where(mine, firsts[None, :], 0), 1)
        keys += tl.sum(tl.where(mine, k[None, :], 0), 1)
        count += tl.sum(tl.where(mine, n[None, :], 0), 1)
        carry += tl.sum(n, 0)
    real = row < rows
    start = tl.where(real, (i - first) * CHUNK, 0)
    end = tl.minimum(start + CHUNK, keys)
    page = tl.load(bt_ptr + tl.where(real, row, 0) * bt_stride + start // page_size, mask=real, other=0)
    keep = i < n_items
    tl.store(row_ptr + i, row, mask=keep)
    tl.store(start_ptr + i, start, mask=keep)
    tl.store(end_ptr + i, end, mask=keep)
    tl.store(page_ptr + i, page, mask=keep)
    tl.store(last_ptr + i, (real & (i + 1 == first + count)).to(tl.int32), mask=keep)


# the row count and the table's width change with every captured shape: specialised on (Triton compiles a variant
# for a value divisible by 16, and one for 1), each would compile the kernel again for nothing (they only index rows)
@triton.jit(do_not_specialize=["num_rows", "bt_stride"])
def attend_items(q_ptr, k_ptr, v_ptr, bt_ptr, item_row_ptr, item_start_ptr, item_end_ptr, item_page_ptr,
                 item_last_ptr, first_ptr, count_ptr, new_k_ptr, new_v_ptr, o_ptr, lse_ptr, cos_ptr, sin_ptr, scale,
                 num_rows, bt_stride, page_size,
                 q_stride_row, q_stride_head,
                 kv_stride_page, kv_stride_slot, kv_stride_head,
                 new_k_stride_row, new_k_stride_head, new_v_stride_row, new_v_stride_head,
                 o_stride_item, o_stride_head, lse_stride_item, rope_stride_row,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK_N: tl.constexpr, APPEND: tl.constexpr, STATIC_LOOP: tl.constexpr, ONE_PAGE: tl.constexpr,
                 ROPE: tl.constexpr, ITERS: tl.constexpr, PDL: tl.constexpr = False):
    """A persistent grid over the step's items: program p of a key/value head attends items p, p + P, p + 2P, ...
    up to the step's last item (P: the grid's first dimension), so the grid is sized by the GPU, not by the items
    a table's width could hold: a captured step's table is as wide as the longest admissible request, and a grid of
    one program an item there launched thousands that exit at once (kernels/triton_decode.py). PDL: launched with programmatic dependent launch, it waits for the kernel before it before it reads anything
    (the queries come from it; kernels/pdl_kernels.py)."""
    launch_dependents(PDL)
    wait_for_prior(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    g = tl.program_id(1)                       # key/value head
    # the step's items end at its last row's last item (the grid's items past it belong to no row)
    total = tl.load(first_ptr + num_rows - 1) + tl.load(count_ptr + num_rows - 1)
    if STATIC_LOOP:
        # Triton's interpreter (the CPU tests) cannot take loaded values as loop bounds: ITERS trips of the grid,
        # the items past the step's last skipped
        for j in range(ITERS):
            item = pid + j * nprog
            if item < total:
                attend_item(item, g, q_ptr, k_ptr, v_ptr, bt_ptr, item_row_ptr, item_start_ptr, item_end_ptr,
                            item_page_ptr, item_last_ptr, new_k_ptr, new_v_ptr, o_ptr, lse_ptr, cos_ptr, sin_ptr,
                            scale, bt_stride, page_size, q_stride_row, q_stride_head, kv_stride_page, kv_stride_slot,
                            kv_stride_head, new_k_stride_row, new_k_stride_head, new_v_stride_row, new_v_stride_head,
                            o_stride_item, o_stride_head, lse_stride_item, rope_stride_row,
                            GROUP, GROUP_PAD, D, CHUNK, BLOCK_N, APPEND, STATIC_LOOP, ONE_PAGE, ROPE)
    else:
        for item in range(pid, total, nprog):
            attend_item(item, g, q_ptr, k_ptr, v_ptr, bt_ptr, item_row_ptr, item_start_ptr, item_end_ptr,
                        item_page_ptr, item_last_ptr, new_k_ptr, new_v_ptr, o_ptr, lse_ptr, cos_ptr, sin_ptr,
                        scale, bt_stride, page_size, q_stride_row, q_stride_head, kv_stride_page, kv_stride_slot,
                        kv_stride_head, new_k_stride_row, new_k_stride_head, new_v_stride_row, new_v_stride_head,
                        o_stride_item, o_stride_head, lse_stride_item, rope_stride_row,
                        GROUP, GROUP_PAD, D, CHUNK, BLOCK_N, APPEND, STATIC_LOOP, ONE_PAGE, ROPE)


@triton.jit
def attend_item(item, g, q_ptr, k_ptr, v_ptr, bt_ptr, item_row_ptr, item_start_ptr, item_end_ptr,
                item_page_ptr, item_last_ptr, new_k_ptr, new_v_ptr, o_ptr, lse_ptr, cos_ptr, sin_ptr, scale,
                bt_stride, page_size,
                q_stride_row, q_stride_head,
                kv_stride_page, kv_stride_slot, kv_stride_head,
                new_k_stride_row, new_k_stride_head, new_v_stride_row, new_v_stride_head,
                o_stride_item, o_stride_head, lse_stride_item, rope_stride_row,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_N: tl.constexpr, APPEND: tl.constexpr, STATIC_LOOP: tl.constexpr, ONE_PAGE: tl.constexpr,
                ROPE: tl.constexpr):
    """One item: a key/value head's query heads of its row over the item's keys [start, end) (and, for a row's last
    item with APPEND, the step's new key and value) -> its partial output and log-sum-exp. The callers pass only
    the step's items (each of a row). Its numbers are loaded together (make_items wrote them), so its queries and
    its first keys are loaded one load after the item is known, not after its row's length and page too."""
    row = tl.load(item_row_ptr + item)
    start = tl.load(item_start_ptr + item)
    end = tl.load(item_end_ptr + item)
    # ONE_PAGE (the item divides the page size, so an item lies in one page): its page is looked up once, by
    # make_items, and every key block's address is known before the loop, with no table load in any block's chain
    page = tl.load(item_page_ptr + item).to(tl.int64)
    h = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    hmask = h < GROUP
    heads = g * GROUP + h
    q = tl.load(q_ptr + row * q_stride_row + heads[:, None] * q_stride_head + d[None, :],
                mask=hmask[:, None], other=0.0)
    if ROPE:
        # the step's rotary embedding, here instead of a kernel of its own a layer: the queries come unrotated
        # (as the QKV projection left them) with the row's cos and sin, and are rotated as the model's rope
        # does it (x cos + rotate_half(x) sin, in fp32, rounded once to the cache's dtype)
        c = tl.load(cos_ptr + row * rope_stride_row + d).to(tl.float32)
        sn = tl.load(sin_ptr + row * rope_stride_row + d).to(tl.float32)
        half = tl.load(q_ptr + row * q_stride_row + heads[:, None] * q_stride_head + partner(D)[None, :],
                       mask=hmask[:, None], other=0.0)
        q = rotate(q, half, c, sn, D).to(q_ptr.dtype.element_ty)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    if STATIC_LOOP:
        # Triton's interpreter (the CPU tests) cannot take loaded values as loop bounds: a static trip count
        # whose blocks past the item's keys are skipped
        for j in range(CHUNK // BLOCK_N):
            b = start + j * BLOCK_N
            if b < end:
                if not ONE_PAGE:
                    page = page_of(bt_ptr, row, bt_stride, b, page_size)
                m_i, l_i, acc = key_block(q, k_ptr, v_ptr, page, b, end, page_size, g, kv_stride_page,
                                          kv_stride_slot, kv_stride_head, scale, m_i, l_i, acc, D, BLOCK_N)
    else:
        # on the GPU a loop over the item's key blocks, which the compiler pipelines (the next block's loads
        # under this block's math)
        for b in range(start, end, BLOCK_N):
            if not ONE_PAGE:
                page = page_of(bt_ptr, row, bt_stride, b, page_size)
            m_i, l_i, acc = key_block(q, k_ptr, v_ptr, page, b, end, page_size, g, kv_stride_page,
                                      kv_stride_slot, kv_stride_head, scale, m_i, l_i, acc, D, BLOCK_N)
    if APPEND:
        if tl.load(item_last_ptr + item) != 0:
            # the step's own key and value: attended from registers, written to the row's next slot (position
            # `end`: a row's last item ends at its cached keys)
            nk = tl.load(new_k_ptr + row * new_k_stride_row + g * new_k_stride_head + d)
            nv = tl.load(new_v_ptr + row * new_v_stride_row + g * new_v_stride_head + d)
            if ROPE:    # the new key comes unrotated too: rotated before it is attended and written
                nk_half = tl.load(new_k_ptr + row * new_k_stride_row + g * new_k_stride_head + partner(D))
                nk = rotate(nk, nk_half, c, sn, D).to(new_k_ptr.dtype.element_ty)
            s1 = tl.sum(q.to(tl.float32) * nk.to(tl.float32)[None, :], 1) * scale
            m_new = tl.maximum(m_i, s1)
            alpha = tl.exp(m_i - m_new)
            p1 = tl.exp(s1 - m_new)
            acc = acc * alpha[:, None] + p1[:, None] * nv.to(tl.float32)[None, :]
            l_i = l_i * alpha + p1
            m_i = m_new
            slot_page = page_of(bt_ptr, row, bt_stride, end, page_size)
            slot = slot_page * kv_stride_page + (end % page_size) * kv_stride_slot + g * kv_stride_head
            tl.store(k_ptr + slot + d, nk)
            tl.store(v_ptr + slot + d, nv)
    out = acc / l_i[:, None]
    tl.store(o_ptr + item * o_stride_item + heads[:, None] * o_stride_head + d[None, :], out,
             mask=hmask[:, None])
    tl.store(lse_ptr + item * lse_stride_item + heads, m_i + tl.log(l_i), mask=hmask)


# combine_head's items at a time: a row of up to 32 items (a table up to 8,192 slots at CHUNK 256) is one block; a
# whole wider row would not fit in registers (sm_90 at D 128: 111 a thread for 32 items, 234 for 64, 512 spill)
ITEM_BLOCK = tl.constexpr(32)


@triton.jit
def combine_head(o_ptr, lse_ptr, first, count, head, o_stride_item, o_stride_head, lse_stride_item,
                 D: tl.constexpr, MAX_COUNT: tl.constexpr, STATIC_LOOP: tl.constexpr):
    """One query head of one row: its items' partial outputs [count, D] merged by their log-sum-exps -> [D] fp32.

    A row's items are loaded at once, their lse a vector and their outputs one tile, not one item after another with
    each load waiting on the previous item's merge (6 us a launch on the H200). A block's loads need none of the
    previous block's math; only rows past ITEM_BLOCK items take a second block (and rescale the first). MAX_COUNT
    bounds the interpreter's static loop (STATIC_LOOP) and the block; the GPU loops to the row's count."""
    BLOCK: tl.constexpr = min(MAX_COUNT, ITEM_BLOCK)
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([D], tl.float32)
    if STATIC_LOOP:     # the interpreter's loop bounds are static (as in attend_items)
        for b in range(0, MAX_COUNT, BLOCK):
            if b < count:                    # so the block has an item, and m_new is finite
                m, total, acc = merge_items(o_ptr, lse_ptr, first, count, head, b, m, total, acc, o_stride_item,
                                            o_stride_head, lse_stride_item, D, BLOCK)
    else:
        for b in range(0, count, BLOCK):
            m, total, acc = merge_items(o_ptr, lse_ptr, first, count, head, b, m, total, acc, o_stride_item,
                                        o_stride_head, lse_stride_item, D, BLOCK)
    return acc / total


@triton.jit
def merge_items(o_ptr, lse_ptr, first, count, head, b, m, total, acc, o_stride_item, o_stride_head, lse_stride_item,
                D: tl.constexpr, BLOCK: tl.constexpr):
    """Items [b, min(b + BLOCK, count)) of a row's head merged into the running (max lse, sum, weighted output)."""
    j = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    keep = b + j < count
    t = first + b + j
    lse = tl.load(lse_ptr + t * lse_stride_item + head, mask=keep, other=float("-inf"))
    o = tl.load(o_ptr + t[:, None] * o_stride_item + head * o_stride_head + d[None, :], mask=keep[:, None],
                other=0.0)
    m_new = tl.maximum(m, tl.max(lse, 0))
    alpha = tl.exp(m - m_new)        # 0 on the first block: exp(-inf), never exp(-inf - -inf)
    w = tl.where(keep, tl.exp(lse - m_new), 0.0)
    return m_new, total * alpha + tl.sum(w, 0), acc * alpha + tl.sum(w[:, None] * o, 0)


@triton.jit
def combine_items(o_ptr, lse_ptr, first_ptr, count_ptr, out_ptr, out_rows_ptr, o_stride_item, o_stride_head,
                  lse_stride_item, out_stride_row, out_stride_head, D: tl.constexpr, MAX_COUNT: tl.constexpr,
                  STATIC_LOOP: tl.constexpr, LIMIT_ROWS: tl.constexpr, PDL: tl.constexpr = False):
    """Each row's items merged, a program per (row, query head) (a one-item row is copied). LIMIT_ROWS: only rows
    below the count at out_rows_ptr are written (a captured loaded step's decode rows, in the variable-length call's
    output: the rest of `out` keeps its values). PDL: as attend_items'."""
    launch_dependents(PDL)
    wait_for_prior(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    res = combine_head(o_ptr, lse_ptr, tl.load(first_ptr + row), tl.load(count_ptr + row), head, o_stride_item,
                       o_stride_head, lse_stride_item, D, MAX_COUNT, STATIC_LOOP)
    d = tl.arange(0, D)
    keep = d < D
    if LIMIT_ROWS:
        keep = keep & (row < tl.load(out_rows_ptr))
    tl.store(out_ptr + row * out_stride_row + head * out_stride_head + d, res.to(out_ptr.dtype.element_ty),
             mask=keep)
