"""Fixtures shared by the gates: options, the loaded model, memoised engine runs, goldens, teacher forcing."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kernels
from engine.config import LINEAGE
from engine.engine import torch_dtype
from engine.loader import is_small, load_model, model_checksum
from engine.workload import get_workload

from . import summary
from .golden import GOLDEN_DIR, GoldenError, golden_path, read_golden, regen_command, regenerate
from .reference import EngineReference, make_reference
from .schedule_check import check_engine

# (engine configuration, attention backend): the candidates every comparison gate is parametrised over. A new
# backend joins here, so the token, poison and tiny-pool gates all cover it.
CANDIDATES = [("chunked", "torch"), ("fused", "torch"), ("fused", "flex"), ("flash", "flash")]


@dataclass(frozen=True)
class GateOptions:
    device: str
    dtype: str
    model: str
    golden_dir: Path
    threshold: float
    flip_cap: int
    regen: bool
    engines: tuple[str, ...]
    backends: tuple[str, ...]

    @property
    def model_arg(self):
        return None if self.model == "small" else self.model


@pytest.fixture(scope="session")
def opts(request) -> GateOptions:
    c = request.config
    device = c.getoption("--device")
    dtype = c.getoption("--dtype") or ("float16" if device.startswith("cuda") else "float32")
    eng = c.getoption("--engine")
    be = c.getoption("--backend")
    return GateOptions(device, dtype, c.getoption("--model"), Path(c.getoption("--golden-dir") or GOLDEN_DIR),
                       c.getoption("--tie-threshold"), c.getoption("--flip-cap"), c.getoption("--regen-golden"),
                       tuple(LINEAGE) if eng == "all" else tuple(eng.split(",")),
                       tuple(kernels.BACKENDS) + ("flex", "flash") if be == "all" else tuple(be.split(",")))


def workload_for(opts: GateOptions, name: str) -> str:
    """The CPU-scaled workloads serve the small model on every device; a large model gets the gate workloads."""
    return name if is_small(opts.model) else name.replace("-cpu", "-gate")


def skip_unless_runs(opts: GateOptions, engine: str, backend: str):
    """Skip (with the reason) a candidate that was not selected or cannot run here."""
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("--device cuda but torch sees no CUDA device")
    if engine not in opts.engines or backend not in opts.backends:
        pytest.skip(f"not selected (--engine {','.join(opts.engines)} --backend {','.join(opts.backends)})")
    if backend not in kernels.BACKENDS:
        pytest.skip(f"attention backend {backend!r} is not built into this checkout")
    page = LINEAGE[engine]["page_size"]
    reason = kernels.why_unavailable(backend, opts.device, page)
    if reason:
        pytest.skip(f"{backend} backend cannot run here: {reason}")


class Runs:
    """Engine runs and references, memoised for the session: gates that need the same run share it."""

    def __init__(self, opts: GateOptions):
        self.opts = opts
        self.cache = {}
        self._loaded = None
        self._refs = {}

    @property
    def loaded(self):
        if self._loaded is None:
            self._loaded = load_model(self.opts.model_arg, torch_dtype(self.opts.dtype), self.opts.device)
        return self._loaded

    def candidate(self, engine: str, backend: str, workload: str, repeat: int = 0, **overrides):
        """GenRecords of one engine configuration on a workload, in poison mode (the gate default). `repeat`
        asks for another, independent run of the same configuration."""
        key = (engine, backend, workload, repeat, tuple(sorted(overrides.items())))
        if key not in self.cache:
            wl = get_workload(workload)
            kw = dict(backend=backend, poison=True, chunk_tokens=wl.chunk_tokens)
            kw.update(overrides)
            ref = EngineReference(engine, device=self.opts.device, dtype=self.opts.dtype, loaded=self.loaded, **kw)
            records = ref.generate(wl.requests())
            self.cache[key] = (records, ref.last_engine)
        # every gate that uses a run fails on its schedule (strict FCFS, eviction at the end of the step, pages back)
        check_engine(self.cache[key][1], f"{engine}[{backend}] on {workload} {dict(overrides) or ''}".rstrip())
        return self.cache[key]

    def reference(self, name: str, workload: str):
        """The live reference engine (for teacher forcing after a flip)."""
        if name not in self._refs:
            if name == "hf":
                self._refs[name] = make_reference("hf", self.opts.model_arg, self.opts.device, self.opts.dtype)
            else:
                self._refs[name] = EngineReference(name, device=self.opts.device, dtype=self.opts.dtype,
                                                   loaded=self.loaded)
        return self._refs[name]

    @property
    def model_checksum(self) -> str:
        if not hasattr(self, "_checksum"):
            self._checksum = model_checksum(self.opts.model_arg)
        return self._checksum

    def golden(self, reference: str, workload: str):
        o = self.opts
        base = golden_path(o.golden_dir, o.model, workload, reference, o.device, o.dtype)
        if o.regen and (reference, workload) not in self.cache:
            regenerate(o.model, workload, reference, o.device, o.dtype, o.golden_dir, o.threshold)
            self.cache[(reference, workload)] = True
        try:
            return read_golden(base, regen_command(o.model, workload, reference, o.device, o.dtype),
                               model_checksum=self.model_checksum)[0]
        except GoldenError as e:
            pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def runs(opts) -> Runs:
    return Runs(opts)


def pytest_sessionstart(session):
    summary.PATH = Path(session.config.getoption("--gate-summary"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = summary.lines()
    if not lines:
        return
    terminalreporter.section("stepgate gate summary")
    for line in lines:
        terminalreporter.write_line(line)
    path = config.getoption("--gate-summary")
    summary.write_json(path)
    terminalreporter.write_line(f"(written to {path})")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """On CPU the flex engine configuration compiles a FlexAttention kernel per shape (about 2 minutes for the
    engine gates), so there it counts as slow: `pytest gates/ -m slow` runs it. The kernel gates still cover flex
    on CPU in the default run, and on CUDA the flex engine gates run by default."""
    if config.getoption("--device").startswith("cuda"):
        return
    for item in items:
        if "fused-flex" in item.nodeid:
            item.add_marker(pytest.mark.slow)
