"""Running a test module's Triton kernel tests in Triton's interpreter (TRITON_INTERPRET=1) on a machine without a
GPU. The interpreter must be on before triton is first imported (its library functions are made then); a pytest
process has imported it earlier (torch's compiler does), so the kernel tests run in a child process and are skipped
in this one."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def interpreting(triton) -> bool:
    return type(triton.language.standard.zeros).__name__ == "InterpretedFunction"


def kernel_test_mark(triton):
    """Mark for a kernel test: it runs where the kernels run (CUDA, or this process interprets them)."""
    here = torch.cuda.is_available() or interpreting(triton)
    return pytest.mark.skipif(not here, reason="run by test_in_the_interpreter in a child process")


def run_kernel_tests_interpreted(test_file: str, deselect: str = "sm90", timeout: float = 900) -> None:
    """The module's tests but this driver (and `deselect`: tests that need kernels compiled, not interpreted) in a
    child process whose triton interprets; fails unless every one of them passed."""
    repo = Path(test_file).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-x",
                        "-k", f"not test_in_the_interpreter and not {deselect}"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=timeout)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and re.match(r"\d+ passed(, \d+ deselected)? in ", last), \
        "a kernel test failed or was skipped in the interpreter:\n" + r.stdout[-4000:] + r.stderr[-2000:]
