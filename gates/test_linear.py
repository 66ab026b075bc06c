"""The linear kernel gate: kernels/linear.py's split-K kernel, which a CUDA engine's steps of at most
kernels.linear.SKINNY_ROWS positions run for q/k/v, o and down where EngineConfig.linear_kernel is "triton", against
the fp32 arithmetic with the kernel gate's rule (gates/linear_check.py), at the model under test's projections and the
1.5B shape's, in each dtype of the grid (gates/kernel_grid.py). Gated whether or not the configuration serves it, so
that the kernel is right before a configuration takes it. Which kernel each projection took is held against the
configuration by every gate run's dispatch check (gates/dispatch.py). The plant `linear-bias-late`
(tests/plants.py) fails this gate."""
from __future__ import annotations

import pytest

# the parameters and the `device` fixture: pytest takes the hook and the fixture from this module
from .kernel_grid import device, pytest_generate_tests  # noqa: F401


@pytest.mark.gpu       # a CUDA kernel: on a CPU nothing runs it (its interpreter tests are tests/test_linear_kernel.py)
def test_linear_kernel_gate(shape, dtype, device):
    """Each projection of the shape (gates/linear_check.projections) at row counts around the kernel's row blocks."""
    from kernels import linear
    from .linear_check import LINEAR_ROWS, linear_case, linear_problems, projections
    reason = linear.why_unavailable(device)
    if reason:
        pytest.skip(f"the split-K linear kernel does not run here ({reason}); tests/test_linear_kernel.py checks it "
                    f"on a CPU through Triton's interpreter")
    problems = []
    for name, n, k, bias in projections(*shape):
        for rows in LINEAR_ROWS:
            problems += linear_problems(*linear_case(rows, n, k, bias, dtype, device, seed=rows), label=f"({name}) ")
    assert not problems, "\n".join(problems)
