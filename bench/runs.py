"""One serving benchmark's setup, one engine run and its metrics, and the rows a benchmark writes out."""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.config import lineage_config
from engine.engine import Engine, torch_dtype
from engine.loader import QWEN25_1P5B, RANDOM_1P5B, is_small, load_model
from engine.runner import ModelRunner
from engine.scheduler import WORK_KINDS
from engine.workload import MIXED, MIXED_CPU, SHARED, SHARED_CPU, UNIFORM, UNIFORM_CPU, RequestSpec, Workload

from .cli import GRAPHS, device_and_dtype, kernel_options
from .stats import gaps, log, median, progress, quantile, write_csv

GIB = 1 << 30
CAP_1P5B_BYTES = GIB // 2                      # the capped pool of the 1.5B model
ARRIVAL_FIELDS = ["part", "engine", "model", "rate", "request_id", "prompt_len", "budget", "tokens", "arrival_s",
                  "admit_s", "first_token_s", "finish_s", "queue_wait_s", "ttft_s", "e2e_s"]
STEP_FIELDS = ["run", "part", "engine", "workload", "index", "kind", "duration_ms", "prompt_positions",
               "decode_tokens", "chunks", "admitted", "start_s"]


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

    @classmethod
    def of(cls, o, loaded=None) -> "Setup":
        """The setup that serving options `o` (resolved) name; `loaded`: weights already loaded, else loaded here."""
        _, dtype = device_and_dtype(o.device, o.dtype, o.threads)
        cpu_scaled = is_small(o.model)
        mixed, uniform, shared = (MIXED_CPU, UNIFORM_CPU, SHARED_CPU) if cpu_scaled else (MIXED, UNIFORM, SHARED)
        if o.new_tokens:     # a fixed budget (as the "128 new tokens each"), named in the workload
            mixed, uniform, shared = (replace(w.with_budget(o.new_tokens), name=f"{w.name}-new{o.new_tokens}")
                                      for w in (mixed, uniform, shared))
        chunk = o.chunk_tokens or mixed.chunk_tokens
        loaded = loaded or load_model(o.model, torch_dtype(dtype), o.device)
        return cls(o.model, o.device, dtype, o.engine, chunk, o.max_batch, mixed, uniform, cpu_scaled, loaded,
                   extra=dict(cuda_graphs=GRAPHS[o.cuda_graphs], overlap=GRAPHS[getattr(o, "overlap", "auto")],
                              **kernel_options(o),
                              progress=not o.no_progress,
                              max_model_len=o.max_model_len), shared=shared)

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
        from engine.loader import qwen2_config
        from engine.model import ModelShape
        big = ModelShape.of(qwen2_config(**QWEN25_1P5B))
        positions = CAP_1P5B_BYTES // ModelRunner.bytes_per_page(big, 1, torch.float16)
        if self.cpu_scaled:
            positions //= 4
        shape = self.loaded[0].shape
        return positions * ModelRunner.bytes_per_page(shape, 1, torch_dtype(self.dtype))


def token_gaps(results) -> list[float]:
    """Waits between consecutive tokens of requests already decoding (seconds)."""
    return [g for r in results.values() for g in gaps(r.token_times)]


class GcWatch:
    """The cyclic garbage collections during a timed run (gc.callbacks): how many, how many full, the longest.
    A run that saw a long one says so in its row, instead of leaving an unexplained step or token gap."""

    def __enter__(self) -> "GcWatch":
        self.collections = self.full = 0
        self.worst_ms = 0.0
        self._start = None
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.collections += 1
            self.full += info["generation"] == 2
            self.worst_ms = max(self.worst_ms, (time.perf_counter() - self._start) * 1e3)
            self._start = None

    def metrics(self) -> dict:
        return dict(gc_collections=self.collections, gc_full=self.full, gc_worst_ms=self.worst_ms)


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
        gc.collect()    # the garbage of earlier runs (engines, traces) is collected here, not on this run's clock
        eng.reset_clock()
        first_step, evictions = len(eng.trace), eng.pool.cache.evictions if eng.pool.cache else 0
        ahead, dropped = eng.steps_ahead, eng.ahead_discarded
        # quiet: no callback at all (it walks every request after each step: 20-40 ms of a 200-request run)
        with GcWatch() as watch:
            results = {rid: r for rid, r in eng.run(run_specs, open_loop=open_loop,
                                                    progress=None if quiet else on_step).items()
                       if rid in ids}
        bar.close()
        trace = eng.trace[first_step:]
        captured = [g for g in (getattr(eng.runner, "graphs", None), getattr(eng.runner, "step_graphs", None)) if g is not None]
        m = run_metrics(results, trace, eng.pool.num_pages,
                        graph_replays=sum(g.replays for g in captured), graph_capture_s=sum(g.capture_s for g in captured),
                        graph_fallbacks=getattr(getattr(eng.runner, "step_graphs", None), "fallbacks", 0),
                        graph_pool_mib=sum(g.pool_bytes for g in captured) / (1 << 20),
                        steps_ahead=eng.steps_ahead - ahead, ahead_discarded=eng.ahead_discarded - dropped,
                        **watch.metrics())
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
    gaps_s = token_gaps(results)
    waits = [r.queue_wait for r in results.values()]
    tokens = sum(len(r.tokens) for r in results.values())
    m = dict(requests=len(results), finished=len(done), tokens=tokens, time_to_last_s=makespan,
             tokens_per_s=tokens / makespan if makespan > 0 else None,
             served_rate=len(done) / makespan if makespan > 0 else None,
             queue_wait_median_s=median(waits), queue_wait_worst_s=max((w for w in waits if w is not None),
                                                                       default=None),
             ttft_median_s=median([r.first_token_time - r.arrival_time for r in done if r.first_token_time]),
             gap_median_ms=(median(gaps_s) or 0) * 1e3 if gaps_s else None,
             gap_worst_ms=max(gaps_s) * 1e3 if gaps_s else None, gap_p99_ms=(quantile(gaps_s, 0.99) or 0) * 1e3
             if gaps_s else None, steps=len(trace), pool_pages=pool_pages, **extra)
    for kind in WORK_KINDS:
        d = [s.duration for s in trace if s.kind == kind]
        m[f"steps_{kind}"] = len(d)
        m[f"step_{kind}_median_ms"] = median(d) * 1e3 if d else None
        m[f"step_{kind}_total_s"] = sum(d)
    return m


