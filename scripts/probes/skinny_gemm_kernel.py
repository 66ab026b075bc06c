"""The Triton kernel of scripts/probes/skinny_gemm.py (which says what it measured). A module of its own, as
kernels/triton_decode_kernels.py: Triton's interpreter finds `tl` in a kernel's module globals, and triton is
imported only when the probe runs."""
import triton
import triton.language as tl


# the row count changes with every captured step size: specialised on (a variant for a multiple of 16, one for 1),
# it would compile the kernel again for nothing (it only masks rows)
@triton.jit(do_not_specialize=["M"])
def skinny_linear(x_ptr, w_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om, K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T (+ b): a program per BLOCK_N output columns and BLOCK_M rows, over the whole
    K (no split-K: no partial sums to reduce in a second kernel). PRECISION: "ieee" for fp32 inputs, as cuBLAS
    multiplies them unless torch allows TF32 (tl.dot's default would round them to TF32). K is a multiple of BLOCK_K (the probe's tiling) and
    a compile-time constant: a model has two (hidden and intermediate sizes), and the loop's trip count is known."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_rows + (k + rk)[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_rows + (k + rk)[None, :], mask=col_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
