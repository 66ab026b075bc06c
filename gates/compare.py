"""The comparator: walk each request's tokens against the reference's under the tie rule (TIE_THRESHOLD).

- equal tokens: go on (and, where both sides recorded steps, a token emitted at another step is a schedule
  difference, reported apart from a token difference);
- a differing token is an accepted flip only if it is a near tie in BOTH engines: the absolute raw-logit gap between
  the two tokens is under the threshold in the reference's logits and in the candidate's; otherwise the request
  fails (a candidate that emits a token its own logits rank lower by more than the threshold fails too);
- after an accepted flip, every later position is checked by teacher forcing the reference over the candidate's
  own tokens, with the same rule. Nothing after a flip goes unchecked;
- flips are counted by distinct site (the same prefix flipping in several requests counts once) and capped."""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Callable

from .records import GenRecord

TIE_THRESHOLD = 0.02      # the tie rule's one home: options, regeneration and parity import it

ScoreFn = Callable[[list[int], list[int]], "object"]   # (prompt, tokens) -> logits [len(tokens), vocab]


@dataclass
class Flip:
    request_id: str
    position: int
    ref_token: int
    cand_token: int
    ref_gap: float
    cand_gap: float
    site: str
    teacher_forced: bool


@dataclass
class Failure:
    request_id: str
    position: int
    reason: str
    ref_token: int | None = None
    cand_token: int | None = None
    ref_gap: float | None = None
    cand_gap: float | None = None
    context: str = ""

    def message(self) -> str:
        if self.ref_token is None:
            return f"{self.request_id}: {self.reason}"
        fmt = lambda g: "outside top-k" if g is None else f"{g:.4f}"  # noqa: E731
        return (f"{self.request_id} position {self.position}: reference token {self.ref_token}, candidate token "
                f"{self.cand_token}; gap in reference logits {fmt(self.ref_gap)}, in candidate logits "
                f"{fmt(self.cand_gap)} ({self.reason}); context {self.context}")


@dataclass
class ScheduleDiff:
    request_id: str
    position: int
    ref_step: int
    cand_step: int


@dataclass
class RequestVerdict:
    request_id: str
    prompt_len: int
    flips: list[Flip] = field(default_factory=list)
    failure: Failure | None = None
    schedule_diffs: list[ScheduleDiff] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "failed" if self.failure else ("flipped" if self.flips else "identical")


def site_key(prompt: list[int], prefix: list[int]) -> str:
    return hashlib.sha1(repr((list(prompt), list(prefix))).encode()).hexdigest()[:12]


def context(prompt: list[int], tokens: list[int], pos: int, n: int = 6) -> str:
    return f"...prompt {prompt[-n:]} | output {tokens[max(0, pos - n):pos]} ^"


def gap_in(rec: GenRecord, pos: int, winner: int, other: int) -> float | None:
    """winner's logit minus other's, from rec's recorded top-k; None if other is outside it."""
    w, o = rec.logit(pos, winner), rec.logit(pos, other)
    if w is None or o is None:
        return None
    return w - o


def compare_request(ref: GenRecord, cand: GenRecord, score: ScoreFn | None, threshold: float,
                    check_steps: bool = True) -> RequestVerdict:
    v = RequestVerdict(cand.request_id, len(cand.prompt))
    if list(ref.prompt) != list(cand.prompt):
        v.failure = Failure(cand.request_id, 0, "the candidate served a different prompt than the reference")
        return v
    if len(ref.tokens) != len(cand.tokens):
        v.failure = Failure(cand.request_id, min(len(ref.tokens), len(cand.tokens)),
                            f"emitted {len(cand.tokens)} tokens, the reference {len(ref.tokens)}")
        return v
    for i, (a, b) in enumerate(zip(ref.tokens, cand.tokens)):
        if a != b:
            break
        if check_steps and ref.steps is not None and cand.steps is not None and ref.steps[i] != cand.steps[i]:
            v.schedule_diffs.append(ScheduleDiff(cand.request_id, i, ref.steps[i], cand.steps[i]))
    else:
        return v
    # first differing position i: a flip only if a near tie in both engines' logits
    a, b = ref.tokens[i], cand.tokens[i]
    if not accept(v, ref, cand, i, a, b, gap_in(ref, i, a, b), threshold, teacher_forced=False):
        return v
    if score is None:
        v.failure = Failure(cand.request_id, i, "accepted flip but no reference to teacher-force the rest")
        return v
    tf = score(cand.prompt, cand.tokens)           # the reference over the candidate's own tokens
    for j in range(i + 1, len(cand.tokens)):
        row = tf[j]
        a = int(row.argmax())
        b = cand.tokens[j]
        if a == b:
            continue
        if not accept(v, ref, cand, j, a, b, float(row[a] - row[b]), threshold, teacher_forced=True):
            return v
    return v


