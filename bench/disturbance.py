"""Disturbance benchmark: A decodes a long reply; B sends a long cold prompt; C sends a short chat just after.

    python -m bench.disturbance --model small --device cpu --out results/disturbance/
    python -m bench.disturbance --model qwen2.5-1.5b-random --device cuda --dtype float16 \\
        --chunk-tokens 512,4096 --shares 1,0.75,0.5,0.25 --out results/disturbance/

For each chunk budget and each prefill share p (docs/DESIGN.md, "Prefill share"): A (a short prompt, a long
generation budget) starts alone on an idle engine; `--b-at` seconds in (5 s; 1 s for the small model) B arrives
with a `--b-tokens` cold prompt (32768 positions, or the longest that the model's max positions and the pool
allow); `--c-after` seconds later (0.5 s; 0.1 s for the small model) C arrives with a short chat. The run stops
once B and C have their first tokens (A is then cancelled: its pages return at the end of the next step).

Reported per (chunk budget, p), to <out>/disturbance.csv (+ .jsonl), with every step in <out>/steps.csv and every
token of A, B and C in <out>/tokens.csv, and a plot <out>/disturbance.png when matplotlib is installed:
- b_ttft_s: B's first token, seconds after its arrival; b_alone_s: the same for B alone on an idle engine (the
  same chunk budget), and b_slowdown = b_ttft_s / b_alone_s (B's prefill time against B alone);
- c_ttft_s: C's first token, seconds after its arrival;
- a_longest_pause_s: the longest wait between two consecutive tokens of A from B's arrival on (a_gap_alone_s: the
  median wait while A was alone);
- a_rate_alone: A's tokens/s while alone; a_rate_during_b: A's tokens/s from B's arrival to B's first token;
  a_rate_ratio = a_rate_during_b / a_rate_alone (expected about 1 - p for a long B);
- decode_time_share: while B fills (from the step that admits it), pure decode time / (pure decode time + the
  loaded steps' time beyond a pure decode step): the debt rule's own measure, 1 - p when the debt does not
  saturate (B's last 512 positions are a short prompt: they never wait and owe nothing, so a short B reads a
  little under 1 - p);
- withheld_steps: steps that withheld a long-prompt chunk for the decoders' debt;
- tokens_identical: A's, B's and C's tokens equal those of the first share's run over their common length;
  tokens_check says where they first differ and whether that is a near tie: the gap between the two tokens' logits,
  scored by teacher forcing over the first run's tokens, under the gates' tie threshold (gates/compare.py). Arrivals
  follow the wall clock, so two runs can put the same position in different kinds of step (a loaded step in one, a
  pure decode step in the other, or in batches of other sizes) whatever p is, and so compute it with other
  kernels and GEMM shapes. A tie flip is reported, not failed. A difference that is not a near tie fails the run
  (exit code 1) in float32; in float16/bfloat16 it is reported and the run goes on (--strict-tokens fails it
  there too): in half precision, arrival timing alone can move logits past the rule between two runs at the same
  p. Whether p changes tokens is the exactness gates' call (gates/test_prefill_share.py: every token, every p,
  teacher forcing under the full rule). After a difference the request's later tokens are not compared.
The device is synchronised around every step (sync_trace), so the debt sees real step times.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from engine.config import lineage_config
from engine.engine import Engine, torch_dtype
from engine.loader import is_small, load_model
from engine.scheduler import CHUNK_TOKENS, StepKind
from engine.workload import CPU_CHUNK_TOKENS, RequestSpec
from gates.compare import TIE_THRESHOLD
from gates.prog import prog

from .cli import GRAPHS, cannot_run, cli, device_and_dtype, kernel_options, parse
from .plots import draw_disturbance
from .stats import fmt, floats, gaps, ints, log, progress, write_csv

PROG = "bench.disturbance"
FIELDS = ["model", "device", "dtype", "engine", "chunk_tokens", "prefill_share", "b_tokens", "b_at_s", "c_after_s",
          "b_ttft_s", "b_alone_s", "b_slowdown", "c_ttft_s", "a_longest_pause_s", "a_gap_alone_s", "a_rate_alone",
          "a_rate_during_b", "a_rate_ratio", "decode_time_share", "a_tokens", "withheld_steps", "steps", "loaded_steps",
          "pure_decode_steps", "wall_s", "a_finished_early", "tokens_identical", "tokens_check"]
STEP_FIELDS = ["chunk_tokens", "prefill_share", "index", "kind", "start_s", "duration_ms", "prompt_positions",
               "decode_tokens", "chunks", "withheld"]
TOKEN_FIELDS = ["chunk_tokens", "prefill_share", "request", "position", "token", "time_s", "step"]


def first_difference(ref: dict[str, list[int]], outs: dict[str, list[int]]):
    """(request id, position, reference token, this run's token) of the first difference, by request; or None."""
    for rid, x in outs.items():
        r = ref.get(rid, [])
        for i, (u, v) in enumerate(zip(r, x)):
            if u != v:
                return rid, i, u, v
    return None


def check_tokens(e: Engine, prompts: dict[str, list[int]], ref: dict[str, list[int]],
                 outs: dict[str, list[int]], ref_kinds: dict | None = None,
                 kinds: dict | None = None) -> tuple[bool, str]:
    """(ok, what) for one run against the first run of its chunk budget: identical, a tie flip, or a difference.
    `kinds`/`ref_kinds`: per request, the kind of step that emitted each token (named in the message)."""
    d = first_difference(ref, outs)
    if d is None:
        return True, "identical"
    rid, i, u, v = d
    logits = e.score(prompts[rid] + ref[rid][:i], last_only=True)[-1]   # what predicts position i
    gap = abs(float(logits[u] - logits[v]))
    where = f"{rid}@{i} ({u} vs {v}, gap {gap:.4f}"
    if kinds and ref_kinds:
        where += f"; a {kinds[rid][i]} step here, {ref_kinds[rid][i]} in the first run"
    return gap < TIE_THRESHOLD, ("tie flip at " if gap < TIE_THRESHOLD else "DIFFERS at ") + where + ")"


def token_kinds(e: Engine, rids) -> dict[str, list[str]]:
    """Per request, the kind of step (pure-decode, loaded, ...) that emitted each of its tokens."""
    kind = {s.index: s.kind for s in e.trace}
    return {rid: [kind.get(st, "?") for st in e.requests[rid].token_steps] for rid in rids if rid in e.requests}


def note(msg: str) -> None:
    log(f"{PROG}: {msg}", sys.stderr)


class Scenario:
    """The three requests and their arrival times; prompts are token ids from a seeded generator."""

    def __init__(self, vocab: int, b_tokens: int, a_prompt: int, a_budget: int, b_budget: int, c_prompt: int,
                 c_budget: int, b_at: float, c_after: float, seed: int):
        rng = random.Random(seed)
        hi = min(vocab, 4000)
        draw = lambda n: [rng.randrange(3, hi) for _ in range(n)]  # noqa: E731
        self.a = RequestSpec("A", draw(a_prompt), a_budget, 0.0)
        self.b = RequestSpec("B", draw(b_tokens), b_budget, b_at)
        self.c = RequestSpec("C", draw(c_prompt), c_budget, b_at + c_after)
        self.b_at, self.c_at = b_at, b_at + c_after


def drive(engine: Engine, specs: list[RequestSpec], stop_when, max_s: float) -> None:
    """Serve `specs` at their arrival times on the engine's clock until `stop_when(engine)` holds (or max_s
    passes), then cancel what is left and step until the pool is whole."""
    engine.reset_clock()
    engine.run(specs, open_loop=True, until=lambda e: stop_when(e) or e.now() >= max_s)
    if not stop_when(engine):
        note(f"stopped after {max_s:.0f} s (--max-run-s) before B and C had their first tokens")
    for rid, r in engine.requests.items():
        if not r.done:
            engine.cancel(rid)
    engine.run()
    assert engine.pool.num_free == engine.pool.capacity, "pages leaked after the run"


def first_tokens(rids):
    return lambda e: all(rid in e.requests and e.requests[rid].output for rid in rids)


def measure(engine: Engine, sc: Scenario) -> dict:
    A, B, C = (engine.requests.get(x) for x in ("A", "B", "C"))
    b_first = B.first_token_time if B and B.output else None
    a_times = A.token_times
    alone = [t for t in a_times if t <= sc.b_at]
    rate_alone = (len(alone) - 1) / (alone[-1] - alone[0]) if len(alone) > 2 and alone[-1] > alone[0] else None
    gap_alone = statistics.median(gaps(alone)) if len(alone) > 2 else None
    after = alone[-1:] + [t for t in a_times if t > sc.b_at]
    pause = max(gaps(after)) if len(after) > 1 else None
    during = None
    if b_first is not None and b_first > sc.b_at:
        during = sum(sc.b_at < t <= b_first for t in a_times) / (b_first - sc.b_at)
    kinds = [s.kind for s in engine.trace]
    share = None
    if b_first is not None:     # pure decode time / (that + prompt work's extra time) while B fills: about 1 - p
        # from the step that admitted B: a step can start after b_at yet have been planned before B was delivered
        fill = [s for s in engine.trace if B.admit_time <= s.start <= b_first]
        pure = [s.duration for s in fill if s.kind == StepKind.PURE_DECODE]
        t_d = statistics.median(pure) if pure else (statistics.median(gaps(alone)) if len(alone) > 2 else 0.0)
        extra = sum(max(0.0, s.duration - t_d) for s in fill if s.kind == StepKind.LOADED)
        share = sum(pure) / (sum(pure) + extra) if sum(pure) + extra > 0 else None
    return {
        "b_ttft_s": None if b_first is None else b_first - B.arrival_time,
        "c_ttft_s": None if not (C and C.output) else C.first_token_time - C.arrival_time,
        "a_longest_pause_s": pause, "a_gap_alone_s": gap_alone, "a_rate_alone": rate_alone,
        "a_rate_during_b": during, "a_rate_ratio": None if not (during is not None and rate_alone) else
        during / rate_alone, "a_tokens": len(A.output),
        "decode_time_share": share, "withheld_steps": engine.scheduler.withheld_steps, "steps": len(engine.trace),
        "loaded_steps": kinds.count(StepKind.LOADED), "pure_decode_steps": kinds.count(StepKind.PURE_DECODE),
        "a_finished_early": A.state.value == "finished" and (b_first is None or A.finish_time < b_first),
    }


def table(rows: list[dict]) -> str:
    cols = [("chunk", "chunk_tokens"), ("p", "prefill_share"), ("B ttft s", "b_ttft_s"), ("B alone s", "b_alone_s"),
            ("B x", "b_slowdown"), ("C ttft s", "c_ttft_s"), ("A pause s", "a_longest_pause_s"),
            ("A tok/s alone", "a_rate_alone"), ("A tok/s in B", "a_rate_during_b"), ("A ratio", "a_rate_ratio"),
            ("decode share", "decode_time_share"), ("withheld", "withheld_steps"), ("tokens", "tokens_check")]
    cells = [[h for h, _ in cols]] + [[fmt(r[k], 2 if k.startswith("a_rate") and k != "a_rate_ratio" else 3)
                                       for _, k in cols] for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c[i].rjust(w[i]) for i in range(len(cols))) for c in cells)


