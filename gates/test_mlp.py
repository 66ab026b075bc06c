"""The MLP kernel gate: the MLP's fused gate/up GEMM and SiLU-mul (kernels/mlp.py), which a CUDA engine's steps of at
most kernels.mlp.FUSED_ROWS positions run (EngineConfig.mlp_kernel), against the fp32 arithmetic with the kernel
gate's rule (gates/mlp_check.py), at the model under test's MLP and the 1.5B shape's, in each dtype of the grid
(gates/kernel_grid.py). Which kernel each MLP took is held against the configuration by every gate run's dispatch
check (gates/dispatch.py). The plant `mlp-up-row` (tests/plants.py) fails this gate."""
from __future__ import annotations

import pytest

# the parameters and the `device` fixture: pytest takes the hook and the fixture from this module
from .kernel_grid import device, pytest_generate_tests  # noqa: F401


@pytest.mark.gpu       # a CUDA kernel: on a CPU nothing runs it (its interpreter tests are tests/test_mlp_kernel.py)
def test_mlp_kernel_gate(hidden, intermediate, dtype, device):
    """The MLP's fused gate/up GEMM and SiLU-mul (kernels/mlp.py: what a CUDA engine's steps of at most
    kernels.mlp.FUSED_ROWS positions run, EngineConfig.mlp_kernel) against the fp32 arithmetic at row counts around
    its tilings (gates/mlp_check.py: the kernel gate's rule), at the model under test's MLP and the 1.5B shape's."""
    from kernels import mlp
    from .mlp_check import MLP_ROWS, mlp_kernel_problems
    reason = mlp.why_unavailable(device)
    if reason:
        pytest.skip(f"the fused MLP kernel does not run here ({reason}); tests/test_mlp_kernel.py checks it on a CPU "
                    f"through Triton's interpreter")
    problems = [p for rows in MLP_ROWS for p in mlp_kernel_problems(rows, hidden, intermediate, dtype, device)]
    assert not problems, "\n".join(problems)