def accept(v: RequestVerdict, ref: GenRecord, cand: GenRecord, pos: int, a: int, b: int, ref_gap, threshold,
           teacher_forced: bool) -> bool:
    """Reference token a against candidate token b at pos; ref_gap is a's logit minus b's in the reference. A flip
    needs |gap| under the threshold on both sides: a signed gap lets a side that ranks its own token lower pass."""
    cand_gap = gap_in(cand, pos, b, a)
    ref_abs = None if ref_gap is None else abs(ref_gap)
    cand_abs = None if cand_gap is None else abs(cand_gap)
    if ref_abs is not None and cand_abs is not None and ref_abs < threshold and cand_abs < threshold:
        v.flips.append(Flip(cand.request_id, pos, a, b, ref_abs, cand_abs,
                            site_key(cand.prompt, cand.tokens[:pos]), teacher_forced))
        return True
    reason = f"not a near tie under {threshold}" + (" (teacher-forced after an earlier flip)" if teacher_forced
                                                    else "")
    for side, gap, mine, other in (("reference", ref_gap, a, b), ("candidate", cand_gap, b, a)):
        if gap is not None and gap < 0:
            reason += f"; the {side}'s own logits rank its token {mine} below {other} by {-gap:.4f}"
    v.failure = Failure(cand.request_id, pos, reason, a, b, ref_abs, cand_abs,
                        context(cand.prompt, cand.tokens, pos))
    return False


@dataclass
class GateReport:
    gate: str
    verdicts: list[RequestVerdict]
    threshold: float
    flip_cap: int

    @property
    def failures(self) -> list[Failure]:
        return [v.failure for v in self.verdicts if v.failure]

    @property
    def flips(self) -> list[Flip]:
        return [f for v in self.verdicts for f in v.flips]

    @property
    def sites(self) -> dict[str, list[Flip]]:
        out: dict[str, list[Flip]] = {}
        for f in self.flips:
            out.setdefault(f.site, []).append(f)
        return out

    @property
    def schedule_diffs(self) -> list[ScheduleDiff]:
        return [d for v in self.verdicts for d in v.schedule_diffs]

    def counts(self) -> dict[str, int]:
        c = {"identical": 0, "flipped": 0, "failed": 0}
        for v in self.verdicts:
            c[v.status] += 1
        return c

    @property
    def ok(self) -> bool:
        return not self.failures and len(self.sites) <= self.flip_cap and not self.schedule_diffs

    def problems(self) -> list[str]:
        out = [f.message() for f in self.failures]
        if len(self.sites) > self.flip_cap:
            out.append(f"{len(self.sites)} distinct flip sites, over the cap of {self.flip_cap}: " +
                       "; ".join(f"{f[0].request_id}@{f[0].position} gaps {f[0].ref_gap:.4f}/{f[0].cand_gap:.4f}"
                                 for f in self.sites.values()))
        for d in self.schedule_diffs[:5]:
            out.append(f"{d.request_id} position {d.position}: schedule difference, emitted at step {d.cand_step}, "
                       f"the reference at step {d.ref_step}")
        if len(self.schedule_diffs) > 5:
            out.append(f"... {len(self.schedule_diffs) - 5} more schedule differences")
        return out

    def summary(self) -> dict:
        return {"gate": self.gate, "ok": self.ok, **self.counts(), "flip_sites": len(self.sites),
                "flip_cap": self.flip_cap, "threshold": self.threshold,
                "schedule_differences": len(self.schedule_diffs),
                "flips": [asdict(f) for f in self.flips], "problems": self.problems()}


def compare(gate: str, ref: dict[str, GenRecord], cand: dict[str, GenRecord], score: ScoreFn | None,
            threshold: float = TIE_THRESHOLD, flip_cap: int = 3, check_steps: bool = True) -> GateReport:
    verdicts = []
    for rid, r in ref.items():
        c = cand.get(rid)
        if c is None:
            verdicts.append(RequestVerdict(rid, len(r.prompt), failure=Failure(rid, 0, "missing from the candidate")))
            continue
        verdicts.append(compare_request(r, c, score, threshold, check_steps))
    for rid in cand.keys() - ref.keys():
        verdicts.append(RequestVerdict(rid, len(cand[rid].prompt),
                                       failure=Failure(rid, 0, "not in the reference (different workload?)")))
    return GateReport(gate, verdicts, threshold, flip_cap)
