"""gates/prewarm.py: the compile-heavy kernel-gate cases (FlexAttention's) compiled ahead in parallel processes on a
GPU gate run. Which cases (one per compiled kernel, only a compiling backend's), when (CUDA only, the first xdist
worker only, never with --no-prewarm), and the processes themselves: each runs the gate's own check on its cases,
reports a failing case and goes on, and a run's end stops those still running."""
from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from gates import options, prewarm

PATHS = {p.name: p for p in kernels.declared_paths()}
FLEX = sorted(n for n, p in PATHS.items() if p.backend == "flex")
TORCH = sorted(n for n, p in PATHS.items() if p.backend == "torch")
TRITON = sorted(n for n, p in PATHS.items() if p.backend == "flash" and p.kernel == "triton")
FLASH_ATTN = sorted(n for n, p in PATHS.items() if p.backend == "flash" and p.kernel != "triton")


def item(path, heads=4, kv_heads=2, head_dim=64, page_size=64, dtype=torch.float16, lens_name="edges",
         name="test_kernel_gate"):
    params = dict(path=path, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                  lens_name=lens_name)
    return SimpleNamespace(originalname=name, callspec=SimpleNamespace(params=params))


def test_one_case_per_compiled_kernel_of_the_compiling_backends_only():
    items = [item(TORCH[0]),                                       # torch compiles nothing
             item(FLEX[0]), item(FLEX[0], page_size=256), item(FLEX[0], lens_name="long"),   # one kernel
             item(FLEX[0], dtype=torch.bfloat16), item(FLEX[0], head_dim=128),             # two more
             item(FLEX[1]),
             item(FLEX[0], heads=8, kv_heads=8, name="test_kernel_cache_over_2g_elements"),  # another gate
             SimpleNamespace(originalname="test_kernel_gate"),                            # not parametrised
             item(FLASH_ATTN[0], page_size=256),                        # flash-attn's kernels are built ahead
             item(TRITON[0], page_size=64),             # a case the gate skips: flash takes pages of 256
             item(TRITON[0], page_size=256), item(TRITON[0], page_size=256, lens_name="long"),   # the Triton decode
             item(TRITON[1], page_size=256, dtype=torch.bfloat16)]
    assert prewarm.compiling_backends(["torch", "flex", "flash"]) == {"flex", "flash"}
    assert prewarm.compiling_backends(["torch"]) == set()
    assert len(TRITON) == 2 and FLASH_ATTN
    cases = prewarm.cases_to_prewarm(items, {"flex", "flash"})
    assert [(c["path"], c["head_dim"], c["dtype"], c["page_size"]) for c in cases] == [
        (FLEX[0], 64, "float16", 64), (FLEX[0], 64, "bfloat16", 64), (FLEX[0], 128, "float16", 64),
        (FLEX[1], 64, "float16", 64), (TRITON[0], 64, "float16", 256), (TRITON[1], 64, "bfloat16", 256)]
    assert [c["path"] for c in prewarm.cases_to_prewarm(items, {"flex"})] == [FLEX[0], FLEX[0], FLEX[0], FLEX[1]]
    json.dumps(cases)           # what a prewarm process is handed


def test_a_prewarm_process_runs_the_gates_check_and_passes_over_a_failing_case():
    ok = dict(path=TORCH[0], heads=4, kv_heads=2, head_dim=64, page_size=64, dtype="float32", lens_name="edges")
    bad = dict(ok, path=next(n for n, p in PATHS.items() if p.backend == "flash"), page_size=256)   # no GPU here
    out = io.StringIO()
    assert prewarm.run_cases([bad, ok], "cpu", out=out) == 2
    lines = out.getvalue().splitlines()
    assert "Unavailable" in lines[0] and lines[1].endswith("passed"), lines


def test_the_processes_run_their_cases_and_a_runs_end_stops_the_rest(tmp_path):
    case = dict(path=TORCH[0], heads=4, kv_heads=2, head_dim=64, page_size=64, dtype="float32", lens_name="edges")
    procs = prewarm.start([case, dict(case, head_dim=128)], "cpu", processes=2, log_dir=str(tmp_path))
    assert len(procs) == 2
    assert all(p.wait(timeout=120) == 0 for p in procs)
    logs = sorted(tmp_path.glob("prewarm-*.log"))
    assert len(logs) == 2 and all("passed" in f.read_text() for f in logs), [f.read_text() for f in logs]
    import subprocess
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.perf_counter()
    prewarm.stop([sleeper])
    assert sleeper.poll() is not None and time.perf_counter() - t0 < 15
    assert prewarm.start([], "cuda") == []


