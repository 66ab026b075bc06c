"""What the gate tests share: the candidate runs, memoised for the session (Runs: engine runs in poison mode, their
census recorded for the coverage gate, the references, the goldens checked against the configuration they were made
under), the workload and tiny-pool sizes a model gets, the skip-or-fail rule for a candidate that cannot run, and
assert_gate, which records a comparison in the gate summary and fails it with provenance and triage."""
from __future__ import annotations

import time

import pytest

import kernels
from engine.config import LINEAGE, config_differences, graphs_problem, lineage_config
from engine.dtypes import torch_dtype
from engine.errors import PoisonedLogitsError
from engine.loader import load_model, model_checksum
from engine.served import use_cuda_graphs
from engine.workload import get_workload

from . import build_cost, coverage, summary, triage
from .candidates import CANDIDATES  # noqa: F401  (re-exported: the gate modules parametrise over it)
from .failure import GateFailure
from .golden import GoldenError, golden_path, read_golden, regen_command, regenerate
from .options import GateOptions
from .reference import EngineReference, make_reference
from .schedule_check import check_engine


def assert_gate(report, engine=None, reference=None, score=None):
    """Record a comparison gate's report in the gate summary and fail on it. Given the candidate's engine, the
    reference records and score, a failure also says where the first failing token was computed and which re-runs
    of its request pass (gates/triage.py)."""
    summary.record(report)
    if not report.ok:
        raise GateFailure(triage.failure_message(report, engine, reference, score))


def tp_overrides(opts: GateOptions) -> dict:
    """--tp N: every candidate engine runs at tp N (references stay tp 1: the one-GPU engine)."""
    return {"tp": opts.tp} if opts.tp > 1 else {}


def candidate_overrides(opts: GateOptions, backend: str, workload: str) -> dict:
    """The EngineConfig fields a candidate on `backend` serves `workload` with (Runs.candidate): poison mode, the
    workload's chunk budget, this run's options."""
    return dict(backend=backend, poison=True, chunk_tokens=get_workload(workload).chunk_tokens, **tp_overrides(opts),
                **opts.overrides(backend))


def workload_for(opts: GateOptions, name: str) -> str:
    """The CPU-scaled workloads serve a small model on every device; a large model gets the gate workloads."""
    return name if opts.model_class == "small" else name.replace("-cpu", "-gate")


# The seeds' capped-pool control gives the 1.5B model 0.5 GiB of KV: 18,724 slots, about 4.5 of the mixed draw's
# largest requests. The CPU workloads are scaled by 4, so a small model (by class) gets 4,608 slots.
TINY_POOL_SLOTS = {"small": 4608}
TINY_POOL_BYTES = 1 << 29


def tiny_pool_slots(opts: GateOptions, shape) -> int:
    """KV slots of the tiny-pool gate's capped pool for the model under test (`shape`: its ModelShape)."""
    from engine.runner import ModelRunner
    return TINY_POOL_SLOTS.get(opts.model_class) or \
        TINY_POOL_BYTES // ModelRunner.bytes_per_page(shape, 1, torch_dtype(opts.dtype))


def skip_unless_runs(opts: GateOptions, engine: str, backend: str):
    """Skip (with the reason) a candidate that was not selected or, on CPU, cannot run here; on CUDA a selected
    candidate that cannot run fails (gates/options.py: GateOptions.requires)."""
    if engine not in opts.engines or backend not in opts.backends:
        pytest.skip(f"not selected (--engine {','.join(opts.engines)} --backend {','.join(opts.backends)})")
    page = LINEAGE[engine]["page_size"]
    reason = kernels.why_unavailable(backend, opts.device, page)
    if reason and opts.requires(backend):
        pytest.fail(f"{backend} backend is required on {opts.device} and cannot run: {reason}", pytrace=False)
    if reason:
        pytest.skip(f"{backend} backend cannot run here: {reason}")



# the configurations whose kernels run the captured steps' path uncaptured on a CPU (the torch backend's static_steps):
# stated here, not read from the backend, so that losing it fails instead of skipping (a mutation campaign found
# `static_steps = False` turning these gates into skips)
AHEAD_ON_CPU = {("chunked", "torch"), ("fused", "torch")}


