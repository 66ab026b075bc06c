"""Why a token gate failed: where its first failing token was computed (provenance), and which re-runs of that
request make it pass (triage), down to a one-line verdict.

Provenance reads the failing engine's bookkeeping: the step that emitted the token and its kind, whether the token
came from the request's last prompt chunk (position 0) or a decode row, the page and slot that step wrote for the
request, the engine configuration, and the step's other requests.

Triage re-runs only the failing request, to one token past the failure, each run against the same reference under
the same rule (compare_request): alone (same configuration), with CUDA graphs off (where they were on), under each
other backend that runs here, with a chunk budget that holds its whole prompt, and with the prefix up to the failure
read as a prompt (so the failing token comes from a prompt chunk instead of a decode row). The verdict says which of
these make it pass."""
from __future__ import annotations

from dataclasses import dataclass, field

import kernels

from engine.scheduler import StepKind
from engine.workload import RequestSpec

from .compare import Failure, GateReport, compare_request
from .records import GenRecord
from .reference import TOPK, EngineReference

# backends a triage does not try on a CPU, and why: they would cost minutes where the rest costs seconds
CPU_SLOW_BACKENDS = {"flex": "it compiles a FlexAttention kernel per shape on a CPU (minutes)"}
MAX_NAMED = 6           # batch-mates named in a line before "and N more"
ALWAYS = "always: model, rotary or token choice"
MATCH = 0.2     # a change "reproduces" the candidate's logits when it leaves under this share of the plain error


def named(ids: list[str]) -> str:
    more = len(ids) - MAX_NAMED
    return ", ".join(ids[:MAX_NAMED]) + (f" and {more} more" if more > 0 else "")


def describe_config(engine) -> str:
    c = engine.config
    graphs = "on" if engine.runner.graphs is not None else "off"
    return (f"backend {c.backend}, forward {c.forward}, page_size {c.page_size}, chunk_tokens {c.chunk_tokens}, "
            f"max_batch {c.max_batch}, {engine.pool.capacity} pages, CUDA graphs {graphs}, {c.device} {c.dtype}")


def step_rows(engine, step: int) -> dict[str, str]:
    """Every request in `step`, and what it ran there: a prompt chunk or a decode row."""
    rows = {}
    for rid, r in engine.requests.items():
        for (start, length), st in zip(r.chunks, r.chunk_steps):
            if st == step:
                rows[rid] = f"prompt chunk [{start}, {start + length})"
        for j, st in enumerate(r.token_steps[1:], start=1):
            if st == step:
                rows[rid] = f"decode row, position {j}"
    return rows


