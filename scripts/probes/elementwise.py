"""The elementwise pieces (engine/layer_kernels.py) at the 1.5B shape: microseconds and achieved bandwidth per call, for each
token count, in four modes: eager; compiled with every size dynamic (torch.compile's dynamic=True, the engine's
earlier mode); compiled with static sizes and a dynamic token count; and what the engine runs now (its warm-up's
compile: the same, unless the engine changes it). Each timing is a CUDA graph of `--layers` calls (as a step's
layers run them), so launch gaps count as they do in a captured step. Each compiled mode compiles its own copy of
the functions (Dynamo keeps its compiled graphs on the code object, which the modes would otherwise share).

    python -m scripts.probes.elementwise --tokens 32,544,8192 --out results/elementwise.json
"""
from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch

from engine import layer_kernels as M
from engine.model import ModelShape
from engine.loader import QWEN25_1P5B, qwen2_config

from bench.stats import graph_time


def _inputs(s: ModelShape, T: int, dev, dt):
    """Each piece's arguments at T tokens, in the model's layouts, and the bytes a call must move (read + write)."""
    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=dt)
    e = torch.finfo(dt).bits // 8
    h, qk = s.hidden_size, s.num_heads + s.num_kv_heads
    qkv = r(T, qk + s.num_kv_heads, s.head_dim)
    return {
        "rms_norm": ((r(T, h), torch.ones(h, device=dev, dtype=dt), 1e-6), 2 * T * h * e),
        "add_rms_norm": ((r(T, h), r(T, h), torch.ones(h, device=dev, dtype=dt), 1e-6), 4 * T * h * e),
        "rope": ((qkv[:, :qk], r(T, s.head_dim), r(T, s.head_dim)), (2 * qk + 2) * T * s.head_dim * e),
        "silu_mul": ((r(T, 2 * s.intermediate_size),), 3 * T * s.intermediate_size * e),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.elementwise", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32,544,8192")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("scripts.probes.elementwise: needs CUDA (the pieces are compiled for the GPU)", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.float16
    s = ModelShape.of(qwen2_config(**QWEN25_1P5B))
    token_counts = [int(t) for t in a.tokens.split(",")]
    modes = {"eager": dict(M.EAGER_OPS)}
    # all sizes symbolic: what the compiled pieces were before (one kernel per piece for any model width)
    modes["all-dynamic"] = {n: torch.compile(_fresh(f), dynamic=True, fullgraph=True) for n, f in M.EAGER_OPS.items()}
    modes["tokens-dynamic"] = {n: torch.compile(_fresh(f), dynamic=None, fullgraph=True) for n, f in M.EAGER_OPS.items()}
    model = types.SimpleNamespace(shape=s, model=types.SimpleNamespace(
        norm=types.SimpleNamespace(weight=torch.nn.Parameter(torch.ones(s.hidden_size, device=dev, dtype=dt)))))
    ops, why = M.try_compile_elementwise(dev, dt, model, tokens=max(token_counts))
    if why:
        print(f"scripts.probes.elementwise: torch.compile failed: {why}", file=sys.stderr)
        return 2
    modes["engine"] = dict(ops)
    rows = []
    for T in token_counts:
        args = _inputs(s, T, dev, dt)
        for name, (x, nbytes) in args.items():
            ref = None
            for mode, ops in modes.items():
                fn = ops[name]
                us, out = graph_time(lambda: [_first(fn(*x)) for _ in range(a.layers)][-1], a.reps, a.layers)
                ref = out if ref is None else ref
                rows.append(dict(piece=name, tokens=T, mode=mode, us=round(us, 2), gb_s=round(nbytes / us / 1e3, 1),
                                 max_abs_diff=float((out - ref).abs().max())))
    print(f"{'piece':13} {'tokens':>6} " + " ".join(f"{m + ' us (GB/s)':>24}" for m in modes))
    for i in range(0, len(rows), len(modes)):
        grp = rows[i:i + len(modes)]
        print(f"{grp[0]['piece']:13} {grp[0]['tokens']:>6} "
              + " ".join(f"{r['us']:>14.2f} ({r['gb_s']:>6.0f})" for r in grp))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(shape="qwen2.5-1.5b", dtype="float16", layers=a.layers, rows=rows),
                                          indent=1))
    return 0


def _fresh(fn):
    """A copy of `fn` with a code object of its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


if __name__ == "__main__":
    sys.exit(main())
