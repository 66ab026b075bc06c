"""Programmatic dependent launch (PDL, sm_90 and later) for the Triton kernels of a step: jit helpers their kernels
call when launched with `launch_pdl=True` (their PDL constexpr on). A module of its own, as the other *_kernels
modules: triton is imported only when a kernel is asked for.

Why: inside a captured step each kernel starts only when the one before it has ended, and a few microseconds of
every boundary are the next kernel's launch and ramp-up (about 250 kernels in the 1.5B shape's pure decode step).
Launched with PDL, a kernel's programs may start once every program of the kernel before it has called
launch_dependents(); they may then read what no kernel of the step writes (the weights: prefetch_l2) and must
wait_for_prior() before they read or write anything else. wait_for_prior() returns when the kernel before has ended
and its writes are visible; since that kernel waited on its own predecessor before it ended, the order of the whole
chain holds. A kernel launched without PDL waits for the whole kernel before it, as always.

Measured on an H100 (session 37, docs/RESULTS.md k29): the captured pure decode step leaves about 0.1 ms of gaps
between its kernels, and with PDL the step took 1.001x as long (gates.ab), so EngineConfig.pdl is off by default;
gates/test_graphs.py's PDL gate runs it against without whether or not it is on."""
import triton
import triton.language as tl

LINE = tl.constexpr(64)      # fp16/bf16 elements in a 128-byte cache line: one L2 prefetch each


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel (launched with PDL) start its programs: they wait_for_prior() before they touch this
    kernel's outputs."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Wait until the kernel before has ended and its writes are visible (a no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """A hint: the cache lines at `ptrs` (a tensor of pointers, one a line) fetched into L2. Never faults."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(rows, k0, K: tl.constexpr, COUNT: tl.constexpr):
    """Elements [k0, k0 + COUNT) of each row at `rows` ([R, 1] row pointers) prefetched into L2, eight lines (512
    elements) of a row at a time: a tile of at least as many pointers as a program's threads, so no thread repeats
    another's. COUNT is rounded up to whole groups (the next lines of the row: another split's or the next K blocks,
    read soon anyway), and no line past the row's K elements is touched."""
    for kk in tl.static_range(0, COUNT, 8 * LINE):
        k = tl.minimum(k0 + kk + tl.arange(0, 8) * LINE, K - 1)
        prefetch_l2(rows + k[None, :])
