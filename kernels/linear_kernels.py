"""The Triton kernel of kernels/linear.py (which says what it does and why). A module of its own, as
kernels/triton_decode_kernels.py: Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) finds `tl` in a kernel's
module globals, and triton is imported only when the kernel is asked for."""
import triton
import triton.language as tl

from kernels.pdl_kernels import launch_dependents, prefetch_rows, wait_for_prior


@triton.jit
def _store_output(out_ptr, b_ptr, acc, rm, rn, ok, col_ok, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


# the row count changes with every captured step size: not specialised on (kernels/mlp_kernels.py says why)
@triton.jit(do_not_specialize=["M"])
def splitk_linear(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, stride_xm, stride_wn, stride_om,
                  N: tl.constexpr, K: tl.constexpr, K_PER: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                  REDUCE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
                  PREFETCH: tl.constexpr = 0):
    """out[M, N] = x @ w^T (+ b), w [N, K]. Program (n, s, m) sums split s's K range [s * K_PER, (s + 1) * K_PER)
    for BLOCK_N columns and BLOCK_M rows in fp32. One split: it writes the output. Else it stores the sum to part[s],
    and the last program of the tile to arrive (an atomic count a tile) adds the SPLITS partials in split order (the
    same sum whichever arrives last: a step is reproducible), adds the bias, writes the output in its dtype and sets
    the count back to 0 for the next call. REDUCE=False stops at the partials (session 32's probe, whose consumer
    added them: scripts/probes/splitk_gemm.py). PDL (launched with launch_pdl): the next kernel may start at once,
    and this one waits for the kernel before it after prefetching the first PREFETCH elements of its split of its
    weight rows into L2 (kernels/pdl_kernels.py)."""
    launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k0 = pid_s * K_PER
    if PREFETCH > 0:
        prefetch_rows(w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn, k0, K, PREFETCH)
    wait_for_prior(PDL)
    for kk in range(0, K_PER, BLOCK_K):         # a static trip count; the last split masks past K
        k = k0 + kk
        k_ok = (k + rk) < K
        x = tl.load(x_rows + (k + rk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k + rk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLITS == 1:
        _store_output(out_ptr, b_ptr, acc, rm, rn, ok, col_ok, stride_om, HAS_BIAS)
    else:
        tile = rm[:, None].to(tl.int64) * N + rn[None, :]
        split_size = tl.cdiv(M, BLOCK_M) * BLOCK_M * N      # part is [SPLITS, M rounded up to BLOCK_M, N]
        tl.store(part_ptr + pid_s * split_size + tile, acc, mask=ok)
        if REDUCE:
            # every thread's partial stored before the count says so: the barrier orders the program's threads,
            # the atomic's release (acq_rel, GPU scope) publishes their stores to the program that reads them
            tl.debug_barrier()
            count = count_ptr + pid_m * tl.cdiv(N, BLOCK_N) + pid_n
            arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                tl.debug_barrier()
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(SPLITS):
                    # from L2 (".cg"): other multiprocessors wrote them
                    total += tl.load(part_ptr + s * split_size + tile, mask=ok, other=0.0, cache_modifier=".cg")
                _store_output(out_ptr, b_ptr, total, rm, rn, ok, col_ok, stride_om, HAS_BIAS)
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
