"""Tensor parallel against one GPU, measured in one process: the pure decode step and a closed run, per tp.

    python -m bench.tp_bench --model qwen2.5-1.5b-random --device cuda --engine flash --tp 1,2 \\
        --out results/tp_bench.json

One engine per tp, alive side by side (the workers load the model by name on their own GPUs, so every rank has the
same seeded weights). The pure decode step: `--rows` requests of the mixed draw decode together, and `--steps` pure
decode steps are timed with the device synchronised around each (the trace's durations); the engines take turns,
`--rounds` times, so drift hits both alike. The closed run: `--closed` requests of the mixed draw with `--new-tokens`
each, all at time zero, timed to the last request, after a warm-up run of `--warmup-requests`. Prints one table.

A row's label says whether its engine replays captured decode steps ("2") or runs them eagerly ("2, eager"): at tp
> 1 they are off for now (engine.Engine.use_cuda_graphs says why). `--tp1-eager` adds tp 1 run eagerly, and each
eager row's ratio is taken against it: eager against eager, captured against captured."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

from engine import Engine
from engine.config import lineage_config
from engine.loader import is_small
from engine.scheduler import CHUNK_TOKENS, StepKind
from engine.workload import MIXED, MIXED_CPU, RequestSpec


def renamed(specs: list[RequestSpec], tag: str, budget: int | None = None) -> list[RequestSpec]:
    """The same requests under fresh ids (one engine serves every run)."""
    return [RequestSpec(f"{tag}-{s.request_id}", s.prompt, budget or s.budget) for s in specs]


def pure_decode(eng: Engine, specs: list[RequestSpec], steps: int, tag: str) -> list[float]:
    """Durations (s) of `steps` pure decode steps with every request of `specs` decoding."""
    # budget: the early rows decode while the late ones still read their prompts, and must outlast the timed steps
    for s in renamed(specs, tag, budget=3 * steps + 100):
        eng.submit(s.prompt, s.budget, s.request_id)
    while True:    # until every row has read its prompt
        rec = eng.step()
        if rec.kind == StepKind.PURE_DECODE and rec.decode_tokens == len(specs):
            break
    out = []
    for _ in range(steps):
        rec = eng.step()
        assert rec.kind == StepKind.PURE_DECODE and rec.decode_tokens == len(specs), rec
        out.append(rec.duration)
    for rid in [r.request_id for r in eng.scheduler.running]:
        eng.cancel(rid)
    while eng.scheduler.has_work:
        eng.step()
    return out


def closed(eng: Engine, specs: list[RequestSpec], tag: str) -> dict:
    first = len(eng.trace)
    eng.reset_clock()
    res = eng.run(renamed(specs, tag))
    mine = [r for rid, r in res.items() if rid.startswith(f"{tag}-")]
    took = max(r.finish_time for r in mine) - min(r.arrival_time for r in mine)
    trace = eng.trace[first:]
    pure = [s.duration for s in trace if s.kind == StepKind.PURE_DECODE]
    return dict(time_to_last_s=took, requests_per_s=len(mine) / took, steps=len(trace),
                pure_decode_median_ms=statistics.median(pure) * 1e3 if pure else None,
                tokens={r.request_id.split("-", 1)[1]: r.tokens for r in mine})


def build(a, dtype: str, tp: int, graphs: bool | None = None):
    """(label, engine, seconds to build). At tp > 1 an engine whose build fails (its traceback printed) is built
    again with CUDA graphs off, so that one call still measures something; None if that fails too."""
    for graphs in (graphs, False) if tp > 1 and graphs is None else (graphs,):
        t0 = time.perf_counter()
        cfg = lineage_config(a.engine, device=a.device, dtype=dtype, chunk_tokens=a.chunk_tokens, sync_trace=True,
                             progress=False, tp=tp, cuda_graphs=graphs)
        try:
            eng = Engine(cfg, a.model)
        except Exception:  # noqa: BLE001 (reported; the other configurations still run)
            if tp == 1:
                raise
            traceback.print_exc()
            print(f"tp={tp} (cuda_graphs={graphs}): the build failed", flush=True)
            continue
        label = str(tp) if eng.runner.graphs is not None else f"{tp}, eager"
        print(f"tp={label}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        return label, eng, time.perf_counter() - t0
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tp_bench", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--engine", default="flash")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--closed", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--warmup-requests", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS)
    ap.add_argument("--tp1-eager", action="store_true",
                    help="also tp 1 without captured steps: the baseline of the eager rows' ratios")
    ap.add_argument("--out", default=None, help="write the figures here (JSON)")
    a = ap.parse_args(argv)
    from engine.tp.worker import dump_stacks_on_usr1
    dump_stacks_on_usr1()      # a hung run signalled with SIGUSR1 (timeout -s USR1) shows where rank 0 waits
    dtype = a.dtype or ("float16" if a.device.startswith("cuda") else "float32")
    mixed = MIXED_CPU if is_small(a.model) else MIXED
    engines, built = {}, {}      # label ("1", "2", "1, eager", "2, eager") -> engine, seconds to build it
    plan = [(int(x), None) for x in a.tp.split(",")] + ([(1, False)] if a.tp1_eager else [])
    for tp, graphs in plan:
        got = build(a, dtype, tp, graphs)
        if got and got[0] in engines:     # off CUDA tp 1 is eager already: one engine of a label
            got[1].close()
        elif got:
            engines[got[0]], built[got[0]] = got[1], got[2]
    labels = list(engines)
    vocab = engines[labels[0]].shape.vocab_size
    decode_specs = mixed.scaled(a.rows).requests(vocab)
    steps = {k: [] for k in labels}
    for rnd in range(a.rounds):
        for k in labels:
            steps[k] += pure_decode(engines[k], decode_specs, a.steps, f"decode{rnd}")
    specs = replace(mixed, name=f"{mixed.name}-new{a.new_tokens}").with_budget(a.new_tokens).scaled(a.closed) \
        .requests(vocab)
    runs = {}
    for k in labels:
        closed(engines[k], specs[:a.warmup_requests], "warmup")
        runs[k] = closed(engines[k], specs, "closed")
        graphs = engines[k].runner.graphs
        runs[k]["graph_replays"] = graphs.replays if graphs is not None else 0
        engines[k].close()
    base = labels[0]
    rows = []
    for k in labels:
        med = statistics.median(steps[k]) * 1e3
        like = "1, eager" if k.endswith("eager") and "1, eager" in steps else base   # eager against eager
        rows.append(dict(tp=k, build_s=built[k], pure_decode_ms=med, pure_decode_steps=len(steps[k]), ratio_to=like,
                         pure_decode_ratio=med / (statistics.median(steps[like]) * 1e3),
                         same_tokens=sum(runs[k]["tokens"][r] == runs[base]["tokens"][r] for r in runs[base]["tokens"]),
                         **{f: v for f, v in runs[k].items() if f != "tokens"}))
    print(f"\n{a.engine} on {a.model} ({a.device}, {dtype}), chunk {a.chunk_tokens}; pure decode: {a.rows} rows, "
          f"{a.rounds} x {a.steps} steps; closed: {a.closed} requests x {a.new_tokens} new tokens")
    print(f"| tp | pure decode step, median (ms) | vs tp 1 (like for like) | closed {a.closed}: time to last (s) | "
          f"req/s | same tokens as tp {base} | graph replays |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['pure_decode_ms']:.3f} | {r['pure_decode_ratio']:.3f}x of {r['ratio_to']} "
              f"| {r['time_to_last_s']:.3f} "
              f"| {r['requests_per_s']:.1f} | {r['same_tokens']}/{a.closed} | {r['graph_replays']} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(args=vars(a), rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