def provenance(engine, rid: str, pos: int) -> str:
    """Where `rid`'s emitted token `pos` was computed, in one paragraph."""
    r = engine.requests.get(rid)
    if r is None or not 0 <= pos < len(r.token_steps):
        emitted = "not served" if r is None else f"emitted {len(r.token_steps)} tokens"
        return f"{rid} position {pos}: no such token in this run ({rid} {emitted}); {describe_config(engine)}"
    step = r.token_steps[pos]
    rec = next((s for s in engine.trace if s.index == step), None)
    kind = rec.kind if rec is not None else "?"
    at = r.prompt_len + pos - 1               # the sequence position whose logits gave token pos
    if pos == 0:
        start, length = r.chunks[-1]
        src = (f"its last prompt chunk [{start}, {start + length}) of {r.prompt_len} (the logits of prompt "
               f"position {at})")
        wrote = f"KV positions [{start}, {start + length})"
    else:
        src = f"a decode row (token {r.output[pos - 1]} fed at sequence position {at})"
        wrote = f"KV position {at}"
    ps = engine.pool.page_size
    page = r.pages[at // ps] if at // ps < len(r.pages) else None
    where = f"position {at} in page {page}, slot {page * ps + at % ps}" if page is not None else "no page"
    graphed = " (a replayed CUDA graph)" if engine.runner.graphs is not None and kind == StepKind.PURE_DECODE else ""
    if rec is not None and rec.ahead:
        graphed += " launched ahead (its input tokens gathered on the device from the step before's samples)"
    others = [f"{o} ({what})" for o, what in step_rows(engine, step).items() if o != rid]
    return (f"provenance: {rid} position {pos} was computed at step {step}, a {kind} step{graphed}, from {src}; "
            f"that step wrote {wrote} for {rid}: {where} (its pages {r.pages}); {describe_config(engine)}; "
            f"other requests in step {step}: {named(others) if others else 'none'}")


@dataclass
class Variant:
    name: str
    passed: bool | None        # None: not tried
    outcome: str


@dataclass
class Triage:
    request_id: str
    tokens: int
    variants: list[Variant] = field(default_factory=list)
    verdict: str = ""

    def lines(self) -> list[str]:
        out = [f"triage of {self.request_id} (re-runs of this request alone to {self.tokens} tokens, against the "
               f"same reference and rule):"]
        out += [f"  {v.name}: {v.outcome}" for v in self.variants]
        return out + [f"verdict: {self.verdict}"]


def probe_of(score):
    """The reference's probe (HFReference.probe) behind a gate's score callable, if it has one."""
    return getattr(score, "probe", None) or getattr(getattr(score, "__self__", None), "probe", None)


def diagnose(probe, prefix: list[int], decode_from: int, cand: tuple[list[int], list[float]]) -> str | None:
    """Which one change of the reference reproduces the candidate's top-k logits at a failing decode row: its
    decode positions shifted by one either way (rotary), each decode row blind to its own newest slot (a cache
    length one short), or none but the emitted token's logit (token choice). None when no change does."""
    import torch
    ids, vals = torch.tensor(cand[0]), torch.tensor(cand[1], dtype=torch.float32)

    def err(logits, skip_emitted=False):
        d = (logits[ids] - vals).abs()
        return float((d[1:] if skip_emitted else d).max())

    plain = probe(prefix, decode_from)
    e0 = err(plain)
    changes = [(f"a decode row's rotary position (the reference with its decode rows {s:+d} position gives these "
                f"logits)", err(probe(prefix, decode_from, shift=s))) for s in (-1, 1)]
    changes.append(("a decode row's cache length (the reference with each decode row blind to its own newest slot, "
                    "one short, gives these logits)", err(probe(prefix, decode_from, blind_to_self=True))))
    changes.append((f"token choice (every top-k logit but the emitted token {cand[0][0]}'s is the reference's)",
                    err(plain, skip_emitted=True)))
    what, e = min(changes, key=lambda c: c[1])
    return f"{what}: logit error {e:.2g} against {e0:.2g} unchanged" if e < MATCH * e0 else None


def verdict(variants: list[Variant], backend: str, mates: list[str], step: int | None,
            diagnosis: str | None = None) -> str:
    """The one-line cause from the variants' outcomes (names as `triage` gives them) and, for a decode-row failure
    with no other cause, what `diagnose` found."""
    ok = {v.name: v.passed for v in variants}
    if ok.get("alone"):
        if mates:
            return f"only when batched with {named(mates)}"
        return f"only when batched (alone in step {step}: with the requests of earlier steps, or its page placement)"
    causes = []
    if ok.get("CUDA graphs off"):
        causes.append("only with CUDA graphs")
    passing = [v.name.split()[1] for v in variants if v.name.startswith("backend ") and v.passed]
    if passing:
        causes.append(f"only under backend {backend} ({', '.join(passing)} passes)")
    if ok.get("unchunked"):
        causes.append("only when its prompt is chunked")
    if causes:
        return "; ".join(causes)
    as_prompt = ok.get("prefix as a prompt")
    if as_prompt is None:
        return ALWAYS
    if as_prompt and diagnosis:
        return f"always: {diagnosis} (in decode rows only: the same prefix read as a prompt passes)"
    return ALWAYS + (" (in decode rows only: the same prefix read as a prompt passes)" if as_prompt else
                     " (also when the same prefix is read as a prompt)")


def outcome(ref: GenRecord, cand: GenRecord, score, threshold: float) -> tuple[bool, str]:
    v = compare_request(ref, cand, score, threshold, check_steps=False)
    f = v.failure
    if f and f.ref_token is not None:
        gap = lambda g: "outside top-k" if g is None else f"{g:.4f}"  # noqa: E731
        return False, (f"fails at position {f.position}: token {f.cand_token} for the reference's {f.ref_token} "
                       f"(gaps {gap(f.ref_gap)} / {gap(f.cand_gap)})")
    if f:
        return False, "fails: " + f.message()
    return True, "passes" + (f" (flips at {[f.position for f in v.flips]})" if v.flips else "")


def triage(engine, failure: Failure, reference: GenRecord, score, threshold: float,
           backends: list[str] | None = None) -> Triage:
    """Re-run `failure`'s request alone and in variants (module docstring). `backends`: the other backends to try
    (default: every one that runs here, but CPU_SLOW_BACKENDS on a CPU)."""
    rid, pos = failure.request_id, failure.position
    r = engine.requests[rid]
    c = engine.config
    n = min(r.budget, pos + 1) if failure.ref_token is not None else r.budget
    ref = GenRecord(rid, reference.prompt, reference.tokens[:n], reference.topk_ids[:n], reference.topk_vals[:n])
    loaded = (engine.model, engine.hf_config, engine.model_name)
    t = Triage(rid, n)

    def run(name: str, prompt: list[int], budget: int, ref_rec: GenRecord, **changes) -> None:
        # a pool just big enough: alone, a request takes the first free pages whatever the pool's size, and a
        # full-size cache costs most of a re-run on a CPU
        pages = min(engine.pool.num_pages, engine.pool.pages_needed(len(prompt) + budget) + 2)
        kw = {**c.describe(), "record_topk": max(c.record_topk, TOPK), "progress": False, "compile_warmup": False,
              "num_pages": pages, **changes}
        note = f" [{', '.join(f'{k}={x}' for k, x in changes.items())}]" if changes else ""
        try:
            cand = EngineReference("triage", loaded=loaded, **kw).generate([RequestSpec(rid, prompt, budget)])[rid]
        except Exception as e:        # a poisoned read (or any other error) is that variant's outcome
            t.variants.append(Variant(name, False, f"fails{note}: {type(e).__name__}: {str(e).splitlines()[0]}"))
            return
        passed, text = outcome(ref_rec, cand, score, threshold)
        t.variants.append(Variant(name, passed, text + note))

    run("alone", r.prompt, n, ref)
    if engine.overlap:
        # alone, a request's steps can still be launched ahead: the batch's rows are what it lacks (see the verdict)
        run("no step launched ahead", r.prompt, n, ref, overlap=False)
    if engine.runner.graphs is not None:
        run("CUDA graphs off", r.prompt, n, ref, cuda_graphs=False, **({"overlap": False} if engine.overlap else {}))
    else:
        t.variants.append(Variant("CUDA graphs off", None, "not applicable: graphs were off"))
    for b in (backends if backends is not None else [b for b in kernels.BACKENDS if b != c.backend]):
        name = f"backend {b}"
        slow = CPU_SLOW_BACKENDS.get(b) if backends is None and c.device.startswith("cpu") else None
        pages = [c.page_size] + [p for p in (kernels.backend_class(b).page_sizes or ()) if p != c.page_size]
        page = next((p for p in pages if kernels.why_unavailable(b, c.device, p) is None), None)
        if slow or page is None:
            why = slow or kernels.why_unavailable(b, c.device, c.page_size)
            t.variants.append(Variant(name, None, f"not tried: {why}"))
        else:
            run(name, r.prompt, n, ref, backend=b, **({"page_size": page} if page != c.page_size else {}))
    if len(r.chunks) > 1:
        run("unchunked", r.prompt, n, ref, chunk_tokens=max(c.chunk_tokens, r.prompt_len))
    else:
        t.variants.append(Variant("unchunked", None, "not applicable: its prompt was read in one chunk"))
    diagnosis = None
    if failure.ref_token is not None and pos >= 1:
        prefix = list(r.prompt) + list(r.output[:pos])
        vals, ids = score(prefix, [0])[0].float().topk(TOPK)
        as_ref = GenRecord(rid, prefix, [int(ids[0])], [ids.tolist()], [vals.tolist()])
        run("prefix as a prompt", prefix, 1, as_ref)
        cand = engine.topk.get(rid, [])
        if probe_of(score) is not None and pos < len(cand):
            diagnosis = diagnose(probe_of(score), prefix, len(r.prompt), cand[pos])
    else:
        t.variants.append(Variant("prefix as a prompt", None, "not applicable: the token came from a prompt chunk"))
    step = r.token_steps[pos] if pos < len(r.token_steps) else None
    mates = [] if step is None else [o for o in step_rows(engine, step) if o != rid]
    t.verdict = verdict(t.variants, c.backend, mates, step, diagnosis)
    return t


def explain(report: GateReport, engine, reference: dict[str, GenRecord], score) -> list[str]:
    """Provenance and triage of the report's first failing request (only the first: triage re-runs cost)."""
    f = next((f for f in report.failures if f.request_id in engine.requests and f.request_id in reference), None)
    if f is None:
        return []
    return [provenance(engine, f.request_id, f.position)] + \
        triage(engine, f, reference[f.request_id], score, report.threshold).lines()


def failure_message(report: GateReport, engine=None, reference=None, score=None) -> str:
    """A failed gate's message: its problems, then (given the engine) provenance and triage of the first failure."""
    lines = [f"gate {report.gate} failed:"] + [f"  {p}" for p in report.problems()]
    if engine is not None and reference is not None:
        lines += explain(report, engine, reference, score)
    return "\n".join(lines)