@pytest.mark.parametrize("device,no_prewarm,worker,backends,starts", [
    ("cuda", False, None, ("torch", "flex", "flash"), True),      # a serial GPU run
    ("cuda", False, "gw0", ("flex",), True),                       # the first xdist worker
    ("cuda", False, "gw1", ("flex",), False),                      # the others share its cache
    ("cuda", True, None, ("flex",), False),                        # --no-prewarm
    ("cpu", False, None, ("torch", "flex"), False),                # never on a CPU
    ("cuda", False, None, ("torch", "flash"), True),               # flash: its Triton decode compiles
    ("cuda", False, None, ("torch",), False),                      # no compiling backend selected
    ("cuda", "collectonly", None, ("flex",), False),               # --collect-only runs nothing
])
def test_when_a_run_prewarms(monkeypatch, device, no_prewarm, worker, backends, starts):
    o = SimpleNamespace(is_cuda=device == "cuda", backends=backends, device=device)
    monkeypatch.setattr(options, "gate_options", lambda config: o)
    monkeypatch.setattr(prewarm, "piece_cases", lambda o: [])     # the pieces: test_the_flash_engines_pieces_*
    monkeypatch.setattr(prewarm, "engine_cases", lambda o: [])    # the engines: test_a_serial_run_builds_*
    started = []
    monkeypatch.setattr(prewarm, "start", lambda cases, dev: started.append((cases, dev)) or ["proc"])
    flags = {"--no-prewarm": no_prewarm is True, "collectonly": no_prewarm == "collectonly"}
    config = SimpleNamespace(getoption=flags.get, stash={},
                             **({"workerinput": {"workerid": worker}} if worker else {}))
    session = SimpleNamespace(config=config, items=[item(FLEX[0]), item(TORCH[0]), item(TRITON[0], page_size=256)])
    prewarm.begin(session)
    assert bool(started) == starts
    if starts:
        assert started[0][1] == device and [c["path"] for c in started[0][0]] == \
            [p for p in (FLEX[0], TRITON[0]) if PATHS[p].backend in backends]
        assert config.stash[prewarm._PROCS] == ["proc"]
        config.stash[prewarm._PROCS] = [SimpleNamespace(returncode=0), SimpleNamespace(returncode=-15)]
        assert "2 processes" in prewarm.report(config) and "1 finished, 1 stopped" in prewarm.report(config)
    else:
        assert prewarm.report(config) is None


def gate_opts(device="cuda", gated=("flash",)):
    return SimpleNamespace(device=device, dtype="float16", model_arg=None, model_class="small", tp=1,
                           is_cuda=device == "cuda", backends=("torch", "flex", "flash"),
                           selects=lambda engine, backend: engine in gated, overrides=lambda backend: {})


def test_the_flash_engines_pieces_one_case_each_first(monkeypatch):
    """Where the run gates flash and its runner compiles the elementwise pieces (CUDA), one case a piece, with the
    smoke gate's candidate configuration; dealt first, so that each process compiles one before its kernel cases.
    None where flash is not gated or its pieces are not compiled (a CPU)."""
    from engine import config as engine_config
    from engine import layer_kernels as M
    from engine.workload import SMOKE_CPU
    if not torch.cuda.is_available():     # the configuration refuses cuda: nothing to compile (the gates say why)
        assert prewarm.piece_cases(gate_opts()) == []
    monkeypatch.setattr(engine_config, "device_problem", lambda device, count=None: None)   # as if one were
    cases = prewarm.piece_cases(gate_opts())
    assert [c["piece"] for c in cases] == list(M.EAGER_OPS)
    assert cases[0]["overrides"]["chunk_tokens"] == SMOKE_CPU.chunk_tokens and cases[0]["engine"] == "flash"
    json.dumps(cases)
    assert prewarm.piece_cases(gate_opts(gated=("fused",))) == []
    assert prewarm.piece_cases(gate_opts(device="cpu")) == []
    monkeypatch.setattr(options, "gate_options", lambda config: gate_opts())
    started = []
    monkeypatch.setattr(prewarm, "start", lambda cases, dev, **kw: started.append(cases) or ["proc"])
    config = SimpleNamespace(getoption={}.get, stash={})
    prewarm.begin(SimpleNamespace(config=config, items=[item(FLEX[0])]))
    assert [c.get("piece", c.get("path")) for c in started[0]] == list(M.EAGER_OPS) + [FLEX[0]]