def parse_args(argv=None):
    ap = cli(prog(PROG), __doc__)
    ap.add_argument("--chunk-tokens", default=None, help="chunk budgets, comma separated (default 512; 128 small)")
    ap.add_argument("--shares", default="1,0.75,0.5,0.25", help="prefill shares p, comma separated")
    ap.add_argument("--b-tokens", type=int, default=None,
                    help="B's prompt (default 32768, or the longest that max positions and the pool allow; "
                         "4096 for the small model)")
    ap.add_argument("--b-at", type=float, default=None, help="seconds after A's arrival that B arrives (5; small 1)")
    ap.add_argument("--c-after", type=float, default=None, help="seconds after B that C arrives (0.5; small 0.1)")
    ap.add_argument("--a-prompt", type=int, default=64, help="A's prompt length (64)")
    ap.add_argument("--a-budget", type=int, default=None, help="A's generation budget (default: min(8192, "
                    "max positions - prompt)); A is cancelled once B and C have their first tokens")
    ap.add_argument("--b-budget", type=int, default=4, help="B's generation budget (4)")
    ap.add_argument("--c-prompt", type=int, default=48, help="C's prompt length (48)")
    ap.add_argument("--c-budget", type=int, default=8, help="C's generation budget (8)")
    ap.add_argument("--kv-cache-bytes", type=int, default=None, help="the pool (default: 16 GiB cuda, 256 MiB cpu)")
    ap.add_argument("--max-run-s", type=float, default=120.0, help="give up a run after this many seconds")
    ap.add_argument("--no-alone", action="store_true", help="skip the B-alone baseline")
    ap.add_argument("--alone-reps", type=int, default=3, help="B-alone runs per chunk budget (median)")
    ap.add_argument("--strict-tokens", action=argparse.BooleanOptionalAction, default=None,
                    help="fail (exit 1) on a token difference that is not a near tie (default: in float32 only)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the prompts' token ids (7)")
    ap.add_argument("--out", default="results/disturbance", help="folder of the CSV, JSON and plot")
    ap.add_argument("--no-progress", action="store_true", help="no progress lines")
    return parse(ap, argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if cannot_run(PROG, a.engine, a.device):
        return 2
    _, dtype = device_and_dtype(a.device, a.dtype, a.threads)
    small = is_small(a.model)
    chunks = ints(a.chunk_tokens) if a.chunk_tokens else [CPU_CHUNK_TOKENS if small else CHUNK_TOKENS]
    shares = floats(a.shares)
    b_at = a.b_at if a.b_at is not None else (1.0 if small else 5.0)
    c_after = a.c_after if a.c_after is not None else (0.1 if small else 0.5)
    t0 = time.perf_counter()
    loaded = load_model(a.model, torch_dtype(dtype), a.device)
    shape = loaded[0].shape

    def config(ct, p):
        return lineage_config(a.engine, device=a.device, dtype=dtype, chunk_tokens=ct, prefill_share=p,
                              kv_cache_bytes=a.kv_cache_bytes, sync_trace=True, max_batch=8,
                              cuda_graphs=GRAPHS[a.cuda_graphs], **kernel_options(a))

    probe = Engine(config(chunks[0], 1.0), loaded=loaded)
    page = probe.pool.page_size
    slots = probe.pool.capacity * page
    del probe
    a_budget = a.a_budget or min(8192, shape.max_positions - a.a_prompt)
    room = slots - 3 * page - (a.a_prompt + a_budget) - (a.c_prompt + a.c_budget)   # 3 pages: rounding slack
    b_tokens = a.b_tokens or min(4096 if small else 32768, shape.max_positions - a.b_budget, room - a.b_budget)
    if b_tokens < 1 or a.a_prompt + a_budget > shape.max_positions:
        note(f"the pool ({slots} slots) or max positions ({shape.max_positions}) cannot hold A "
             f"({a.a_prompt} + {a_budget}) and B")
        return 2
    note(f"{a.engine} on {loaded[2]} ({a.device}, {dtype}); A {a.a_prompt}+{a_budget}, B "
         f"{b_tokens}+{a.b_budget} at {b_at} s, C {a.c_prompt}+{a.c_budget} {c_after} s later; chunk budgets "
         f"{chunks}; shares {shares}; pool {slots} slots")
    sc = Scenario(shape.vocab_size, b_tokens, a.a_prompt, a_budget, a.b_budget, a.c_prompt, a.c_budget, b_at,
                  c_after, a.seed)
    # warm-up (discarded): kernels, allocator and the long history's shapes, once per chunk budget
    for ct in chunks:
        e = Engine(config(ct, 1.0), loaded=loaded)
        drive(e, [RequestSpec("w", sc.b.prompt[:min(b_tokens, 2 * ct + 7)], 4), RequestSpec("v", sc.c.prompt, 4)],
              first_tokens(["w", "v"]), a.max_run_s)
    runs = [(ct, p) for ct in chunks for p in shares]
    bar = progress(len(runs) + (0 if a.no_alone else len(chunks)), "disturbance", leave=True,
                   disable=a.no_progress, unit="run")
    rows, steps, tokens, first_run, problems, notes = [], [], [], {}, [], []
    strict = a.strict_tokens if a.strict_tokens is not None else dtype == "float32"
    prompts = {s.request_id: s.prompt for s in (sc.a, sc.b, sc.c)}
    for ct, p in runs:
        e = Engine(config(ct, p), loaded=loaded)
        t = time.perf_counter()
        drive(e, [sc.a, sc.b, sc.c], first_tokens(["B", "C"]), a.max_run_s)
        m = measure(e, sc)
        outs = {rid: list(e.requests[rid].output) for rid in ("A", "B", "C") if rid in e.requests}
        kinds = token_kinds(e, outs)
        ref, ref_kinds = first_run.setdefault(ct, (outs, kinds))
        ok, what = check_tokens(e, prompts, ref, outs, ref_kinds, kinds)
        same = what == "identical"
        if not ok:
            (problems if strict else notes).append(f"chunk {ct}, p {p}: tokens {what}")
        row = {"model": loaded[2], "device": a.device, "dtype": dtype, "engine": a.engine, "served": e.served.key(),
               "chunk_tokens": ct,
               "prefill_share": e.scheduler.ledger.prefill_share, "b_tokens": b_tokens, "b_at_s": b_at, "c_after_s": c_after,
               "b_alone_s": None, "b_slowdown": None, "wall_s": time.perf_counter() - t, "tokens_identical": same,
               "tokens_check": what,
               **m}
        rows.append(row)
        if m["a_finished_early"]:
            note(f"chunk {ct}, p {p}: A finished before B's first token; raise --a-budget")
        for s in e.trace:
            steps.append({"chunk_tokens": ct, "prefill_share": p, "index": s.index, "kind": s.kind,
                          "start_s": round(s.start, 6), "duration_ms": round(s.duration * 1e3, 4),
                          "prompt_positions": s.prompt_positions, "decode_tokens": s.decode_tokens,
                          "chunks": s.chunks, "withheld": s.withheld})
        for rid in ("A", "B", "C"):
            r = e.requests.get(rid)
            for i, (tok, tt, st) in enumerate(zip(r.output, r.token_times, r.token_steps) if r else []):
                tokens.append({"chunk_tokens": ct, "prefill_share": p, "request": rid, "position": i, "token": tok,
                               "time_s": round(tt, 6), "step": st})
        bar.update(1)
        bar.set_postfix_str(f"chunk {ct} p {p}: B {fmt(row['b_ttft_s'], 2)} s, C {fmt(row['c_ttft_s'], 2)} s")
        del e
    # B alone on an idle engine, per chunk budget (after the runs: the allocator and kernels are warm by then)
    if not a.no_alone:
        for ct in chunks:
            times = []
            for _ in range(a.alone_reps):        # a median: one run is at the mercy of the host
                e = Engine(config(ct, 1.0), loaded=loaded)
                drive(e, [RequestSpec("B", sc.b.prompt, sc.b.budget)], first_tokens(["B"]), a.max_run_s)
                b = e.requests["B"]
                if b.output:
                    times.append(b.first_token_time - b.arrival_time)
                del e
            alone = statistics.median(times) if times else None
            for row in rows:
                if row["chunk_tokens"] == ct:
                    row["b_alone_s"] = alone
                    row["b_slowdown"] = None if row["b_ttft_s"] is None or not alone else row["b_ttft_s"] / alone
            bar.update(1)
    bar.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "disturbance.csv", FIELDS, rows, digits=6)
    with open(out / "disturbance.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    write_csv(out / "steps.csv", STEP_FIELDS, steps, digits=6)
    write_csv(out / "tokens.csv", TOKEN_FIELDS, tokens, digits=6)
    drew = draw_disturbance(rows, tokens, {ct: sc for ct in chunks}, out / "disturbance.png")
    print(table(rows))
    note(f"rows in {out / 'disturbance.csv'}" + (f", plot {out / 'disturbance.png'}" if drew
                                                 else " (no matplotlib: no plot)")
         + f"; done in {time.perf_counter() - t0:.1f} s")
    for msg in notes:
        note(f"{msg}: not a near tie under {TIE_THRESHOLD} (reported, not failed: {dtype} without --strict-tokens)")
    for msg in problems:
        note(f"{msg}: not a near tie under {TIE_THRESHOLD}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