def skip_unless_ahead(opts: GateOptions, engine: str, backend: str, workload: str) -> str:
    """Skip a configuration whose kernels do not run the captured steps' path here (no step can be launched ahead);
    else the name of `workload` for this model (workload_for)."""
    skip_unless_runs(opts, engine, backend)
    problem = graphs_problem(lineage_config(engine, backend=backend, device=opts.device, cuda_graphs=True,
                                            tp=opts.tp))
    if problem and not opts.is_cuda and opts.tp == 1 and (engine, backend) in AHEAD_ON_CPU:
        pytest.fail(f"{engine}[{backend}] no longer runs the captured steps' path on a CPU ({problem}): the CPU "
                    f"gates would lose every step launched ahead", pytrace=False)
    if problem or opts.tp > 1:
        pytest.skip(f"no steps launched ahead for {engine}[{backend}] here: {problem or 'tp > 1'}")
    return workload_for(opts, workload)

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

    def engine_reference(self, engine: str, backend: str, workload: str, **overrides) -> EngineReference:
        """The configuration candidate() serves a workload with (poison mode, the workload's chunk budget, this
        run's options), for a gate that drives an engine of its own through the same configuration."""
        kw = {**candidate_overrides(self.opts, backend, workload), **overrides}
        return EngineReference(engine, device=self.opts.device, dtype=self.opts.dtype, loaded=self.loaded, **kw)

    def candidate(self, engine: str, backend: str, workload: str, repeat: int = 0, **overrides):
        """GenRecords of one engine configuration on a workload, in poison mode (the gate default). `repeat`
        asks for another, independent run of the same configuration. Runs are shared by what runs: overrides that
        resolve to the same configuration on this device (on CUDA, flash's defaults are captured steps and overlap,
        asked for by name or not) get one run."""
        ref = self.engine_reference(engine, backend, workload, **overrides)
        # a request the engine refuses (cuda_graphs=True where no captured path runs) resolves like the eager
        # configuration it is not: it fails here, with the error its build gives, rather than take that run
        use_cuda_graphs(ref.config)
        key = (ref.config.resolved(), workload, repeat)
        label = f"{engine}[{backend}] on {workload} {dict(overrides) or ''}".rstrip()
        if key not in self.cache:
            t0 = time.perf_counter()
            try:
                records = ref.generate(get_workload(workload).requests())
            except PoisonedLogitsError as e:     # the engine names the step, slot, page and owner; not its backend
                c = ref.config
                e.add_note(f"in {label}: backend {c.backend}, forward {c.forward}, page_size {c.page_size}, "
                           f"chunk_tokens {c.chunk_tokens}, {c.device} {c.dtype}")
                raise
            build_cost.record_run(f"{engine}[{backend}]", ref.last_engine.scheduler.step_index,
                                  time.perf_counter() - t0)
            self.finish(ref.last_engine)
            coverage.served(label, ref.last_engine)
            self.cache[key] = (records, ref.last_engine)
        # every gate that uses a run fails on its schedule (strict FCFS, eviction at the end of the step, pages back)
        check_engine(self.cache[key][1], label)
        return self.cache[key]

    @property
    def tp_overrides(self) -> dict:
        return tp_overrides(self.opts)

    @staticmethod
    def finish(engine) -> None:
        """After a candidate's run: at tp > 1, every rank's pages are checked and the workers stopped."""
        if engine.config.tp > 1:
            from .tp import finish
            finish(engine)

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
        command = regen_command(o.model, workload, reference, o.device, o.dtype, o.golden_dir)
        try:
            records, meta = read_golden(base, command, model_checksum=self.model_checksum)
        except GoldenError as e:
            pytest.fail(str(e), pytrace=False)
        if reference != "hf":
            # a golden is the reference engine's tokens under the configuration it served then: compared with what
            # that engine serves now, or it would pass a change of kernel, split or capture without a word
            recorded = (meta.get("reference") or {}).get("config") or {}
            now = lineage_config(reference, device=o.device, dtype=o.dtype,
                                 chunk_tokens=get_workload(workload).chunk_tokens).resolved().describe()
            diffs = config_differences(recorded, now)
            if diffs:
                pytest.fail(f"golden {base}.meta.json was made under another configuration of {reference!r} than "
                            f"the one it serves here now ({'; '.join(diffs)}): its tokens are not this engine's "
                            f"reference. Regenerate it if the change was intended: {command}", pytrace=False)
        return records