def smoke_item(file, engine=None, backend=None):
    spec = SimpleNamespace(params=dict(engine=engine, backend=backend)) if engine else None
    return SimpleNamespace(path=Path("gates", file), callspec=spec, name=f"{file}[{engine}-{backend}]")


def test_a_serial_run_builds_the_flex_engine_ahead_and_gates_its_smoke_after_the_kernel_gate(monkeypatch):
    """A serial GPU run builds the smoke gate's engine of each gated configuration whose attention compiles per
    shape (FlexAttention) in a prewarm process of its own, runs first what needs none of the prewarm's compiles
    (the other smoke items, the admission, MLP and linear gates), then the kernel gate, then the smoke items of
    that configuration and of flash (whose pieces the prewarm compiles), by when what they compile is cached; under xdist (each worker builds its configurations'
    engines first) and where the run has no kernel gate, nothing moves."""
    from engine import config as engine_config
    from engine.workload import SMOKE_CPU
    monkeypatch.setattr(engine_config, "device_problem", lambda device, count=None: None)   # as if a GPU were here
    o = gate_opts(gated=("fused", "flash"))
    cases = prewarm.engine_cases(o)
    assert [(c["build"], c["overrides"]["backend"]) for c in cases] == [("fused", "flex")], cases
    assert cases[0]["overrides"]["chunk_tokens"] == SMOKE_CPU.chunk_tokens and cases[0]["overrides"]["poison"]
    json.dumps(cases)
    assert prewarm.engine_cases(gate_opts(gated=("flash",))) == []
    serial = SimpleNamespace(getoption={}.get, stash={})
    # flash too: the prewarm compiles its pieces (the first build's compile, test_the_flash_engines_pieces_*)
    assert prewarm.built_by_prewarm(serial, o) == {("fused", "flex"), ("flash", "flash")}
    assert prewarm.built_by_prewarm(serial, gate_opts(gated=("fused",))) == {("fused", "flex")}
    assert prewarm.built_by_prewarm(SimpleNamespace(getoption={}.get, workerinput={"workerid": "gw0"}), o) == set()
    assert prewarm.built_by_prewarm(SimpleNamespace(getoption={"--no-prewarm": True}.get), o) == set()
    smoke = [smoke_item("test_smoke.py", "chunked", "torch"), smoke_item("test_smoke.py", "fused", "flex"),
             smoke_item("test_smoke.py", "flash", "flash"), smoke_item("test_smoke.py", "fused", "flex"),
             smoke_item("test_smoke.py")]
    kernel = [smoke_item("test_kernels.py"), smoke_item("test_kernels.py")]
    early = [smoke_item("test_mlp.py"), smoke_item("test_admission.py")]       # need none of the prewarm's compiles
    later = [smoke_item("test_tokens.py", "fused", "flex"), smoke_item("test_zzz_new.py")]
    ordered = prewarm.order(smoke + kernel + [early[0], later[0], early[1], later[1]], {("fused", "flex")})
    assert [id(i) for i in ordered] == [id(i) for i in (smoke[0], smoke[2], smoke[4], *early, *kernel, smoke[1],
                                                        smoke[3], *later)], [i.name for i in ordered]
    ordered = prewarm.order(smoke + kernel + early, {("fused", "flex"), ("flash", "flash")})
    assert [id(i) for i in ordered] == [id(i) for i in (smoke[0], smoke[4], *early, *kernel, smoke[1], smoke[2],
                                                        smoke[3])], [i.name for i in ordered]
    assert prewarm.order(smoke + early, {("fused", "flex")}) == smoke + early
    assert prewarm.order(smoke + kernel, set()) == smoke + kernel
    started = []
    monkeypatch.setattr(prewarm, "start", lambda cases, dev, **kw: started.append(cases) or ["proc"])
    monkeypatch.setattr(options, "gate_options", lambda config: o)
    prewarm.begin(SimpleNamespace(config=serial, items=[]))
    assert [[c.get("build", c.get("piece")) for c in s] for s in started][-1] == ["fused"]     # a process of its own


