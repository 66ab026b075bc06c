"""The README's library example runs as printed, and its quick-start commands are the ones CI runs."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def test_library_example_runs():
    code = blocks("python")[0]
    assert "engine.submit(" in code and "engine.run()" in code and "engine.cancel(" in code
    torch.set_num_threads(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    first, second = out.getvalue().splitlines()
    tokens, state = first.rsplit("] ", 1)
    assert len(tokens.lstrip("[").split(",")) == 8 and state == "cancelled", first
    assert second.startswith("EmptyPromptError "), second


def test_quick_start_is_what_ci_runs():
    quick = blocks("bash")[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 && pip install -e ".[test,plots]" && pytest gates/' in quick
    assert "pytest tests/" in quick
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q -e ".[test,plots]"' in ci
    assert re.search(r"pytest gates/ .*\n.*pytest tests/ ", ci), "CI runs the gates, then the tests"
