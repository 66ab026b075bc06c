"""The compile-heavy kernel-gate cases compiled ahead, in parallel processes, while the gates before them run.

A path whose kernel is compiled per shape (AttentionBackend.compiles: FlexAttention's, the flash backend's Triton
decode) makes the GPU kernel gate compile one kernel per (path, head shape, dtype): 30 FlexAttention ones on CUDA,
2-7 s each, and 24 Triton decode ones, 0.3-1 s each, one after another in a gate process (most of the serial GPU
suite's kernel-gate time from a cold compile cache; sessions 22 and 24). Triton keeps its kernels under
TRITON_CACHE_DIR, which kernels/compile_cache.py points into the same folder. Inductor keeps compiled graphs in its
on-disk cache, shared by the processes of one user and cache folder (STEPGATE_COMPILE_CACHE where set): a second
process loads a flex_attention graph instead of compiling it (on CPU, 13.7 s cold against 2.0 s from the cache).
So at the start of a CUDA gate run, a few processes run one case of each such kernel, each through the gate's own
check (kernel_check.check_gate_case), and the gate, reaching those cases later, loads what they compiled. They
first compile the flash engine's elementwise pieces (engine/layer_kernels.py), one piece a process, exactly as its
first build will (engine/runner.py: elementwise_sizes): in the serial suite the gate process reaches that build about
14 s in, after the smoke gate's FlexAttention engine, and compiled the pieces there one after another (6.7 s of
Inductor on an H100, session 41). A serial run also builds, in a process of its own, the smoke gate's engine of
each configuration whose attention is compiled per shape (FlexAttention's: its first build compiled the ladder
in the gate process, 8.4-12.3 s), and orders its gates so that the gate process reaches what the prewarm compiles
after it is done (`order`): the other smoke items, the admission, MLP and linear gates, the kernel gate, then the
flex and flash smoke items.
Their results are ignored: the gate judges every case itself, and a case the prewarm has not reached yet is
compiled by the gate as before (both write the cache atomically). `--no-prewarm` turns it off; on a CPU it never
runs (two CI cores would only compile slower side by side).

    python -m gates.prewarm --device cuda CASES.json     (what a prewarm process runs; CASES: a list of cases)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

GATE = "test_kernel_gate"
CASE_KEYS = ("path", "heads", "kv_heads", "head_dim", "page_size", "dtype", "lens_name")
MAX_PROCESSES = 6
REPO = Path(__file__).resolve().parent.parent


def compile_key(case: dict) -> tuple:
    """What a compiled kernel is specialised on: the path, the head shape and the dtype (not the page size or the
    histories, which reuse it: the gate's page-256 and long cases took 0.02-0.12 s after its page-64 case)."""
    return case["path"], case["heads"], case["kv_heads"], case["head_dim"], case["dtype"]


def cases_to_prewarm(items, compiling: set[str]) -> list[dict]:
    """The first kernel-gate case of each compiled kernel among `items` (collected pytest items) that its backend
    can run (its page size: the gate skips flash's page-64 cases), for the declared paths whose backend is in
    `compiling` and that compile (AttentionBackend.compiles), in the run's order."""
    import kernels
    paths = {p.name: p for p in kernels.declared_paths()}
    out, seen = [], set()
    for item in items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) != GATE or spec is None:
            continue
        case = {k: spec.params[k] for k in CASE_KEYS}
        path = paths.get(case["path"])
        if path is None or path.backend not in compiling:
            continue
        cls = kernels.backend_class(path.backend)
        if not (cls.compiles(path) and cls.takes_page_size(case["page_size"])):
            continue
        case["dtype"] = str(case["dtype"]).removeprefix("torch.")
        if compile_key(case) not in seen:
            seen.add(compile_key(case))
            out.append(case)
    return out


def piece_cases(o) -> list[dict]:
    """One case a piece of the flash configuration's compiled elementwise pieces, where the run gates it and its
    runner compiles them (on CUDA, by default), with the configuration its first engine is built with: the smoke
    gate's candidate (Runs.candidate). Its sizes come from that configuration in the prewarm process."""
    from engine.layer_kernels import EAGER_OPS
    from engine.runner import compiles_elementwise
    if not o.selects("flash", "flash"):
        return []
    kw, config = smoke_config(o, "flash", "flash")
    if config is None or not compiles_elementwise(config):
        return []
    return [{"piece": name, "engine": "flash", "overrides": kw, "model": o.model_arg, "dtype": o.dtype}
            for name in EAGER_OPS]


def smoke_config(o, engine: str, backend: str):
    """(overrides, EngineConfig) of the smoke gate's candidate `engine`[`backend`] (Runs.candidate), the
    configuration its first engine is built with; (overrides, None) where it refuses the device (a CPU-only torch
    asked for cuda: the gates say so themselves, nothing to compile)."""
    from engine.errors import ConfigError
    from engine.workload import SMOKE_CPU

    from .reference import EngineReference
    from .runs import candidate_overrides, workload_for
    kw = candidate_overrides(o, backend, workload_for(o, SMOKE_CPU.name))
    try:
        return kw, EngineReference.config_for(engine, o.device, o.dtype, **kw)
    except ConfigError:
        return kw, None


