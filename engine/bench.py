"""Serving benchmark: closed runs, open (Poisson) arrivals, the step trace by kind, token gaps, the capped-pool control
and transformers' own continuous batching side by side (the peer).

    python -m engine.bench --model small --device cpu --engine fused --quick --threads 1 --out results/
    python -m engine.bench --model qwen2.5-1.5b-random --device cuda --engine flash --out results/ \\
        --closed --peer --batches 8,32,64 --uniform 256
    python -m engine.bench --model qwen2.5-1.5b-random --device cuda --engine flash --out results/ --open \\
        --arrivals 200 --rates 4,8,16,32 --append

Parts (none named: all of them): --closed, --open (with the capped-pool control unless --no-capped), --peer.
- closed: the whole batch at time zero, timed to its LAST request; `--warmups` discarded runs (2), median of
  `--reps` (5). Mixed batches (`--batches` 8,32,64) and the uniform control (`--uniform` 256), from
  engine/workload.py (the *_CPU variants for the small model); the shared-prefix workload with `--shared N`.
  Prefix cache: `--prefix-cache on|off|on,off` (each closed workload under each); `--passes 2` serves each
  workload twice on one engine and times the second pass (its prompts found cached). Rows carry prefix_cache,
  pass_no, prefix_hit_rate (prompt positions found cached / prompt positions), prefix_pages_saved, prefix_evictions.
- open: `--arrivals` (400) Poisson arrivals per rate from a fixed seed, delivered while the engine works; served rate
  (requests/s) and median queue wait. Rates: `--rates` (ascending), or from the closed mixed-32 throughput upward
  by x2; the sweep stops once the served rate stops rising (by under `--rise` 5%).
- capped: the same open runs with the pool capped: 0.5 GiB for the 1.5B model, and for other models the same
  number of KV positions (scaled by 1/4 with the CPU workloads, whose prompts and budgets are scaled by 1/4).
- peer: the closed workloads through transformers' continuous batching (`init_continuous_batching`, per-request
  `max_new_tokens`, EOS disabled so budgets are honoured) on the same weights, as ours / peer time to last request.
- always: the step trace by kind (sync_trace on) and the token gaps of requests already decoding (median, worst).

Rows go to <out>/<engine>/runs.csv + runs.jsonl (one row per run), arrivals.csv (one row per request of the open
runs), steps.csv (every measured step), summary.json, and PNG plots when matplotlib is installed. Files are
rewritten per invocation unless --append.
"""
from __future__ import annotations

import argparse
import csv
import inspect
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .config import LINEAGE, lineage_config
from .engine import Engine, torch_dtype
from .loader import QWEN25_1P5B, RANDOM_1P5B, is_small, load_model
from .runner import ModelRunner
from .workload import (MIXED, MIXED_CPU, SHARED, SHARED_CPU, UNIFORM, UNIFORM_CPU, RequestSpec, Workload,
                       poisson_arrivals)

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

GIB = 1 << 30
CAP_1P5B_BYTES = GIB // 2                      # the capped pool of the 1.5B model
STEP_KINDS = ("pure-decode", "loaded", "chunk-only")
ARRIVAL_FIELDS = ["part", "engine", "model", "rate", "request_id", "prompt_len", "budget", "tokens", "arrival_s",
                  "admit_s", "first_token_s", "finish_s", "queue_wait_s", "ttft_s", "e2e_s"]
STEP_FIELDS = ["run", "part", "engine", "workload", "index", "kind", "duration_ms", "prompt_positions",
               "decode_tokens", "chunks", "admitted", "start_s"]


# -- setup ---------------------------------------------------------------------------------------------------------
@dataclass
class Setup:
    model: str
    device: str
    dtype: str
    engine: str
    chunk_tokens: int
    max_batch: int
    mixed: Workload
    uniform: Workload
    cpu_scaled: bool
    loaded: tuple = None
    extra: dict = field(default_factory=dict)
    shared: Workload = None         # the shared-prefix workload (--shared)

    @property
    def model_arg(self):
        return None if self.model == "small" else self.model

    def config(self, **kw):
        return lineage_config(self.engine, device=self.device, dtype=self.dtype, chunk_tokens=self.chunk_tokens,
                              max_batch=self.max_batch, sync_trace=True, **{**self.extra, **kw})

    def sync(self):
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()

    def capped_bytes(self) -> int:
        """0.5 GiB for the 1.5B model; otherwise the same number of KV positions (1/4 of them with the CPU
        workloads, whose lengths are scaled by 1/4), in this model's bytes per position."""
        if self.model == RANDOM_1P5B:
            return CAP_1P5B_BYTES
        from .loader import qwen2_config
        from .model import ModelShape
        big = ModelShape.of(qwen2_config(**QWEN25_1P5B))
        positions = CAP_1P5B_BYTES // ModelRunner.bytes_per_page(big, 1, torch.float16)
        if self.cpu_scaled:
            positions //= 4
        shape = self.loaded[0].shape
        return positions * ModelRunner.bytes_per_page(shape, 1, torch_dtype(self.dtype))


