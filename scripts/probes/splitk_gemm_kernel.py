"""The Triton kernel of scripts/probes/splitk_gemm.py (which says what it measures). A module of its own, as
kernels/triton_decode_kernels.py: Triton's interpreter finds `tl` in a kernel's module globals."""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def splitk_partials(x_ptr, w_ptr, part_ptr, M, stride_xm, stride_wn, N: tl.constexpr, K: tl.constexpr,
                    K_PER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """part[s, M, N] = x[:, s*K_PER:(s+1)*K_PER] @ w[:, same]^T in fp32: program (n, s, m) sums split s's K range
    for BLOCK_N columns and BLOCK_M rows. The consumer adds the splits (no reduce kernel, no atomics: the sum's
    order is fixed, so a step is reproducible)."""
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
    for kk in range(0, K_PER, BLOCK_K):      # a static trip count
        k = k0 + kk
        k_ok = (k + rk) < K
        x = tl.load(x_rows + (k + rk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k + rk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out = part_ptr + pid_s.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])
