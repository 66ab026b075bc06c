"""The stepgate command-line options, a pytest plugin: declared, read and checked here and nowhere else. A bad value
stops the run before collection (`pytest.UsageError`, exit status 4) instead of turning every gate into a skip; on
CUDA every selected attention backend must run; a gate file that collected tests and ran none fails the run."""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import kernels
from engine.config import DEVICE_FORMS, LINEAGE, device_problem
from engine.dtypes import DTYPE_NAMES, torch_dtype
from engine.loader import NAMED_MODELS, RANDOM_1P5B, model_class

from .compare import TIE_THRESHOLD
from .golden import GOLDEN_DIR
from .candidates import CANDIDATES, is_gate_file  # noqa: F401  (re-exported: the gates import them from here)
from .placement import placement_of

ALL = "all"
MODELS = (*NAMED_MODELS, RANDOM_1P5B)


@dataclass(frozen=True)
class GateOptions:
    device: str
    dtype: str                  # canonical torch name: float32, float16, bfloat16
    dtype_given: bool           # --dtype was passed (else the device's default)
    model: str
    model_class: str            # engine.loader.model_class: "small" or "large"
    golden_dir: Path
    threshold: float
    flip_cap: int
    regen: bool
    engines: tuple[str, ...]
    backends: tuple[str, ...]
    allow_skipped_files: bool
    tp: int = 1                 # tensor-parallel ranks of every candidate engine (references and goldens stay tp 1)
    kv_bytes: int | None = None  # KV budget of every engine the gates build (None: the engine's default);
                                 # gates/workers.py sets it where xdist workers share a GPU, or from STEPGATE_KV_BYTES
    decode_kernel: str | None = None    # the flash backend's decode kernel (None: the one it serves by default)

    def overrides(self, backend: str) -> dict:
        """EngineConfig fields every candidate engine on `backend` gets from the options."""
        return {"decode_kernel": self.decode_kernel} if backend == "flash" and self.decode_kernel else {}

    @property
    def model_arg(self):
        return None if self.model == "small" else self.model

    @property
    def is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def selects(self, engine: str, backend: str) -> bool:
        return engine in self.engines and backend in self.backends

    def requires(self, backend: str) -> bool:
        """On CUDA a selected backend that cannot run fails the run: skipping it would leave its engine
        configuration ungated behind a green run. Naming fewer backends (`--backend torch,flex`) opts out."""
        return self.is_cuda and backend in self.backends


def pytest_addoption(parser):
    g = parser.getgroup("stepgate")
    g.addoption("--device", default="cpu", help="device the engine runs on: cpu, cuda or cuda:N")
    g.addoption("--dtype", default=None, help="float32 / float16 / bfloat16 (default: float32 on cpu, float16 on cuda)")
    g.addoption("--backend", default=ALL, help="attention backend(s) to gate, comma-separated: torch, flex, flash, "
                "or all. On CUDA each one must run (name fewer to opt out); on CPU one that cannot run skips")
    g.addoption("--engine", default=ALL, help="engine configuration(s) to gate: chunked, fused, flash, or all")
    g.addoption("--golden-dir", default=None, help="where goldens live (default: golden/ in the repo)")
    g.addoption("--tie-threshold", type=float, default=TIE_THRESHOLD, help="raw-logit gap under which a flip is a tie")
    g.addoption("--flip-cap", type=int, default=3, help="most distinct flip sites a gate accepts")
    g.addoption("--regen-golden", action="store_true", help="write goldens instead of checking them")
    g.addoption("--model", default="small", help="small (embedded), small-trained, qwen2.5-1.5b-random, or a "
                "checkpoint directory (its class, small or large, comes from its config.json)")
    g.addoption("--gate-summary", default="gate-summary.json", help="where the JSON gate summary is written")
    g.addoption("--gate-summary-md", default="gate-summary.md", help="where the Markdown gate summary is written "
                "(also appended to $GITHUB_STEP_SUMMARY when that is set)")
    g.addoption("--decode-kernel", default=None, help="the flash configuration's decode kernel: triton or flash "
                "(flash-attn's split-KV); default: the one it serves (EngineConfig.decode_kernel's default)")
    g.addoption("--tp", type=int, default=1, help="tensor-parallel ranks of the engine under test (goldens: tp 1)")
    g.addoption("--work-units", default="configuration", choices=("configuration", "configuration-file"),
                help="under -n without --dist: one engine configuration's gates run on one worker (default), or one "
                "configuration's gates of one file (finer units; a run a configuration's files share may then be "
                "made on several workers)")
    g.addoption("--order-as-given", action="store_true",
                help="run the gates in the command line's order, not the suite's (smoke first): a mutation suite "
                "names first the gates most likely to fail for its module (gates/mutation.toml)")
    g.addoption("--no-prewarm", action="store_true",
                help="on CUDA, do not compile the compile-heavy kernel-gate cases (FlexAttention's, the Triton decode's), "
                "the flash engine's elementwise pieces and (serial runs) the FlexAttention engine ahead in parallel "
                "processes, nor reorder a serial run's gates around it (gates/prewarm.py order)")
    g.addoption("--allow-skipped-files", action="store_true",
                help="let a gate file whose collected tests all skipped pass (by default it fails the run)")