def test_the_prewarm_builds_the_engine_its_smoke_gate_builds(monkeypatch):
    """The prewarm's engine case builds the smoke gate's configuration (Runs.engine_reference's): its attention
    warm-up is called with the same ladder as the gate's own build, its longest history included, though its pool
    holds one longest request only (a pool too small for it fails this). On CPU, the warm-up recorded, not run."""
    from engine.loader import load_model
    from gates.reference import EngineReference
    from gates.runs import candidate_overrides
    from kernels.flex_backend import FlexBackend
    calls = []
    monkeypatch.setattr(FlexBackend, "warmup", lambda self, *a, **kw: calls.append((a, kw)) or 0)
    o = SimpleNamespace(**{**vars(gate_opts(device="cpu", gated=("fused",))), "dtype": "float32",
                           "overrides": lambda backend: {"compile_warmup": True}})     # warm as on CUDA
    [case] = prewarm.engine_cases(o)
    out = io.StringIO()
    assert prewarm.run_cases([case], "cpu", out=out) == 1 and out.getvalue().rstrip().endswith("passed"), \
        out.getvalue()
    assert out.getvalue().startswith("prewarm fused[flex] engine:")
    EngineReference("fused", device="cpu", dtype="float32", loaded=load_model(None, torch.float32, "cpu"),
                    **candidate_overrides(o, "flex", "smoke-cpu")).engine().close()
    assert len(calls) == 2 and calls[0] == calls[1], calls


def graph_signature(graph) -> tuple:
    """A recorded graph's inputs: each tensor's sizes (a symbolic one as '*' and the size it was traced at, which
    Inductor sizes its launches from), anything else as written."""
    def size(n):
        return f"*{n.node.hint}" if isinstance(n, torch.SymInt) else int(n)
    return tuple(tuple(map(size, t.shape)) if isinstance(t, torch.Tensor) else
                 size(t) if isinstance(t, (int, torch.SymInt)) else repr(t) for t in graph)


def test_the_pieces_compile_as_the_engines_first_build_does(monkeypatch):
    """A prewarm process compiles each piece into the graphs the configuration's first engine compiles (the same
    inputs, the same dynamic token dimension), so that the gate process finds them in the compile cache. On CPU,
    through a compile backend that records Dynamo's graphs (tests/test_elementwise.py)."""
    from engine import Engine
    from engine import layer_kernels as M
    from engine.loader import load_model
    from gates.reference import EngineReference
    from tests.test_elementwise import Recorder

    kw = dict(backend="torch", chunk_tokens=48, compile_elementwise=True)
    cases = [{"piece": n, "engine": "fused", "overrides": kw, "model": None, "dtype": "float32"} for n in M.EAGER_OPS]
    rec = Recorder()
    monkeypatch.setattr(M, "COMPILE_BACKEND", rec)

    def graphs_of(compile_them) -> list[tuple]:
        M.reset_compiled_ops()
        torch._dynamo.reset()
        rec.inputs = []
        compile_them()
        return sorted((graph_signature(g) for g in rec.inputs), key=repr)
    try:
        out = io.StringIO()
        prewarmed = graphs_of(lambda: prewarm.run_cases(cases, "cpu", out=out))
        built = graphs_of(lambda: Engine(EngineReference.config_for("fused", "cpu", "float32", **kw),
                                         loaded=load_model("small", torch.float32, "cpu")))
    finally:
        M.reset_compiled_ops()
        torch._dynamo.reset()
    assert out.getvalue().count("passed") == len(cases), out.getvalue()
    # the CPU's torch backend appends no K/V in its decode: no rotary piece alone, so 4 pieces of 2 graphs each
    assert len(prewarmed) == 8 and prewarmed == built