def progress(total=None, desc="", leave=False, disable=False):
    if tqdm is None or disable:
        class Null:
            def update(self, n=1): pass
            def close(self): pass
            def set_postfix_str(self, s): pass
            n = 0
        return Null()
    return tqdm(total=total, desc=desc, leave=leave, dynamic_ncols=True, file=sys.stderr)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def quantile(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


# -- one engine run ------------------------------------------------------------------------------------------------
def token_gaps(results) -> list[float]:
    """Waits between consecutive tokens of requests already decoding (seconds)."""
    gaps = []
    for r in results.values():
        t = r.token_times
        gaps.extend(b - a for a, b in zip(t, t[1:]))
    return gaps


def run_engine(setup: Setup, specs: list[RequestSpec], open_loop: bool, desc: str, quiet: bool, **cfg_kw):
    """Serve `specs` on a fresh engine (fresh pool and trace, shared weights). Returns (metrics, results, trace)."""
    return serve_passes(setup, specs, open_loop, desc, quiet, 1, **cfg_kw)[0]


def serve_passes(setup: Setup, specs: list[RequestSpec], open_loop: bool, desc: str, quiet: bool, passes: int,
                 **cfg_kw) -> list[tuple[dict, dict, list]]:
    """Serve `specs` `passes` times on one fresh engine (a later pass finds the earlier passes' pages in the prefix
    cache; its request ids get a "~k" suffix). Returns (metrics, results, trace) per pass."""
    eng = Engine(setup.config(**cfg_kw), loaded=setup.loaded)
    out = []
    for k in range(1, passes + 1):
        run_specs = specs if k == 1 else [replace(s, request_id=f"{s.request_id}~{k}") for s in specs]
        ids = {s.request_id for s in run_specs}
        total = sum(s.budget for s in run_specs)
        bar = progress(total, desc + (f" pass {k}" if passes > 1 else ""), disable=quiet)
        emitted = [0]

        def on_step(rec):
            n = sum(len(r.output) for rid, r in eng.requests.items() if rid in ids)
            bar.update(n - emitted[0])
            emitted[0] = n
        setup.sync()
        eng.reset_clock()
        first_step, evictions = len(eng.trace), eng.pool.cache.evictions if eng.pool.cache else 0
        results = {rid: r for rid, r in eng.run(run_specs, open_loop=open_loop, progress=on_step).items()
                   if rid in ids}
        bar.close()
        trace = eng.trace[first_step:]
        captured = [g for g in (getattr(eng.runner, "graphs", None), getattr(eng.runner, "step_graphs", None)) if g is not None]
        m = run_metrics(results, trace, eng.pool.num_pages,
                        graph_replays=sum(g.replays for g in captured), graph_capture_s=sum(g.capture_s for g in captured),
                        graph_fallbacks=getattr(getattr(eng.runner, "step_graphs", None), "fallbacks", 0),
                        graph_pool_mib=sum(g.pool_bytes for g in captured) / (1 << 20))
        hit = sum(r.cached_prefix for r in results.values())
        m.update(prefix_cache="on" if eng.pool.cache else "off", pass_no=k,
                 prefix_hit_rate=hit / max(1, sum(len(r.prompt) for r in results.values())),
                 prefix_pages_saved=hit // eng.pool.page_size,
                 prefix_evictions=(eng.pool.cache.evictions - evictions) if eng.pool.cache else 0)
        out.append((m, results, trace))
    del eng
    return out


def run_metrics(results: dict, trace: list, pool_pages: int, **extra) -> dict:
    done = [r for r in results.values() if r.finish_time is not None]
    first_arrival = min(r.arrival_time for r in results.values())
    last_finish = max(r.finish_time for r in done)
    makespan = last_finish - first_arrival
    gaps = token_gaps(results)
    waits = [r.queue_wait for r in results.values()]
    tokens = sum(len(r.tokens) for r in results.values())
    m = dict(requests=len(results), finished=len(done), tokens=tokens, time_to_last_s=makespan,
             tokens_per_s=tokens / makespan if makespan > 0 else None,
             served_rate=len(done) / makespan if makespan > 0 else None,
             queue_wait_median_s=median(waits), queue_wait_worst_s=max((w for w in waits if w is not None),
                                                                       default=None),
             ttft_median_s=median([r.first_token_time - r.arrival_time for r in done if r.first_token_time]),
             gap_median_ms=(median(gaps) or 0) * 1e3 if gaps else None,
             gap_worst_ms=max(gaps) * 1e3 if gaps else None, gap_p99_ms=(quantile(gaps, 0.99) or 0) * 1e3
             if gaps else None, steps=len(trace), pool_pages=pool_pages, **extra)
    for kind in STEP_KINDS:
        d = [s.duration for s in trace if s.kind == kind]
        m[f"steps_{kind}"] = len(d)
        m[f"step_{kind}_median_ms"] = median(d) * 1e3 if d else None
        m[f"step_{kind}_total_s"] = sum(d)
    return m


# -- the bench -----------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, setup: Setup, args):
        self.s = setup
        self.a = args
        self.runs: list[dict] = []
        self.arrivals: list[dict] = []
        self.steps: list[dict] = []
        self.summary: dict = {"setup": self.describe()}
        self.run_no = 0
        self.closed_tokens: dict[str, dict[str, list[int]]] = {}   # the last measured closed run's tokens

    def describe(self) -> dict:
        s = self.s
        return dict(model=s.model, device=s.device, dtype=s.dtype, engine=s.engine, engine_config=LINEAGE[s.engine],
                    chunk_tokens=s.chunk_tokens, max_batch=s.max_batch, mixed=s.mixed.name, uniform=s.uniform.name,
                    torch=torch.__version__, python=platform.python_version(), host=platform.node(),
                    gpu=torch.cuda.get_device_name() if torch.device(s.device).type == "cuda" else None,
                    threads=torch.get_num_threads(), warmups=self.a.warmups, reps=self.a.reps, quick=self.a.quick,
                    started=time.strftime("%F %T"))

    def base_row(self, part, workload, **kw) -> dict:
        s = self.s
        return dict(part=part, engine=s.engine, model=s.model, device=s.device, dtype=s.dtype, workload=workload,
                    **kw)

    def keep_steps(self, run_id, part, workload, trace):
        for t in trace:
            self.steps.append(dict(run=run_id, part=part, engine=self.s.engine, workload=workload, index=t.index,
                                   kind=t.kind, duration_ms=t.duration * 1e3, prompt_positions=t.prompt_positions,
                                   decode_tokens=t.decode_tokens, chunks=t.chunks, admitted=t.admitted,
                                   start_s=t.start))

    # -- closed --------------------------------------------------------------------------------------------------
    def closed_workloads(self) -> list[tuple[str, Workload]]:
        out = [(f"{self.s.mixed.name}-{n}", self.s.mixed.scaled(n)) for n in self.a.batches]
        out += [(f"{self.s.uniform.name}-{n}", self.s.uniform.scaled(n)) for n in self.a.uniform]
        out += [(f"{self.s.shared.name}-{n}", self.s.shared.scaled(n)) for n in self.a.shared]
        return out

    def closed(self):
        vocab = self.s.loaded[0].shape.vocab_size
        res = {}
        for base, wl in self.closed_workloads():
            specs = wl.requests(vocab)
            for mode in self.a.prefix_cache:
                # the first --prefix-cache mode keeps the workload's plain name (the peer compares against it)
                name = base if mode == self.a.prefix_cache[0] else f"{base}@cache-{mode}"
                res[name] = self.closed_one(base, name, specs, mode)
        self.summary["closed"] = res
        return res

    def closed_one(self, base: str, name: str, specs: list[RequestSpec], mode: str) -> dict:
        """Warm-ups and reps of one closed workload with the prefix cache `mode`; each serves it --passes times on
        one engine, and the last pass is the one timed (each pass gets its row)."""
        times, passes = [], self.a.passes
        for i in range(self.a.warmups + self.a.reps):
            warm = i < self.a.warmups
            desc = f"closed {name} {'warm-up' if warm else 'rep'} {i + 1 if warm else i - self.a.warmups + 1}"
            for m, results, trace in serve_passes(self.s, specs, False, desc, self.a.no_progress, passes,
                                                  prefix_cache=mode == "on"):
                self.run_no += 1
                self.runs.append(self.base_row("closed", name, run=self.run_no, batch=len(specs), rep=i,
                                               warmup=warm, **m))
            if not warm:
                times.append(m["time_to_last_s"])
                self.closed_tokens[name] = {k.split("~")[0]: r.tokens for k, r in results.items()}
                self.keep_steps(self.run_no, "closed", name, trace)
        rows = [r for r in self.runs if r["part"] == "closed" and r["workload"] == name and not r["warmup"]]
        last = [r for r in rows if r["pass_no"] == passes]
        res = dict(time_to_last_median_s=median(times), times_s=times, prefix_cache=mode, passes=passes,
                   tokens_per_s_median=median([r["tokens_per_s"] for r in last]),
                   ttft_median_s=median([r["ttft_median_s"] for r in last]),
                   prefix_hit_rate=median([r["prefix_hit_rate"] for r in last]),
                   prefix_pages_saved=median([r["prefix_pages_saved"] for r in last]),
                   gap_median_ms=median([r["gap_median_ms"] for r in last]),
                   gap_worst_ms=max((r["gap_worst_ms"] or 0) for r in last) if last else None,
                   **{f"step_{k}_median_ms": median([r[f"step_{k}_median_ms"] for r in last]) for k in STEP_KINDS})
        if passes > 1:
            res["per_pass"] = {k: {f: median([r[f] for r in rows if r["pass_no"] == k]) for f in
                                   ("time_to_last_s", "ttft_median_s", "tokens_per_s", "prefix_hit_rate")}
                               for k in range(1, passes + 1)}
        log(f"closed {name}: time to last request, median of {len(times)}"
            f"{f' (pass {passes} of {passes})' if passes > 1 else ''}: {res['time_to_last_median_s']:.3f} s "
            f"({res['tokens_per_s_median']:.1f} tokens/s, first token median {fmt(res['ttft_median_s'], 3)} s); "
            f"prefix cache {mode}: hit rate {res['prefix_hit_rate']:.3f}, {res['prefix_pages_saved']} pages saved; "
            f"token gaps median {fmt(res['gap_median_ms'])} ms, worst {fmt(res['gap_worst_ms'])} ms")
        return res

    # -- open ----------------------------------------------------------------------------------------------------
    def open_specs(self, rate) -> list[RequestSpec]:
        wl = self.s.mixed.scaled(self.a.arrivals)
        return poisson_arrivals(wl.requests(self.s.loaded[0].shape.vocab_size), rate)

    def start_rate(self) -> float:
        closed = self.summary.get("closed", {})
        key = f"{self.s.mixed.name}-32"
        cap = None
        if key in closed and closed[key]["time_to_last_median_s"]:
            cap = 32 / closed[key]["time_to_last_median_s"]
        else:
            # a short closed probe: the mixed draw's first 16 requests
            specs = self.s.mixed.scaled(16).requests(self.s.loaded[0].shape.vocab_size)
            m, _, _ = run_engine(self.s, specs, False, "open: capacity probe", self.a.no_progress)
            cap = 16 / m["time_to_last_s"]
        return max(cap / 4, 1e-3)

    def open_sweep(self, part: str, rates: list[float] | None, stop_when_flat: bool, **cfg_kw) -> list[dict]:
        out = []
        best = 0.0
        auto = rates is None
        rate = self.start_rate() if auto else None
        todo = list(rates or [])
        while True:
            if auto:
                if len(out) >= self.a.max_rates:
                    break
                r = rate
                rate *= 2
            else:
                if not todo:
                    break
                r = todo.pop(0)
            specs = self.open_specs(r)
            m, results, trace = run_engine(self.s, specs, True, f"{part} {r:.3g} req/s", self.a.no_progress,
                                           **cfg_kw)
            self.run_no += 1
            offered = len(specs) / max(s.arrival_time for s in specs)
            row = self.base_row(part, f"{self.s.mixed.name}-open-{len(specs)}", run=self.run_no, rate=r,
                                offered_rate=offered, warmup=False, kv_cache_bytes=cfg_kw.get("kv_cache_bytes"),
                                **m)
            self.runs.append(row)
            self.keep_steps(self.run_no, part, row["workload"], trace)
            budgets = {s.request_id: s.budget for s in specs}
            for rr in results.values():
                spec_budget = budgets.get(rr.request_id)
                self.arrivals.append(dict(
                    part=part, engine=self.s.engine, model=self.s.model, rate=r, request_id=rr.request_id,
                    prompt_len=len(rr.prompt), budget=spec_budget, tokens=len(rr.tokens), arrival_s=rr.arrival_time,
                    admit_s=rr.admit_time, first_token_s=rr.first_token_time, finish_s=rr.finish_time,
                    queue_wait_s=rr.queue_wait,
                    ttft_s=None if rr.first_token_time is None else rr.first_token_time - rr.arrival_time,
                    e2e_s=None if rr.finish_time is None else rr.finish_time - rr.arrival_time))
            out.append(row)
            log(f"{part} {r:.3g} req/s offered ({offered:.3g} realised): served {m['served_rate']:.3g} req/s, "
                f"median queue wait {m['queue_wait_median_s']:.3f} s, token gaps median {fmt(m['gap_median_ms'])} ms "
                f"worst {fmt(m['gap_worst_ms'])} ms")
            served = m["served_rate"] or 0.0
            flat = served < best * (1 + self.a.rise)
            best = max(best, served)
            if stop_when_flat and flat:
                log(f"{part}: served rate stopped rising at {r:.3g} req/s offered (best {best:.3g} req/s)")
                break
        return out

    def open(self):
        rows = self.open_sweep("open", self.a.rates, stop_when_flat=not self.a.no_stop)
        self.summary["open"] = summarise_open(rows)
        if not self.a.no_capped:
            cap = self.s.capped_bytes()
            rates = [r["rate"] for r in rows]
            crow = self.open_sweep("capped", rates, stop_when_flat=False, kv_cache_bytes=cap)
            self.summary["capped"] = dict(kv_cache_bytes=cap, **summarise_open(crow))

    # -- peer ----------------------------------------------------------------------------------------------------
    def peer(self):
        closed = self.summary.get("closed") or self.closed()
        peer = Peer(self.s, self.a)
        res = {}
        vocab = self.s.loaded[0].shape.vocab_size
        for name, wl in self.closed_workloads():
            specs = wl.requests(vocab)
            times, info = peer.closed(specs, name, self.a.peer_warmups, self.a.peer_reps, self,
                                      self.closed_tokens.get(name, {}))
            ours = closed[name]["time_to_last_median_s"]
            p = median(times)
            res[name] = dict(peer_time_to_last_median_s=p, peer_times_s=times,
                             ours_time_to_last_median_s=ours, ours_over_peer=ours / p if p else None, **info)
            log(f"peer {name}: transformers {p:.3f} s, ours {ours:.3f} s: ours / peer = {ours / p:.3f} "
                f"({info['attn_implementation']}; budgets honoured: {info['budgets_honoured']}; same tokens as "
                f"ours: {info['same_tokens']}/{len(specs)})")
        peer.close()
        self.summary["peer"] = res

    # -- output --------------------------------------------------------------------------------------------------
    def write(self, out: Path, append: bool):
        out.mkdir(parents=True, exist_ok=True)
        runs_jsonl = out / "runs.jsonl"
        mode = "a" if append else "w"
        with open(runs_jsonl, mode) as f:
            for r in self.runs:
                f.write(json.dumps(r) + "\n")
        all_runs = [json.loads(x) for x in runs_jsonl.read_text().splitlines() if x.strip()]
        cols = []
        for r in all_runs:
            cols += [k for k in r if k not in cols]
        with open(out / "runs.csv", "w", newline="") as f:
            w = csv.DictWriter(f, cols)
            w.writeheader()
            w.writerows(all_runs)
        for name, rows, fields in (("arrivals.csv", self.arrivals, ARRIVAL_FIELDS),
                                   ("steps.csv", self.steps, STEP_FIELDS)):
            p = out / name
            new = not (append and p.exists())
            with open(p, "w" if new else "a", newline="") as f:
                w = csv.DictWriter(f, fields)
                if new:
                    w.writeheader()
                w.writerows(rows)
        sp = out / "summary.json"
        summary = self.summary
        if append and sp.exists():
            old = json.loads(sp.read_text())
            old.update({k: v for k, v in summary.items()})
            summary = old
        sp.write_text(json.dumps(summary, indent=1, default=str))
        plots = draw_plots(out)
        log(f"wrote {out}/: runs.csv runs.jsonl arrivals.csv steps.csv summary.json" +
            (f" {' '.join(plots)}" if plots else " (no plots: matplotlib missing or nothing to draw)"))


def summarise_open(rows) -> dict:
    best = max(rows, key=lambda r: r["served_rate"] or 0) if rows else None
    return dict(rates=[r["rate"] for r in rows], served=[r["served_rate"] for r in rows],
                queue_wait_median_s=[r["queue_wait_median_s"] for r in rows],
                gap_median_ms=[r["gap_median_ms"] for r in rows], gap_worst_ms=[r["gap_worst_ms"] for r in rows],
                capacity_req_per_s=best["served_rate"] if best else None)


# -- the peer: transformers' continuous batching -------------------------------------------------------------------
def _accepts(fn, name) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Peer:
    """transformers' own continuous batching on the same weights: a manager per workload (its warm-ups and reps
    share it), requests added with their own max_new_tokens, EOS disabled, greedy."""

    def __init__(self, setup: Setup, args):
        from .loader import hf_model
        self.s = setup
        self.a = args
        self.model = hf_model(setup.model_arg, torch_dtype(setup.dtype), setup.device)
        if args.peer_attn and args.peer_attn != "eager":
            self.model.set_attn_implementation(args.peer_attn)
        import transformers
        self.version = transformers.__version__

    def manager(self, specs):
        from transformers import GenerationConfig
        budget = max(s.budget for s in specs)
        gen = GenerationConfig(max_new_tokens=budget, do_sample=False, eos_token_id=-1, pad_token_id=0)
        # size its cache like ours: a full batch of the largest requests, and its per-step tokens like ours
        page = 256
        biggest = sorted((len(s.prompt) + s.budget for s in specs), reverse=True)[:self.s.max_batch]
        num_blocks = sum(-(-n // page) for n in biggest) + 2
        cb = dict(num_blocks=num_blocks, max_batch_tokens=self.s.chunk_tokens + self.s.max_batch,
                  max_requests_per_batch=self.s.max_batch, page_size=page, block_size=page)
        init = self.model.init_continuous_batching
        kw = {"generation_config": gen}
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            ContinuousBatchingConfig = None
        if ContinuousBatchingConfig is not None and _accepts(init, "continuous_batching_config"):
            params = inspect.signature(ContinuousBatchingConfig.__init__).parameters
            kw["continuous_batching_config"] = ContinuousBatchingConfig(
                **{k: v for k, v in cb.items() if k in params and not (k == "block_size" and "page_size" in params)})
        else:   # older 5.x: the cache's sizes live on the generation config
            for k, v in cb.items():
                setattr(gen, k, v)
        mgr = init(**kw)
        mgr.start()
        # the implementation it serves with (transformers may switch sdpa to paged|sdpa or to flash-attn; it
        # restores the original at stop)
        self.impl = getattr(self.model.config, "_attn_implementation", None)
        return mgr

    def serve(self, mgr, specs, tag, quiet, desc):
        add_kw = {}
        if _accepts(mgr.add_request, "eos_token_id"):
            add_kw["eos_token_id"] = -1
        ids = {}
        bar = progress(len(specs), desc, disable=quiet)
        t0 = time.perf_counter()
        for s in specs:
            rid = f"{s.request_id}{tag}"
            ids[rid] = s
            mgr.add_request(input_ids=list(s.prompt), request_id=rid, max_new_tokens=s.budget, **add_kw)
        out = {}
        deadline = t0 + self.a.peer_timeout
        while len(out) < len(specs):
            r = mgr.get_result(timeout=1)
            if r is None:
                if time.perf_counter() > deadline or not mgr.is_running():
                    raise RuntimeError(f"peer: {len(specs) - len(out)} requests never finished "
                                       f"(manager running: {mgr.is_running()})")
                continue
            if r.request_id in ids and r.is_finished():
                out[r.request_id] = r
                bar.update(1)
        t = time.perf_counter() - t0
        bar.close()
        errors = [r.error for r in out.values() if getattr(r, "error", None)]
        if errors:
            raise RuntimeError(f"peer: {len(errors)} requests failed: {errors[0]}")
        tokens = {ids[k].request_id: list(r.generated_tokens) for k, r in out.items()}
        return t, tokens

    def closed(self, specs, name, warmups, reps, bench: Bench, ours: dict[str, list[int]]):
        mgr = self.manager(specs)
        times, tokens = [], {}
        try:
            for i in range(warmups + reps):
                warm = i < warmups
                # a warm-up only has to reach every kernel and allocation once: a short one does (the peer on 200
                # requests takes minutes per run on an H200)
                run_specs = specs[:self.a.peer_warmup_requests] if warm and self.a.peer_warmup_requests else specs
                t, tokens = self.serve(mgr, run_specs, f"-p{i}", self.a.no_progress,
                                       f"peer {name} {'warm-up' if warm else 'rep'} {i + 1}")
                bench.run_no += 1
                ok = sum(len(tokens[s.request_id]) == s.budget for s in run_specs)
                bench.runs.append(bench.base_row("peer", name, run=bench.run_no, batch=len(run_specs), rep=i,
                                                 warmup=warm, time_to_last_s=t, requests=len(run_specs),
                                                 tokens=sum(len(v) for v in tokens.values()),
                                                 budgets_honoured=ok, peer="transformers-cb",
                                                 peer_version=self.version))
                if not warm:
                    times.append(t)
        finally:
            mgr.stop(block=True)
            if hasattr(mgr, "destroy"):
                try:
                    mgr.destroy()
                except Exception:   # noqa: BLE001 (cleanup only)
                    pass
        same = sum(ours.get(s.request_id) == tokens.get(s.request_id) for s in specs)
        return times, dict(attn_implementation=self.impl, transformers=self.version,
                           budgets_honoured=f"{sum(len(tokens.get(s.request_id, [])) == s.budget for s in specs)}"
                                            f"/{len(specs)}", same_tokens=same)

    def close(self):
        del self.model
        if torch.device(self.s.device).type == "cuda":
            torch.cuda.empty_cache()


# -- plots ---------------------------------------------------------------------------------------------------------
def draw_plots(out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines() if x.strip()]
    drawn = []
    opened = [r for r in runs if r["part"] in ("open", "capped")]
    if opened:
        fig, ax = plt.subplots(figsize=(6, 4))
        top = 0
        for part, style in (("open", "o-"), ("capped", "s--")):
            rows = sorted((r for r in opened if r["part"] == part), key=lambda r: r["rate"])
            if rows:
                ax.plot([r["offered_rate"] for r in rows], [r["served_rate"] for r in rows], style,
                        label="default pool" if part == "open" else "capped pool")
                top = max(top, max(r["offered_rate"] for r in rows))
        ax.plot([0, top], [0, top], ":", color="grey", label="served = offered")
        ax.set(xlabel="offered rate (requests/s)", ylabel="served rate (requests/s)",
               title=f"{opened[0]['engine']} on {opened[0]['model']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "served_vs_offered.png", dpi=120)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        for part, style in (("open", "o-"), ("capped", "s--")):
            rows = sorted((r for r in opened if r["part"] == part), key=lambda r: r["rate"])
            if rows:
                ax.plot([r["offered_rate"] for r in rows], [r["queue_wait_median_s"] for r in rows], style,
                        label="default pool" if part == "open" else "capped pool")
        ax.set(xlabel="offered rate (requests/s)", ylabel="median queue wait (s)", yscale="symlog")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "queue_wait.png", dpi=120)
        plt.close(fig)
        drawn += ["served_vs_offered.png", "queue_wait.png"]
    steps_p = out / "steps.csv"
    if steps_p.exists():
        with open(steps_p) as f:
            steps = list(csv.DictReader(f))
        data = [[float(s["duration_ms"]) for s in steps if s["kind"] == k] for k in STEP_KINDS]
        if any(data):
            fig, ax = plt.subplots(figsize=(6, 4))
            kinds = [k for k, d in zip(STEP_KINDS, data) if d]
            ax.boxplot([d for d in data if d], showfliers=False)
            ax.set_xticks(range(1, len(kinds) + 1), [f"{k}\n(n={len(d)})" for k, d in zip(kinds, data) if d])
            ax.set(ylabel="step time (ms)", title="step time by kind (device synchronised)")
            fig.tight_layout()
            fig.savefig(out / "step_time_by_kind.png", dpi=120)
            plt.close(fig)
            drawn.append("step_time_by_kind.png")
    gapped = [r for r in runs if r.get("gap_median_ms") is not None and not r.get("warmup")]
    if gapped:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        closed = [r for r in gapped if r["part"] == "closed"]
        if closed:
            names = sorted({r["workload"] for r in closed}, key=lambda n: [r["workload"] for r in closed].index(n))
            med = [median([r["gap_median_ms"] for r in closed if r["workload"] == n]) for n in names]
            worst = [max(r["gap_worst_ms"] for r in closed if r["workload"] == n) for n in names]
            x = range(len(names))
            axes[0].bar([i - 0.2 for i in x], med, 0.4, label="median")
            axes[0].bar([i + 0.2 for i in x], worst, 0.4, label="worst")
            axes[0].set_xticks(list(x), names, rotation=20)
            axes[0].set(ylabel="token gap (ms)", yscale="log", title="closed runs")
            axes[0].legend()
        for part, style in (("open", "o-"), ("capped", "s--")):
            rows = sorted((r for r in gapped if r["part"] == part), key=lambda r: r["rate"])
            if rows:
                axes[1].plot([r["rate"] for r in rows], [r["gap_median_ms"] for r in rows], style,
                             label=f"{part} median")
                axes[1].plot([r["rate"] for r in rows], [r["gap_worst_ms"] for r in rows], style, alpha=0.5,
                             label=f"{part} worst")
        axes[1].set(xlabel="offered rate (requests/s)", ylabel="token gap (ms)", yscale="log",
                    title="open runs (requests already decoding)")
        if any(r["part"] != "closed" for r in gapped):
            axes[1].legend()
        fig.tight_layout()
        fig.savefig(out / "token_gaps.png", dpi=120)
        plt.close(fig)
        drawn.append("token_gaps.png")
    return drawn


# -- CLI -----------------------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    if tqdm is not None:
        tqdm.write(msg, file=sys.stdout)
    else:
        print(msg, flush=True)


def fmt(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()] if s else []


def floats(s: str) -> list[float]:
    return sorted(float(x) for x in s.split(",") if x.strip())


def cli(prog: str, doc: str) -> argparse.ArgumentParser:
    """The arguments every engine CLI shares: which model, where, in what dtype, which engine configuration."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    ap.add_argument("--model", default="small", help="small, small-trained, qwen2.5-1.5b-random, or a checkpoint directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: fp32 cpu, fp16 cuda)")
    ap.add_argument("--engine", default="fused", choices=sorted(LINEAGE))
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's). On a shared CPU, 1 avoids OpenMP threads "
                         "waiting on a descheduled sibling, which can make a step 50x slower")
    ap.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                    help="replay captured steps (pure decode; loaded and chunk-only where the forward is fused): "
                         "auto = where the backend allows (flash on CUDA); off = eager, to compare")
    return ap


GRAPHS = {"auto": None, "on": True, "off": False}


def device_and_dtype(a) -> tuple[torch.device, str]:
    """Apply --threads; the device, and the dtype (fp16 on CUDA, fp32 on CPU unless --dtype says)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    return dev, a.dtype or ("float16" if dev.type == "cuda" else "float32")


def parse_args(argv=None):
    ap = cli("python -m engine.bench", __doc__)
    ap.add_argument("--out", default="results", help="results folder; rows go to <out>/<engine>/")
    ap.add_argument("--closed", action="store_true", help="closed runs")
    ap.add_argument("--open", action="store_true", help="open runs (Poisson arrivals), with the capped control")
    ap.add_argument("--peer", action="store_true", help="transformers' continuous batching on the closed runs")
    ap.add_argument("--no-capped", action="store_true", help="skip the capped-pool control of the open runs")
    ap.add_argument("--quick", action="store_true",
                    help="1 warm-up + 1 rep, and (unless given) small sizes: batches 8, uniform 32, arrivals 24, "
                         "at most 3 rates")
    ap.add_argument("--batches", default=None, help="closed mixed batch sizes (default 8,32,64)")
    ap.add_argument("--uniform", default=None, help="closed uniform-control sizes (default 256)")
    ap.add_argument("--shared", default="", help="closed shared-prefix workload sizes (a system prompt shared by "
                    "most requests, repeats, next turns; default none)")
    ap.add_argument("--prefix-cache", default="on", help="on, off, or on,off (each closed workload under each)")
    ap.add_argument("--passes", type=int, default=1,
                    help="serve each closed workload this many times on one engine; the last pass is timed (2: the "
                         "second pass finds the first's pages in the prefix cache)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="longest prompt + budget served (default: the model's); narrows the decode graphs' tables")
    ap.add_argument("--warmups", type=int, default=None, help="discarded warm-up runs per closed workload (2)")
    ap.add_argument("--reps", type=int, default=None, help="measured runs per closed workload, median (5)")
    ap.add_argument("--arrivals", type=int, default=None, help="Poisson arrivals per rate (400)")
    ap.add_argument("--rates", default=None, help="offered rates, req/s, comma separated (default: auto sweep)")
    ap.add_argument("--max-rates", type=int, default=None, help="most rates of an auto sweep (8)")
    ap.add_argument("--rise", type=float, default=0.05, help="served rate rising by less than this: saturated")
    ap.add_argument("--no-stop", action="store_true", help="run every --rates value even past saturation")
    ap.add_argument("--chunk-tokens", type=int, default=None,
                    help="prompt positions per step (default: the workload's: 512; 128 for the CPU variants)")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--peer-attn", default="sdpa", help="attn_implementation of the peer (sdpa, eager, "
                    "flash_attention_2, ...); transformers may switch sdpa to flash when flash-attn is installed")
    ap.add_argument("--peer-warmups", type=int, default=None, help="the peer's warm-up runs per workload (--warmups)")
    ap.add_argument("--peer-warmup-requests", type=int, default=None,
                    help="the peer's warm-up runs serve only the first N requests of the workload (default: all)")
    ap.add_argument("--peer-reps", type=int, default=None, help="the peer's measured runs per workload (--reps)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="every request's generation budget (default: the workload's draw, 64..256)")
    ap.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds before a peer run is abandoned")
    ap.add_argument("--append", action="store_true", help="add to the files in <out>/<engine>/ instead of rewriting")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    a = ap.parse_args(argv)
    if not (a.closed or a.open or a.peer):
        a.closed = a.open = a.peer = True
    q = a.quick
    a.batches = ints(a.batches) if a.batches is not None else ([8] if q else [8, 32, 64])
    a.uniform = ints(a.uniform) if a.uniform is not None else ([32] if q else [256])
    a.shared = ints(a.shared)
    a.prefix_cache = [m.strip() for m in a.prefix_cache.split(",") if m.strip()]
    if not a.prefix_cache or set(a.prefix_cache) - {"on", "off"}:
        ap.error(f"--prefix-cache: on, off or on,off, got {a.prefix_cache}")
    if a.passes < 1:
        ap.error(f"--passes must be >= 1, got {a.passes}")
    a.warmups = a.warmups if a.warmups is not None else (1 if q else 2)
    a.reps = a.reps if a.reps is not None else (1 if q else 5)
    a.arrivals = a.arrivals if a.arrivals is not None else (24 if q else 400)
    a.max_rates = a.max_rates if a.max_rates is not None else (3 if q else 8)
    a.peer_warmups = a.warmups if a.peer_warmups is None else a.peer_warmups
    a.peer_reps = a.reps if a.peer_reps is None else a.peer_reps
    a.rates = floats(a.rates) if a.rates else None
    if a.rates and q:
        a.rates = a.rates[:a.max_rates]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    dev, dtype = device_and_dtype(a)
    cpu_scaled = is_small(a.model)
    mixed, uniform, shared = (MIXED_CPU, UNIFORM_CPU, SHARED_CPU) if cpu_scaled else (MIXED, UNIFORM, SHARED)
    if a.new_tokens:     # a fixed budget (as the "128 new tokens each"), named in the workload
        mixed, uniform, shared = (replace(w.with_budget(a.new_tokens), name=f"{w.name}-new{a.new_tokens}")
                                  for w in (mixed, uniform, shared))
    chunk = a.chunk_tokens or getattr(mixed, "chunk_tokens", None) or (128 if cpu_scaled else 512)
    from kernels import why_unavailable
    base = LINEAGE[a.engine]
    reason = why_unavailable(base["backend"], a.device, base["page_size"])
    if reason:
        print(f"engine.bench: engine {a.engine!r} cannot run here: {reason}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    loaded = load_model(a.model, torch_dtype(dtype), a.device)
    setup = Setup(a.model, a.device, dtype, a.engine, chunk, a.max_batch, mixed, uniform, cpu_scaled, loaded,
                  extra=dict(cuda_graphs=GRAPHS[a.cuda_graphs], progress=not a.no_progress,
                             max_model_len=a.max_model_len), shared=shared)
    bench = Bench(setup, a)
    log(f"engine.bench: {a.engine} on {loaded[2]} ({a.device}, {dtype}), chunk {chunk}, max batch {a.max_batch}; "
        f"parts: {', '.join(p for p in ('closed', 'open', 'peer') if getattr(a, p))}")
    try:
        if a.closed or a.peer:
            bench.closed()
        if a.peer:
            bench.peer()
        if a.open:
            bench.open()
    finally:
        bench.summary["wall_s"] = time.perf_counter() - t0
        bench.write(Path(a.out) / a.engine, a.append)
    log(f"engine.bench: done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