# -- reading and checking ------------------------------------------------------------------------------------------
_KEY = pytest.StashKey["GateOptions"]()


def gate_options(config) -> GateOptions:
    """This run's checked options, read once per session, with this process's KV budget (gates/workers.py)."""
    if _KEY not in config.stash:
        opts = read_options(config.getoption)
        config.stash[_KEY] = replace(opts, kv_bytes=placement_of(config, opts.device, opts.tp).kv_bytes)
    return config.stash[_KEY]


def cuda_devices() -> int:
    """CUDA devices torch sees (one function, so that a test can simulate a GPU machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def read_options(get) -> GateOptions:
    """`get(name)` returns an option's raw value; a bad value raises pytest.UsageError naming it."""
    device = check_device(get("--device"))
    dtype_given = get("--dtype") is not None
    dtype = check_dtype(get("--dtype"), device)
    model, cls = check_model(get("--model"))
    regen = bool(get("--regen-golden"))
    golden_dir = Path(get("--golden-dir") or GOLDEN_DIR)
    if not regen and not golden_dir.is_dir():
        raise pytest.UsageError(f"--golden-dir {golden_dir}: no such directory (pass --regen-golden to create it)")
    threshold, flip_cap = get("--tie-threshold"), get("--flip-cap")
    if not threshold >= 0 or math.isinf(threshold):
        raise pytest.UsageError(f"--tie-threshold {threshold}: must be a finite number >= 0 (the default is {TIE_THRESHOLD})")
    if flip_cap < 0:
        raise pytest.UsageError(f"--flip-cap {flip_cap}: must be >= 0 (the default is 3)")
    tp = get("--tp")
    if tp < 1:
        raise pytest.UsageError(f"--tp {tp}: must be >= 1 (1: one device, no tensor parallel)")
    engines = names("--engine", get("--engine"), tuple(LINEAGE), "engine configuration")
    backends = names("--backend", get("--backend"), tuple(kernels.BACKENDS), "attention backend")
    decode_kernel = get("--decode-kernel")
    if decode_kernel is not None:    # a typo in the decode kernel's name fails here, not in the first flash gate
        known = kernels.backend_class("flash").decode_kernels
        if decode_kernel not in known:
            raise unknown("--decode-kernel", decode_kernel, known, "flash decode kernel")
    if not any(e in engines and b in backends for e, b in CANDIDATES):
        raise pytest.UsageError(f"--engine {get('--engine')} --backend {get('--backend')}: no engine configuration "
                                f"runs on these backends; the candidates: "
                                f"{', '.join(f'{e}[{b}]' for e, b in CANDIDATES)}")
    return GateOptions(device, dtype, dtype_given, model, cls, golden_dir, threshold, flip_cap, regen, engines,
                       backends, bool(get("--allow-skipped-files")), tp, decode_kernel=decode_kernel)


