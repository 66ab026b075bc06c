"""What the flex backend compiles, and what it costs: cold (fresh process, empty Inductor cache) and warm (a second
process on the same cache folder), per scenario.

Scenarios (CPU by default, the small model's attention shape, fp32):
  warmup   an engine's flex warm-up at the tiny-pool gate's settings (fused, flex, 64-slot pages, chunk 128)
  kernels  the flex kernel-gate cases of the default CPU run (grid edges at pages of 64 and 256, the large page
           count, decode against the torch kernel)
  engine   a short fused-flex engine run (a few requests of the mixed CPU workload, no warm-up: compiles on the way)

Each row: dynamo frame compiles and recompiles, graphs, graph breaks, FX graph cache hits and misses, distinct padded
shapes run (the backends' `compiled_shapes`), wall and CPU seconds (this process and its compiler children).

  python -m scripts.probes.compile_cost                        # every scenario, cold then warm, a table
  python -m scripts.probes.compile_cost -s kernels --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("warmup", "kernels", "engine")
COLUMNS = ("scenario", "phase", "frames", "recompiles", "graphs", "breaks", "fx_miss", "fx_hit", "shapes", "wall_s",
           "cpu_s")


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _flex_backends(objs) -> list:
    from kernels.flex_backend import FlexBackend
    return [b for b in objs if isinstance(b, FlexBackend)]


def run_warmup(device: str) -> list:
    from engine import Engine, lineage_config
    from engine.loader import load_model
    loaded = load_model("small-trained", __import__("torch").float32, device)
    # the tiny-pool gate's engine (gates/test_page_safety.py): 4,608 slots of 64, chunk 128, max batch 32
    cfg = lineage_config("fused", backend="flex", device=device, poison=True, chunk_tokens=128, num_pages=73,
                         compile_warmup=True, progress=False)
    return _flex_backends([Engine(cfg, loaded=loaded).runner.backend])


def run_kernels(device: str) -> list:
    import torch
    from gates.kernel_check import CPU_FLEX_SHAPE, DECODE_LENS, PREFILL_LENS, check_kernel, make_case, run_kernel
    from kernels.flex_backend import FlexBackend
    H, kvh, d = CPU_FLEX_SHAPE
    used = []
    for kind in ("decode", "prefill"):
        if kind == "decode":
            kv, q = DECODE_LENS["edges"], None
        else:
            q, kv = zip(*PREFILL_LENS["edges"])
        for page in (64, 256):     # test_kernel_gate[flex-*-h4kv2d64-p*-fp32-edges]
            used.append(FlexBackend())
            check_kernel(used[-1], kind, device=device, num_heads=H, kv_heads=kvh, head_dim=d, page_size=page,
                         kv_lens=kv, q_lens=q, seed=H * 1000 + d + page)
    # test_kernel_large_page_count[flex-*] and test_decode_kernels_agree[flex]
    used.append(FlexBackend())
    check_kernel(used[-1], "decode", device=device, num_heads=H, kv_heads=kvh, head_dim=d, page_size=64,
                 kv_lens=[1, 64, 65, 200, 256, 257, 300, 129, 380], num_pages=3000, high_pages=True, seed=7)
    q, kv = zip(*PREFILL_LENS["edges"])
    used.append(FlexBackend())
    check_kernel(used[-1], "prefill", device=device, num_heads=H, kv_heads=kvh, head_dim=d, page_size=64,
                 kv_lens=kv, q_lens=q, num_pages=3000, high_pages=True, seed=7)
    case = make_case(device=device, dtype=torch.float32, num_heads=H, kv_heads=kvh, head_dim=d, page_size=256,
                     kv_lens=[1, 17, 255, 256, 257, 300, 129, 64, 380], seed=3)
    used.append(FlexBackend())
    run_kernel(used[-1], "decode", case, d ** -0.5)
    return used


def run_engine(device: str, requests: int = 6, budget: int = 12) -> list:
    import torch
    from engine import Engine, lineage_config
    from engine.loader import load_model
    from engine.workload import MIXED_CPU, RequestSpec
    loaded = load_model("small-trained", torch.float32, device)
    specs = [RequestSpec(s.request_id, s.prompt, min(s.budget, budget))
             for s in MIXED_CPU.requests(loaded[0].shape.vocab_size)[:requests]]
    cfg = lineage_config("fused", backend="flex", device=device, poison=True, chunk_tokens=MIXED_CPU.chunk_tokens,
                         compile_warmup=False, progress=False)
    eng = Engine(cfg, loaded=loaded)
    eng.run(specs)
    return _flex_backends([eng.runner.backend])


def child(scenario: str, device: str) -> dict:
    """One scenario in this process: its compile counts and times."""
    import torch
    torch.set_num_threads(int(os.environ.get("STEPGATE_THREADS", "1")))
    from torch._dynamo.utils import counters, get_compilation_metrics
    t0, c0 = time.perf_counter(), _cpu_s()
    backends = {"warmup": run_warmup, "kernels": run_kernels, "engine": run_engine}[scenario](device)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    shapes = set().union(*(b.compiled_shapes for b in backends)) if backends else set()
    metrics = get_compilation_metrics()
    # frame compiles from the compilation metrics: counters["frames"] skips fullgraph compiles
    return dict(scenario=scenario, frames=len(metrics),
                recompiles=sum(1 for m in metrics if getattr(m, "recompile_reason", None)),
                graphs=counters["stats"]["unique_graphs"], breaks=sum(counters["graph_break"].values()),
                fx_miss=counters["inductor"]["fxgraph_cache_miss"], fx_hit=counters["inductor"]["fxgraph_cache_hit"],
                shapes=len(shapes), wall_s=round(wall, 2), cpu_s=round(cpu, 2), torch=torch.__version__,
                dynamic=None)


def spawn(scenario: str, device: str, cache: str, tmp: str) -> dict:
    # a fresh TMPDIR per process: Inductor keeps its precompiled C++ header under the temp dir, outside the cache
    # folder, so a kept cache folder is all a warm run may rely on
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TMPDIR=tmp, PYTHONPATH=str(ROOT))
    env.pop("STEPGATE_COMPILE_CACHE", None)
    p = subprocess.run([sys.executable, "-m", "scripts.probes.compile_cost", "--child", scenario, "--device", device],
                       env=env, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{scenario} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    out = ["  ".join(f"{c:>10}" for c in COLUMNS)]
    out += ["  ".join(f"{r[c]:>10}" for c in COLUMNS) for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.compile_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("-s", "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {SCENARIOS}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout, no table)")
    ap.add_argument("--keep", metavar="DIR", help="keep the cache folders under DIR (default: a temp dir, removed)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.device)))
        return 0
    names = [s for s in a.scenarios.split(",") if s]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenarios {bad}; known: {SCENARIOS}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-cost-") as scratch:
        base = Path(a.keep or scratch)
        for s in names:
            cache = base / f"{s}-cache"
            for phase in ("cold", "warm"):
                tmp = Path(scratch) / f"{s}-{phase}-tmp"
                tmp.mkdir(parents=True)
                row = dict(spawn(s, a.device, str(cache), str(tmp)), phase=phase)
                rows.append(row)
                if a.json != "-":
                    print(table([row]).splitlines()[-1] if len(rows) > 1 else table([row]), flush=True)
    if a.json == "-":
        print(json.dumps(rows, indent=1))
    elif a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
