"""Serving benchmark: closed runs, open (Poisson) arrivals, the step trace by kind, token gaps, the capped-pool control
and transformers' own continuous batching side by side (the peer).

    python -m bench.serving --model small --device cpu --engine fused --quick --threads 1 --out results/
    python -m bench.serving --model qwen2.5-1.5b-random --device cuda --engine flash --out results/ \\
        --closed --peer --batches 8,32,64 --uniform 256
    python -m bench.serving --model qwen2.5-1.5b-random --device cuda --engine flash --out results/ --open \\
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

import platform
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from engine.config import LINEAGE
from engine.workload import RequestSpec, Workload, poisson_arrivals

from gates.prog import prog

from .cli import cannot_run, cli, parse
from .peer import Peer
from .runs import ServingRun, Setup, closed_summary, run_engine, serve_passes
from .stats import floats, fmt, ints, log, median

PROG = "bench.serving"


@dataclass
class ServingOptions:
    """What to run, as the command line says it (one field per flag); None: the default, which `resolved` fills."""
    model: str = "small"
    device: str = "cpu"
    dtype: str | None = None
    engine: str = "fused"
    threads: int | None = None
    cuda_graphs: str = "auto"                   # auto / on / off
    overlap: str = "auto"                       # auto / on / off
    # the kernel choices (bench/cli.py's kernel_options); without these fields the flags were parsed and dropped
    decode_kernel: str | None = None
    decode_append: str = "auto"                 # auto / on / off
    closed: bool = False                        # no part named: all of them
    open: bool = False
    peer: bool = False
    no_capped: bool = False
    quick: bool = False
    batches: list[int] | None = None
    uniform: list[int] | None = None
    shared: list[int] = field(default_factory=list)
    prefix_cache: list[str] = field(default_factory=lambda: ["on"])
    passes: int = 1
    max_model_len: int | None = None
    warmups: int | None = None
    reps: int | None = None
    arrivals: int | None = None
    rates: list[float] | None = None
    max_rates: int | None = None
    rise: float = 0.05
    no_stop: bool = False
    chunk_tokens: int | None = None
    max_batch: int = 32
    peer_attn: str = "sdpa"
    peer_warmups: int | None = None
    peer_warmup_requests: int | None = None
    peer_reps: int | None = None
    new_tokens: int | None = None
    peer_timeout: float = 1800.0
    no_progress: bool = False

    def resolved(self) -> "ServingOptions":
        """A copy with every default filled (smaller ones with `quick`); a bad value raises ValueError."""
        if not self.prefix_cache or set(self.prefix_cache) - {"on", "off"}:
            raise ValueError(f"--prefix-cache: on, off or on,off, got {self.prefix_cache}")
        if self.passes < 1:
            raise ValueError(f"--passes must be >= 1, got {self.passes}")
        q = self.quick
        o = replace(self, shared=list(self.shared), prefix_cache=list(self.prefix_cache))
        if not (o.closed or o.open or o.peer):
            o.closed = o.open = o.peer = True
        o.batches = list(o.batches) if o.batches is not None else ([8] if q else [8, 32, 64])
        o.uniform = list(o.uniform) if o.uniform is not None else ([32] if q else [256])
        o.warmups = o.warmups if o.warmups is not None else (1 if q else 2)
        o.reps = o.reps if o.reps is not None else (1 if q else 5)
        o.arrivals = o.arrivals if o.arrivals is not None else (24 if q else 400)
        o.max_rates = o.max_rates if o.max_rates is not None else (3 if q else 8)
        o.peer_warmups = o.warmups if o.peer_warmups is None else o.peer_warmups
        o.peer_reps = o.reps if o.peer_reps is None else o.peer_reps
        o.rates = sorted(o.rates) if o.rates else None
        if o.rates and q:
            o.rates = o.rates[:o.max_rates]
        return o


class Bench:
    """The parts of one serving benchmark on one setup; what they measure goes to `result`."""

    def __init__(self, setup: Setup, options: ServingOptions):
        self.s = setup
        self.a = options
        self.result = ServingRun()
        self.runs, self.arrivals, self.steps = self.result.runs, self.result.arrivals, self.result.steps
        self.summary = self.result.summary
        self.summary["setup"] = self.describe()
        self.run_no = 0
        self.closed_tokens: dict[str, dict[str, list[int]]] = {}   # the last measured closed run's tokens

    def describe(self) -> dict:
        s = self.s
        return dict(model=s.model, device=s.device, dtype=s.dtype, engine=s.engine, engine_config=LINEAGE[s.engine],
                    served=self.served.describe(),
                    chunk_tokens=s.chunk_tokens, max_batch=s.max_batch, mixed=s.mixed.name, uniform=s.uniform.name,
                    torch=torch.__version__, python=platform.python_version(), host=platform.node(),
                    gpu=torch.cuda.get_device_name() if torch.device(s.device).type == "cuda" else None,
                    threads=torch.get_num_threads(), warmups=self.a.warmups, reps=self.a.reps, quick=self.a.quick,
                    started=time.strftime("%F %T"))

    def base_row(self, part, workload, **kw) -> dict:
        s = self.s
        row = dict(part=part, engine=s.engine, model=s.model, device=s.device, dtype=s.dtype, workload=workload,
                   **kw)
        if part != "peer":          # the configuration our engine served (the peer's rows are the peer's)
            row["served"] = self.served.key()
        return row

    @property
    def served(self):
        """The configuration the runs serve, every None decided for this device (EngineConfig.resolved)."""
        return self.s.config().resolved()

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
        res = closed_summary(times, rows, passes, mode)
        log(f"closed {name}: time to last request, median of {len(times)}"
            f"{f' (pass {passes} of {passes})' if passes > 1 else ''}: {res['time_to_last_median_s']:.3f} s "
            f"({res['tokens_per_s_median']:.1f} tokens/s, first token median {fmt(res['ttft_median_s'], 3)} s); "
            f"prefix cache {mode}: hit rate {res['prefix_hit_rate']:.3f}, {res['prefix_pages_saved']} pages saved; "
            f"token gaps median {fmt(res['gap_median_ms'])} ms, worst {fmt(res['gap_worst_ms'])} ms; "
            f"garbage collections in a run: {res['gc_full']} full at most, the longest {fmt(res['gc_worst_ms'])} ms")
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
            times, info, rows = peer.closed(specs, name, self.a.peer_warmups, self.a.peer_reps,
                                            self.closed_tokens.get(name, {}))
            for row in rows:
                self.run_no += 1
                self.runs.append(self.base_row("peer", name, run=self.run_no, **row))
            ours = closed[name]["time_to_last_median_s"]
            p = median(times)
            res[name] = dict(peer_time_to_last_median_s=p, peer_times_s=times,
                             ours_time_to_last_median_s=ours, ours_over_peer=ours / p if p else None, **info)
            log(f"peer {name}: transformers {p:.3f} s, ours {ours:.3f} s: ours / peer = {ours / p:.3f} "
                f"({info['attn_implementation']}; budgets honoured: {info['budgets_honoured']}; same tokens as "
                f"ours: {info['same_tokens']}/{len(specs)})")
        peer.close()
        self.summary["peer"] = res


def summarise_open(rows) -> dict:
    best = max(rows, key=lambda r: r["served_rate"] or 0) if rows else None
    return dict(rates=[r["rate"] for r in rows], served=[r["served_rate"] for r in rows],
                queue_wait_median_s=[r["queue_wait_median_s"] for r in rows],
                gap_median_ms=[r["gap_median_ms"] for r in rows], gap_worst_ms=[r["gap_worst_ms"] for r in rows],
                capacity_req_per_s=best["served_rate"] if best else None)


def parse_args(argv=None):
    ap = cli(prog(PROG), __doc__)
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
    ap.add_argument("--max-batch", type=int, default=32, help="most requests holding rows at once (32)")
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
    a = parse(ap, argv)
    given = {f.name: getattr(a, f.name) for f in fields(ServingOptions)}
    given.update(batches=ints(a.batches) if a.batches is not None else None,
                 uniform=ints(a.uniform) if a.uniform is not None else None, shared=ints(a.shared),
                 prefix_cache=[m.strip() for m in a.prefix_cache.split(",") if m.strip()],
                 rates=floats(a.rates) if a.rates else None)
    try:
        a.options = ServingOptions(**given).resolved()
    except ValueError as e:
        ap.error(str(e))
    return a


def serve(options: ServingOptions, loaded=None, out: Path | None = None, append: bool = False) -> ServingRun:
    """Run the parts `options` names; returns their rows. `loaded`: weights already loaded (else loaded here);
    `out`: also write the files there (on failure too, with what was measured)."""
    o = options.resolved()
    t0 = time.perf_counter()
    setup = Setup.of(o, loaded)
    bench = Bench(setup, o)
    log(f"{PROG}: {o.engine} on {setup.loaded[2]} ({o.device}, {setup.dtype}), chunk {setup.chunk_tokens}, max batch "
        f"{o.max_batch}; parts: {', '.join(p for p in ('closed', 'open', 'peer') if getattr(o, p))}")
    try:
        if o.closed or o.peer:
            bench.closed()
        if o.peer:
            bench.peer()
        if o.open:
            bench.open()
    finally:
        bench.summary["wall_s"] = time.perf_counter() - t0
        if out is not None:
            bench.result.write(out, append)
    log(f"{PROG}: done in {time.perf_counter() - t0:.1f} s")
    return bench.result


def main(argv=None) -> int:
    a = parse_args(argv)
    if cannot_run(PROG, a.engine, a.device):
        return 2
    serve(a.options, out=Path(a.out) / a.engine, append=a.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