def engine_cases(o) -> list[dict]:
    """One case a gated configuration whose attention is torch.compile'd per shape (AttentionBackend.
    compiles_per_shape: FlexAttention), its smoke gate's engine built in a prewarm process of its own: the build's
    warm-up compiles the attention's ladder (the serial suite's smoke[fused-flex], 8.4-12.3 s on an H100 in sessions
    41-42) into the shared cache while the gates run, and `order` runs the configuration's smoke items after the
    kernel gate, by when it is there to load. For a serial run only (see begin)."""
    import kernels

    from .runs import CANDIDATES
    out = []
    for engine, backend in CANDIDATES:
        if not (o.selects(engine, backend) and kernels.backend_class(backend).compiles_per_shape):
            continue
        kw, config = smoke_config(o, engine, backend)
        if config is not None:
            out.append({"build": engine, "overrides": kw, "model": o.model_arg, "dtype": o.dtype})
    return out


# Gates that need none of the prewarm's compiles (scheduler state machines; the MLP and linear gates' Triton kernels,
# compiled in the gate process): in a serial run that prewarms they run before the kernel gate, as its head start.
WHILE_PREWARMING = ("test_admission.py", "test_mlp.py", "test_linear.py")


def order(items, built: set[tuple[str, str]]) -> list:
    """A serial run that prewarms (`built`: the (engine, backend) configurations whose first build it compiles for)
    runs first what needs none of its compiles, so that the gate process reaches those compiles after the prewarm
    is done with them: the smoke items of the other configurations, WHILE_PREWARMING's gates, the kernel gate, then
    the smoke items of `built`, then the rest as before. Unchanged where the run has no kernel gate (nothing would
    wait for the prewarm) or nothing is built. Session 42, an H100: with the flex smoke alone moved, the flash
    smoke reached its build 2 s in and compiled the pieces itself (11.89 s); the kernel gate, begun about 4 s
    sooner, loaded its FlexAttention cases slower (15.5 to 19.7 s)."""
    last = max((i for i, item in enumerate(items) if item.path.name == "test_kernels.py"), default=None)
    if last is None or not built:
        return items

    def rank(pos, item) -> int:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.path.name == "test_kernels.py":
            return 2
        if item.path.name in WHILE_PREWARMING:
            return 1
        if pos > last:
            return 4
        return 3 if item.path.name == "test_smoke.py" and (params.get("engine"), params.get("backend")) in built else 0
    return [item for _, _, item in sorted((rank(pos, item), pos, item) for pos, item in enumerate(items))]


def compile_piece(case: dict, device: str, models: dict) -> None:
    """A piece compiled as the case's configuration's runner compiles it (into the shared compile cache)."""
    from engine.dtypes import torch_dtype
    from engine.layer_kernels import try_compile_elementwise
    from engine.runner import elementwise_sizes
    from kernels import get_backend

    from .reference import EngineReference
    config = EngineReference.config_for(case["engine"], device, case["dtype"], **case["overrides"])
    backend = get_backend(config.backend, device, config.page_size, **config.backend_options())
    _, why = try_compile_elementwise(device, torch_dtype(case["dtype"]), loaded_model(case, device, models)[0],
                                     names=(case["piece"],), **elementwise_sizes(config, backend))
    if why:
        raise RuntimeError(why)


def loaded_model(case: dict, device: str, models: dict):
    """The case's model, loaded once a process: load_model's (model, config, name)."""
    from engine.dtypes import torch_dtype
    from engine.loader import load_model
    key = (case["model"], case["dtype"])
    if key not in models:
        models[key] = load_model(case["model"], torch_dtype(case["dtype"]), device)
    return models[key]


def build_engine(case: dict, device: str, models: dict) -> None:
    """The case's engine built as its smoke gate builds it (its warm-up compiles into the shared compile cache),
    then closed and its memory handed back (the gate process needs the GPU's). Its pool holds one request of the
    longest length served and no more: the warm-up's ladder runs to that length on a cache of its own, so it is
    the gate's (which a pool as large as the gate's, 16 GiB on CUDA beside the gate process's, would not fit on a
    smaller GPU)."""
    import torch

    from engine.pool import pages_for

    from .reference import EngineReference
    loaded = loaded_model(case, device, models)
    config = EngineReference.config_for(case["build"], device, case["dtype"], **case["overrides"])
    positions = loaded[0].shape.max_positions
    longest = min(config.max_model_len or positions, positions)
    ref = EngineReference(case["build"], device=device, dtype=case["dtype"], loaded=loaded,
                          **{**case["overrides"], "num_pages": pages_for(longest, config.page_size) + 1})  # + null
    ref.engine().close()
    del ref
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def compiling_backends(backends) -> set[str]:
    """The selected backends with a path whose kernel is compiled per shape."""
    import kernels
    classes = {b: kernels.backend_class(b) for b in backends}
    return {b for b, cls in classes.items() if any(map(cls.compiles, cls.declared_paths()))}


