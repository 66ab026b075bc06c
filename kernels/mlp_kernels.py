"""The Triton kernel of kernels/mlp.py (which says what it does and why). A module of its own, as
kernels/triton_decode_kernels.py: Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) finds `tl` in a kernel's
module globals, and triton is imported only when the kernel is asked for."""
import triton
import triton.language as tl

from kernels.pdl_kernels import launch_dependents, prefetch_rows, wait_for_prior


# the row count changes with every captured step size: specialised on (a variant for a multiple of 16, one for 1),
# it would compile the kernel again for nothing (it only masks rows)
@triton.jit(do_not_specialize=["M"])
def gate_up_silu(x_ptr, w_ptr, out_ptr, M, stride_xm, stride_wn, stride_om, N: tl.constexpr, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 PRECISION: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    """out[M, N] = silu(x @ w[:N]^T) * (x @ w[N:]^T), w the fused [gate; up] weight [2N, K]. A program computes
    BLOCK_N columns of gate and the same columns of up for BLOCK_M rows over the whole K (each x tile loaded once
    for both), rounds each to the output dtype as the GEMM's output is rounded, and applies SiLU-mul in fp32, as the
    compiled piece does (engine/layer_kernels.py's silu_mul). PRECISION: "ieee" for fp32 inputs (cuBLAS multiplies them in
    fp32 unless torch allows TF32; tl.dot's default would round them to TF32). PDL: as kernels/linear_kernels.py's,
    the first PREFETCH elements of the program's gate and up rows fetched into L2 before it waits."""
    launch_dependents(PDL)
    # a one-dimensional grid ordered in groups of GROUP_M row blocks: within a group, the row blocks of a column
    # block are neighbours, so each weight tile comes from DRAM once a group and from L2 for the group's other row
    # blocks. With the row block slowest (a two-dimensional grid's order), a loaded step's 544 rows (9 blocks of 64)
    # would stream a layer's 55 MB of weights 9 times, past the 50 MB L2. One row block (a decode step's rows): the
    # column blocks in order, as before
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    g_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    u_rows = w_ptr + (rn + N)[:, None].to(tl.int64) * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PREFETCH > 0:    # the rows of the last column block clamped to the weight's (past them: no row of it)
        last = tl.minimum(rn, N - 1)
        prefetch_rows(w_ptr + last[:, None].to(tl.int64) * stride_wn, 0, K, PREFETCH)
        prefetch_rows(w_ptr + (last + N)[:, None].to(tl.int64) * stride_wn, 0, K, PREFETCH)
    wait_for_prior(PDL)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + rk) < K
        x = tl.load(x_rows + (k + rk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_rows + (k + rk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        u = tl.load(u_rows + (k + rk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g = tl.dot(x, tl.trans(g), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, tl.trans(u), acc_u, input_precision=PRECISION)
    dt = out_ptr.dtype.element_ty
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], out.to(dt),
             mask=row_ok[:, None] & col_ok[None, :])