def closed_summary(times: list[float], rows: list[dict], passes: int, mode: str) -> dict:
    """One closed workload's summary from its measured runs' rows (`rows`, every pass) and times to last request:
    medians over the reps' last passes, the worst token gap and garbage collection of any, each pass's medians."""
    last = [r for r in rows if r["pass_no"] == passes]
    res = dict(time_to_last_median_s=median(times), times_s=times, prefix_cache=mode, passes=passes,
               tokens_per_s_median=median([r["tokens_per_s"] for r in last]),
               ttft_median_s=median([r["ttft_median_s"] for r in last]),
               prefix_hit_rate=median([r["prefix_hit_rate"] for r in last]),
               prefix_pages_saved=median([r["prefix_pages_saved"] for r in last]),
               gap_median_ms=median([r["gap_median_ms"] for r in last]),
               gap_worst_ms=max((r["gap_worst_ms"] or 0) for r in last) if last else None,
               steps_ahead=median([r.get("steps_ahead", 0) for r in last]),
               ahead_discarded=max((r.get("ahead_discarded", 0) for r in last), default=0),
               gc_full=max((r.get("gc_full", 0) for r in last), default=0),
               gc_worst_ms=max((r.get("gc_worst_ms", 0) for r in last), default=0),
               **{f"step_{k}_median_ms": median([r[f"step_{k}_median_ms"] for r in last]) for k in WORK_KINDS})
    if passes > 1:
        res["per_pass"] = {k: {f: median([r[f] for r in rows if r["pass_no"] == k]) for f in
                               ("time_to_last_s", "ttft_median_s", "tokens_per_s", "prefix_hit_rate")}
                           for k in range(1, passes + 1)}
    return res


@dataclass
class ServingRun:
    """What one serving benchmark measured: a row per run, per open-run request, per measured step; a summary."""
    runs: list[dict] = field(default_factory=list)
    arrivals: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    def write(self, out: Path, append: bool = False) -> list[str]:
        """runs.jsonl + runs.csv, arrivals.csv, steps.csv, summary.json and the plots into `out`; with `append`,
        added to what is there. Returns the plots drawn."""
        from .plots import draw_serving
        out.mkdir(parents=True, exist_ok=True)
        runs_jsonl = out / "runs.jsonl"
        with open(runs_jsonl, "a" if append else "w") as f:
            for r in self.runs:
                f.write(json.dumps(r) + "\n")
        all_runs = [json.loads(x) for x in runs_jsonl.read_text().splitlines() if x.strip()]
        cols = []
        for r in all_runs:
            cols += [k for k in r if k not in cols]
        write_csv(out / "runs.csv", cols, all_runs)
        write_csv(out / "arrivals.csv", ARRIVAL_FIELDS, self.arrivals, append)
        write_csv(out / "steps.csv", STEP_FIELDS, self.steps, append)
        sp = out / "summary.json"
        summary = self.summary
        if append and sp.exists():
            summary = {**json.loads(sp.read_text()), **summary}
        sp.write_text(json.dumps(summary, indent=1, default=str))
        plots = draw_serving(out)
        log(f"wrote {out}/: runs.csv runs.jsonl arrivals.csv steps.csv summary.json" +
            (f" {' '.join(plots)}" if plots else " (no plots: matplotlib missing or nothing to draw)"))
        return plots
