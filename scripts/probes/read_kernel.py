"""The Triton kernel of scripts/probes/read_floor.py: a grid-stride read of a buffer (what any kernel that must read
those bytes costs at least, in that many programs). A module of its own: triton is imported only on the GPU. A
helper, not a command."""
import triton
import triton.language as tl


@triton.jit
def stream_read(ptr, n, out_ptr, BLOCK: tl.constexpr):
    """Program p sums elements [p B, p B + B), [p B + P B, ...) of the n at ptr (B: BLOCK, P: the grid) into
    out[p], so no load is dead code."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))