def unknown(option: str, value: str, known, what: str, also: str = "") -> pytest.UsageError:
    close = difflib.get_close_matches(value, list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return pytest.UsageError(f"{option}: unknown {what} {value!r}{hint}; known: {', '.join(known)}{also}")


def names(option: str, value: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma-separated list of known names (or `all`), duplicates removed, order kept."""
    out = []
    for name in str(value).split(","):
        name = name.strip()
        if not name:
            raise pytest.UsageError(f"{option} {value!r}: an empty name; known: {', '.join((*known, ALL))}")
        if name not in (*known, ALL):
            raise unknown(f"{option} {value}", name, (*known, ALL), what)
        out += known if name == ALL else [name]
    return tuple(dict.fromkeys(out))


def check_device(device: str) -> str:
    if device != "cpu" and not re.fullmatch(r"cuda(?::\d+)?", device):
        raise unknown("--device", device, DEVICE_FORMS, "device")
    problem = device_problem(device, cuda_devices())
    if problem:
        hint = "; on this machine use --device cpu" if "no CUDA device" in problem else ""
        raise pytest.UsageError(f"--device {device}: {problem}{hint}")
    return device


def check_dtype(dtype: str | None, device: str) -> str:
    if dtype is None:
        return "float32" if device == "cpu" else "float16"
    if dtype not in DTYPE_NAMES:
        raise unknown("--dtype", dtype, tuple(DTYPE_NAMES), "dtype")
    return DTYPE_NAMES[dtype]     # goldens are keyed by the canonical name


def check_model(model: str) -> tuple[str, str]:
    """(the model as given, its class). A directory must hold a checkpoint's config.json."""
    if model not in MODELS:
        path = Path(model)
        if not path.is_dir():
            raise unknown("--model", model, MODELS, "model", f", or a checkpoint directory (there is none at {model})")
        if not (path / "config.json").is_file():
            raise pytest.UsageError(f"--model {model}: the directory has no config.json, so it is not a Hugging "
                                    f"Face checkpoint; named models: {', '.join(MODELS)}")
    try:
        return model, model_class(model)
    except (KeyError, TypeError, ValueError) as e:
        raise pytest.UsageError(f"--model {model}: its config.json cannot be read as a Qwen2 config "
                                f"({type(e).__name__}: {e})") from None


def why_cannot_run(opts: GateOptions, backend: str) -> str | None:
    """Why a backend cannot run this run's candidates (at the page size of its first candidate), or None."""
    page = next((LINEAGE[e]["page_size"] for e, b in CANDIDATES if b == backend), None)
    reason = kernels.why_unavailable(backend, opts.device, page)
    if reason is None:
        reason = kernels.backend_class(backend).why_unsupported(dtype=torch_dtype(opts.dtype))
    return reason


def check_required_backends(opts: GateOptions) -> None:
    missing = {b: r for b in opts.backends if opts.requires(b) and (r := why_cannot_run(opts, b))}
    if missing:
        runnable = [b for b in opts.backends if b not in missing]
        lines = "\n".join(f"  {b}: {r}" for b, r in missing.items())
        opt_out = f"--backend {','.join(runnable)}" if runnable else "--device cpu"
        raise pytest.UsageError(
            f"--device {opts.device}: every selected attention backend must run on CUDA (a skipped one would leave "
            f"its engine configuration ungated behind a green run), and these cannot:\n{lines}\n"
            f"Fix the install, or gate without them by naming the backends to run: {opt_out}")


# -- the plugin's hooks --------------------------------------------------------------------------------------------
def pytest_configure(config):
    from . import reference
    reference.KV_BYTES = gate_options(config).kv_bytes
    if not hasattr(config, "workerinput"):      # an xdist worker sees part of a file: its controller counts
        config.pluginmanager.register(UnrunFiles(config), "stepgate-unrun-files")


def pytest_collection_finish(session):
    opts = gate_options(session.config)
    if opts.is_cuda and any(is_gate_file(item.nodeid) for item in session.items):
        check_required_backends(opts)


def pytest_report_header(config):
    o = gate_options(config)
    try:
        from hypothesis import settings
        profile = f"{getattr(settings, '_current_profile', '?')} " + \
            ("(derandomized: a fixed seed)" if settings.default.derandomize else "(random seed)")
    except ImportError:   # pragma: no cover
        profile = "not installed"
    backends = ("required: each must run" if o.is_cuda else "skipped where they cannot run")
    if "flash" in o.backends:      # which kernel the flash configuration's decode gates
        kernel = o.decode_kernel or kernels.backend_class("flash").decode_kernels[0]
        backends += f"; flash decodes with {kernel} ({'--decode-kernel' if o.decode_kernel else 'its default'})"
    return [f"stepgate: device {o.device}, dtype {o.dtype}, model {o.model} (class {o.model_class}), "
            f"engines {','.join(o.engines)}, backends {','.join(o.backends)} ({backends})",
            f"stepgate: hypothesis profile {profile}; goldens {o.golden_dir} "
            f"({'regenerated by this run' if o.regen else 'read-only'})"]


# -- a gate file that ran none of its tests ------------------------------------------------------------------------
@dataclass
class FileRuns:
    tests: int = 0
    ran: int = 0
    reasons: tuple[str, ...] = ()


class UnrunFiles:
    """Fails a run in which a gate file (a test file in a folder named `gates`) collected tests and ran none of
    them, unless --allow-skipped-files. Counted from reports, not items, so that an xdist controller counts too.
    On CPU a test marked `gpu` is expected to skip and does not count."""

    def __init__(self, config):
        self.opts = gate_options(config)
        self.files: dict[str, FileRuns] = {}

    def pytest_runtest_logreport(self, report):
        if not is_gate_file(report.nodeid) or (not self.opts.is_cuda and "gpu" in report.keywords):
            return
        runs = self.files.setdefault(report.nodeid.split("::")[0], FileRuns())
        runs.tests += report.when == "setup"
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            reason = reason.removeprefix("Skipped: ")
            runs.reasons += (reason,) if reason not in runs.reasons else ()
        elif report.when == "call" or report.failed:
            runs.ran += 1

    def unrun(self, exitstatus) -> dict[str, FileRuns]:
        if self.opts.allow_skipped_files or exitstatus == pytest.ExitCode.INTERRUPTED:
            return {}
        return {f: r for f, r in self.files.items() if r.tests and not r.ran}

    def pytest_sessionfinish(self, session, exitstatus):
        if self.unrun(exitstatus) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus):
        unrun = self.unrun(exitstatus)
        if not unrun:
            return
        tr = terminalreporter
        tr.section("stepgate: gate files that ran none of their tests", red=True)
        for f, r in unrun.items():
            tr.write_line(f"{f}: {r.tests} collected, all skipped: " + "; ".join(r.reasons[:3]), red=True)
        tr.write_line("A gate file that runs nothing gates nothing, so the run fails. Deselect it, or pass "
                      "--allow-skipped-files if that was meant.", red=True)