def start(cases: list[dict], device: str, processes: int | None = None, log_dir: str | None = None):
    """Prewarm processes over `cases` (dealt round-robin), started in the background; [] when there is none."""
    if not cases:
        return []
    n = min(len(cases), processes or max(1, min(MAX_PROCESSES, (os.cpu_count() or 2) // 2)))
    log_dir = log_dir or tempfile.mkdtemp(prefix="stepgate-prewarm-")
    procs = []
    for i in range(n):
        spec = Path(log_dir, f"cases-{i}.json")
        spec.write_text(json.dumps(cases[i::n]))
        log = open(Path(log_dir, f"prewarm-{i}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "gates.prewarm", "--device", device, str(spec)],
                                      cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()
    return procs


def stop(procs) -> None:
    """End the prewarm processes still running (the gates are done: what they would compile is not needed)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def run_cases(cases: list[dict], device: str, out=sys.stdout) -> int:
    """Each case through the gate's check; a failure is reported and passed over (the gate judges it). Returns
    the cases whose check ran to the end, passing or failing."""
    import torch

    import kernels

    from .kernel_check import check_gate_case
    paths = {p.name: p for p in kernels.declared_paths()}
    done, models = 0, {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            if "piece" in case:
                compile_piece(case, device, models)
            elif "build" in case:
                build_engine(case, device, models)
            else:
                check_gate_case(paths[case["path"]], case["heads"], case["kv_heads"], case["head_dim"],
                                case["page_size"], getattr(torch, case["dtype"]), case["lens_name"], device)
            verdict = "passed"
        except Exception as e:  # noqa: BLE001 (the gate reports it, with its own message)
            verdict = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        done += 1
        what = f"{case['engine']} piece {case['piece']}" if "piece" in case else \
            f"{case['build']}[{case['overrides']['backend']}] engine" if "build" in case else compile_key(case)
        print(f"prewarm {what}: {time.perf_counter() - t0:.2f} s, {verdict}", file=out, flush=True)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="compile kernel-gate cases into the shared compile cache")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("cases", help="a JSON file: a list of cases (gates.prewarm.CASE_KEYS)")
    a = ap.parse_args(argv)
    from kernels.compile_cache import use_compile_cache
    use_compile_cache()
    run_cases(json.loads(Path(a.cases).read_text()), a.device)
    return 0


# -- the gate run's hooks (gates/conftest.py) ---------------------------------------------------------------------
_PROCS = pytest.StashKey[list]()


def worker_id(config) -> str | None:
    return getattr(config, "workerinput", {}).get("workerid")


def prewarms(config, o) -> bool:
    """Whether this process starts the prewarm: on CUDA, unless --no-prewarm or --collect-only, under xdist on the
    first worker only (the cache is shared, and every worker collects every case)."""
    return bool(o.is_cuda and not config.getoption("--no-prewarm") and worker_id(config) in (None, "gw0")
                and not config.getoption("collectonly"))


def built_by_prewarm(config, o) -> set[tuple[str, str]]:
    """The (engine, backend) configurations whose first build a serial run's prewarm compiles: the engines it builds
    (engine_cases) and the flash engine, whose pieces it compiles (piece_cases). Their smoke items wait for it (order):
    on an H100 in session 42, with the FlexAttention smoke moved and the flash one not, the gate reached the flash
    build about 2 s in, before the pieces' processes were done, and compiled them itself (smoke[flash] 11.89 s
    against 3.71 s when it came after the FlexAttention smoke)."""
    if not prewarms(config, o) or worker_id(config) is not None:
        return set()
    return {(case["build"], case["overrides"]["backend"]) for case in engine_cases(o)} | \
        {(case["engine"], case["overrides"]["backend"]) for case in piece_cases(o)}


def begin(session) -> None:
    """After collection: on CUDA, with compiling backends selected and --no-prewarm not given, start the prewarm
    (under xdist on the first worker only: the cache is shared, and every worker collects every case)."""
    from .options import gate_options
    config = session.config
    o = gate_options(config)
    if not prewarms(config, o):
        return
    # the pieces first: dealt round-robin, each process compiles one before its kernel cases
    cases = piece_cases(o) + cases_to_prewarm(getattr(session, "items", []), compiling_backends(o.backends))
    procs = start(cases, o.device) if cases else []
    engines = engine_cases(o) if worker_id(config) is None else []
    if engines:     # serial: each engine in a process of its own (under xdist, its worker's first gate builds it)
        procs += start(engines, o.device, processes=len(engines))
    if procs:
        config.stash[_PROCS] = procs


def end(session) -> None:
    stop(session.config.stash.get(_PROCS, []))


def report(config) -> str | None:
    """The terminal line of a run that prewarmed: its processes and how they ended."""
    procs = config.stash.get(_PROCS, [])
    if not procs:
        return None
    codes = [p.returncode for p in procs]
    return (f"prewarm: {len(procs)} processes compiled ahead what the gates compile (kernel cases, pieces, engines) "
            f"({sum(c == 0 for c in codes)} finished, {sum(c != 0 for c in codes)} stopped at the run's end or failed; "
            f"--no-prewarm turns it off)")


if __name__ == "__main__":
    sys.exit(main())
