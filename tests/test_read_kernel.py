"""scripts/probes/read_kernel.py, the reads scripts/probes/read_floor.py takes as each kernel's floor: every element
read once (a read that skipped a block, or read one twice, would give a floor of other bytes). On CPU through
Triton's interpreter, in a child process (tests/interpreter.py); natively on CUDA."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the read kernels need triton (pip install triton)")

from tests.interpreter import interpreting, kernel_test_mark, run_kernel_tests_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS_HERE = DEVICE == "cuda" or interpreting(triton)
kernel_test = kernel_test_mark(triton)


def trips(n: int, per_trip: int) -> int:
    """The static trip count the interpreter needs (0 on CUDA: the kernels loop to n, as the probe runs them)."""
    return 0 if DEVICE == "cuda" else -(-n // per_trip)


@pytest.mark.skipif(RUNS_HERE, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    run_kernel_tests_interpreted(__file__)


@kernel_test
@pytest.mark.parametrize("n, programs, block", [(1000, 3, 64), (4096, 8, 256), (37, 5, 16), (64, 1, 64)])
def test_stream_read_reads_every_element_once(n, programs, block):
    """Each element a distinct power-of-two-free weight (its index + 1): the programs' sums add up to the total only
    if every index is read exactly once, whatever the grid and block (a tail shorter than a block included)."""
    from scripts.probes.read_kernel import stream_read
    x = (torch.arange(n, dtype=torch.float32) + 1).to(DEVICE, torch.float16) if n < 2048 else \
        torch.ones(n, device=DEVICE, dtype=torch.float16)
    out = torch.zeros(programs, device=DEVICE, dtype=torch.float32)
    stream_read[(programs,)](x, n, out, BLOCK=block, TRIPS=trips(n, programs * block))
    assert out.sum().item() == pytest.approx(x.float().sum().item(), rel=1e-6)
    assert (out[:min(programs, -(-n // block))] > 0).all(), "every program with a block of its own read it"


@kernel_test
@pytest.mark.parametrize("records, heads, d, programs, block_rows", [(100, 2, 16, 3, 8), (33, 4, 32, 2, 16)])
def test_strided_read_reads_each_heads_slice_of_every_record(records, heads, d, programs, block_rows):
    """A cache laid out [records, heads, d]: grid column g sums head g's slice of every record, nothing of another
    head's."""
    from scripts.probes.read_kernel import strided_read
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 8, (records, heads, d), generator=g).to(DEVICE, torch.float16)
    out = torch.zeros(programs, heads, device=DEVICE, dtype=torch.float32)
    strided_read[(programs, heads)](x, records, out, ROW=d, STRIDE=heads * d, BLOCK_ROWS=block_rows,
                                    TRIPS=trips(records, programs * block_rows))
    want = x.float().sum(dim=(0, 2))
    torch.testing.assert_close(out.sum(0), want, atol=0, rtol=0)
