"""The golden store: one golden per (model, workload, reference engine, device, dtype) under golden/.

Each golden is two files: `<ref>-<device>-<dtype>.meta.json` (pretty JSON, diff-friendly: model checksum, engine
config, library versions, device, dtype, schema version, and the data's sha256) and `<ref>-<device>-<dtype>.json.gz`
(per request: prompt, emitted tokens, top-k ids and raw logits per position, steps for engine configurations).
Gates only read goldens. Regeneration is deliberate and atomic, and prints what moved, request by request:

    python -m gates.golden regen [--model small] [--workload mixed-cpu] [--reference hf] [--device cpu]
                                 [--dtype float32] [--golden-dir DIR] [--check]
    python -m gates.golden show  golden/qwen2-small/mixed-cpu/hf-cpu-float32

`--check` generates and reports against the stored golden and writes nothing; its exit status is 1 when a request
changed beyond the tie rule or emitted a token at another step (what a gate would fail on), or the golden is missing.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import json
import os
import platform
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.config import config_differences
from engine.loader import model_checksum
from engine.workload import SMOKE_CPU, Workload, get_workload

from .compare import TIE_THRESHOLD, GateReport, compare
from .paths import golden_root
from .prog import prog
from .records import GenRecord

SCHEMA_VERSION = 1
GOLDEN_DIR = golden_root()
REFERENCES = ("hf", "chunked", "fused", "flash")


class GoldenError(RuntimeError):
    """A golden is missing, corrupt or stale; the message names the file and how to regenerate it."""


def model_key(model) -> str:
    from engine.loader import resolve
    return Path(str(resolve(model))).name if isinstance(resolve(model), (str, Path)) else str(model)


def golden_path(golden_dir, model, workload: str, reference: str, device: str, dtype: str) -> Path:
    dev = "cuda" if str(device).startswith("cuda") else str(device)
    return Path(golden_dir or GOLDEN_DIR) / model_key(model) / workload / f"{reference}-{dev}-{dtype}"


def regen_command(model, workload, reference, device, dtype, golden_dir=None) -> str:
    m = "" if model in (None, "small") else f" --model {model}"
    default = golden_dir is None or Path(golden_dir).resolve() == GOLDEN_DIR.resolve()
    g = "" if default else f" --golden-dir {golden_dir}"
    return (f"python -m gates.golden regen{m} --workload {workload} --reference {reference} --device {device} "
            f"--dtype {dtype}{g}   (or: pytest gates/ --regen-golden{g})")


def check_writable(folder: Path) -> None:
    """Create `folder` and prove it takes a file, so that an unwritable one fails before a long generation."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise GoldenError(f"cannot write goldens to {folder} ({e.strerror or e}); nothing was generated: fix its "
                          f"permissions or pass --golden-dir") from None


def _new_file_mode() -> int:
    """The mode open() would give a new file: mkstemp's 0600 would hide a golden from everyone but its writer."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _new_file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def device_name(device: str) -> str:
    if str(device).startswith("cuda"):
        import torch
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.machine()})"


def library_versions() -> dict:
    import torch
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def write_golden(base: Path, records: dict[str, GenRecord], meta: dict) -> None:
    """Data first, then the metadata that names the data's checksum: a reader never sees a half-written pair as
    whole (a crash in between leaves a checksum mismatch, reported as such)."""
    payload = json.dumps({"requests": [r.to_json() for r in records.values()]}, separators=(",", ":")).encode()
    data = gzip.compress(payload, mtime=0)
    meta = {**meta, "schema_version": SCHEMA_VERSION, "data_sha256": hashlib.sha256(data).hexdigest()}
    _atomic_write(base.with_suffix(".json.gz"), data)
    _atomic_write(base.with_suffix(".meta.json"), (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())


def read_golden(base: Path, how_to_regen: str = "", model_checksum: str | None = None
                ) -> tuple[dict[str, GenRecord], dict]:
    """Read a golden; `model_checksum`, if given, must match the one it was made with (else it is stale)."""
    base = Path(base)
    meta_p, data_p = base.with_suffix(".meta.json"), base.with_suffix(".json.gz")
    hint = f"; regenerate it with: {how_to_regen}" if how_to_regen else ""
    if not meta_p.exists() or not data_p.exists():
        raise GoldenError(f"golden {base} is missing ({meta_p.name} / {data_p.name}){hint}")
    try:
        meta = json.loads(meta_p.read_text())
    except ValueError as e:
        raise GoldenError(f"golden metadata {meta_p} is corrupt ({e}){hint}") from None
    if not isinstance(meta, dict):
        raise GoldenError(f"golden metadata {meta_p} is corrupt: it holds {kind(meta)}, not an object of fields{hint}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise GoldenError(f"golden {meta_p} has schema {meta.get('schema_version')}, this code reads "
                          f"{SCHEMA_VERSION}{hint}")
    if model_checksum is not None and meta.get("model_checksum") != model_checksum:
        raise GoldenError(f"golden {meta_p} was made for model {meta.get('model_checksum')}, but the model now is "
                          f"{model_checksum}: it is stale{hint}")
    data = data_p.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta.get("data_sha256"):
        raise GoldenError(f"golden {data_p} does not match the checksum in {meta_p.name}: it was edited by hand or "
                          f"is corrupt{hint}")
    try:
        payload = json.loads(gzip.decompress(data))
    except (OSError, ValueError) as e:
        raise GoldenError(f"golden {data_p} is corrupt ({e}){hint}") from None
    problem = data_problem(payload)
    if problem:
        raise GoldenError(f"golden {data_p} is corrupt: {problem}{hint}")
    return {r["request_id"]: GenRecord.from_json(r) for r in payload["requests"]}, meta


def kind(value) -> str:
    """A JSON value's kind, for a message: `null`, `a list`, `a string ("text")`, ..."""
    if value is None:
        return "null"
    name = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)
    return f"{name} ({json.dumps(value)[:40]})" if isinstance(value, (bool, int, float, str)) else name


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_ints(v) -> bool:
    return isinstance(v, list) and all(map(is_int, v))


def is_numbers(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def data_problem(payload) -> str | None:
    """What is wrong with a golden's decoded data, naming the field (`requests[3].topk_ids[1]`); None: it has the
    shape GenRecord.from_json reads. Valid JSON of another shape (a data file hand-edited with its checksum
    recomputed) would otherwise fail later as an AttributeError or TypeError in a gate."""
    if not isinstance(payload, dict) or "requests" not in payload:
        return f"the top level is {kind(payload)}, not an object with \"requests\""
    reqs = payload["requests"]
    if not isinstance(reqs, list):
        return f"requests is {kind(reqs)}, not a list of requests"
    seen = set()
    for i, r in enumerate(reqs):
        at = f"requests[{i}]"
        if not isinstance(r, dict):
            return f"{at} is {kind(r)}, not an object"
        missing = [f for f in ("request_id", "prompt", "tokens", "topk_ids", "topk_vals") if f not in r]
        if missing:
            return f"{at} has no {', '.join(missing)}"
        if not isinstance(r["request_id"], str) or r["request_id"] in seen:
            return f"{at}.request_id is {kind(r['request_id'])}, not a string of its own"
        seen.add(r["request_id"])
        for name in ("prompt", "tokens"):
            if not is_ints(r[name]):
                return f"{at}.{name} is {kind(r[name])}, not a list of token ids"
        n = len(r["tokens"])
        steps = r.get("steps")
        if steps is not None and not (is_ints(steps) and len(steps) == n):
            return f"{at}.steps is {kind(steps)}, not null or a list of {n} step indices (one per token)"
        for name, ok in (("topk_ids", is_ints), ("topk_vals", is_numbers)):
            rows = r[name]
            if not isinstance(rows, list) or len(rows) != n:
                return f"{at}.{name} is {kind(rows)}, not a list of {n} rows (one per token)"
            for p, row in enumerate(rows):
                if not ok(row) or not row or len(row) != len(r["topk_ids"][p]):
                    return (f"{at}.{name}[{p}] is {kind(row)}, not a non-empty list of "
                            f"{'token ids' if name == 'topk_ids' else 'logits, one per top-k id'}")
    return None


def generate(reference, workload: Workload, model, device, dtype, progress=True):
    """Run a reference engine over a workload; returns (records, metadata)."""
    from tqdm import tqdm
    specs = workload.requests()
    bar = tqdm(total=len(specs), desc=f"{reference.name} on {workload.name}", disable=None if progress else True,
               leave=False)
    records = reference.generate(specs, progress=lambda n: bar.update(n))
    bar.close()
    meta = {"model": model_key(model), "model_checksum": model_checksum(model), "workload": workload.describe(),
            "reference": reference.describe(), "device": str(device), "device_name": device_name(device),
            "dtype": dtype, "libraries": library_versions(), "topk": len(next(iter(records.values())).topk_ids[0]),
            "created": datetime.date.today().isoformat()}
    return records, meta


def regenerate(model, workload_name: str, reference_name: str, device: str, dtype: str, golden_dir=None,
               threshold: float = TIE_THRESHOLD, out=print, check: bool = False) -> GateReport | None:
    """Write a golden anew (with `check`, write nothing) and print what changed against the previous one; None when
    there was no usable previous golden."""
    from .reference import make_reference
    wl = get_workload(workload_name)
    base = golden_path(golden_dir, model, workload_name, reference_name, device, dtype)
    if not check:
        check_writable(base.parent)
    old, old_meta = None, {}
    try:
        old, old_meta = read_golden(base)
    except GoldenError as e:
        out(f"{base}: no usable previous golden ({e})")
    if check and old is None:
        return None
    ref = make_reference(reference_name, None if model == "small" else model, device, dtype,
                         **({} if reference_name == "hf" else {"chunk_tokens": wl.chunk_tokens}))
    records, meta = generate(ref, wl, model, device, dtype)
    if check:
        out(f"checked {base} against a new generation ({len(records)} requests; --check: nothing written)")
    else:
        write_golden(base, records, meta)
        out(f"wrote {base}.meta.json / .json.gz ({len(records)} requests)")
    moved = config_differences((old_meta.get("reference") or {}).get("config") or {},
                               (meta.get("reference") or {}).get("config") or {})
    if moved:
        out(f"configuration of {reference_name} changed against the old golden: {'; '.join(moved)}")
    if old is None:
        return None
    # what moved: the old golden is the reference, the new one the candidate; teacher-force with the new engine
    report = compare(f"regen {base.name}", old, records, ref.score, threshold, flip_cap=10 ** 9, check_steps=True)
    out(describe_changes(report, old, records))
    return report


def changed(report: GateReport | None) -> bool:
    """What a gate reading this golden would fail on: a change beyond the tie rule, a token at another step, or no
    previous golden at all (None)."""
    return report is None or bool(report.failures or report.schedule_diffs)


@dataclass
class LogitMove:
    size: float
    request_id: str
    position: int
    token: int

    def describe(self, threshold: float) -> str:
        return (f"{self.size:.4f} at {self.request_id}@{self.position} token {self.token}: "
                f"{self.size / threshold:.0%} of the {threshold:g} tie rule")


def largest_logit_moves(old: dict[str, GenRecord], new: dict[str, GenRecord]
                        ) -> tuple[LogitMove | None, LogitMove | None]:
    """(the largest |new - old| over every token id both recorded in a position's top-k, the largest over the old
    golden's emitted token). Positions up to and including the first differing token only: later ones were computed
    from different contexts."""
    top = emitted = None
    for rid, o in old.items():
        n = new.get(rid)
        if n is None or list(o.prompt) != list(n.prompt):
            continue
        for pos, (a, b) in enumerate(zip(o.tokens, n.tokens)):
            now = dict(zip(n.topk_ids[pos], n.topk_vals[pos]))
            for tok, was in zip(o.topk_ids[pos], o.topk_vals[pos]):
                if tok in now:
                    move = LogitMove(abs(now[tok] - was), rid, pos, tok)
                    top = move if top is None or move.size > top.size else top
                    if tok == a:
                        emitted = move if emitted is None or move.size > emitted.size else emitted
            if a != b:
                break
    return top, emitted


def name_ranges(names: list[str]) -> str:
    """Names with consecutive numbers folded: mixed-cpu-0000..0011, mixed-cpu-0013."""
    runs: list[list[str]] = []          # [prefix, first number, last number]
    for name in names:
        m = re.fullmatch(r"(.*?)(\d+)", name)
        if m and runs and runs[-1][0] == m[1] and runs[-1][2] and int(m[2]) == int(runs[-1][2]) + 1:
            runs[-1][2] = m[2]
        else:
            runs.append([m[1], m[2], m[2]] if m else [name, "", ""])
    return ", ".join(p + a + (f"..{b}" if b != a else "") for p, a, b in runs)


def describe_changes(report: GateReport, old: dict[str, GenRecord] | None = None,
                     new: dict[str, GenRecord] | None = None) -> str:
    """Per request, named: identical, flipped, changed beyond tolerance, tokens moved to other steps; with both
    goldens, the largest logit moves and their share of the tie rule."""
    moved: dict[str, list] = {}
    for d in report.schedule_diffs:
        moved.setdefault(d.request_id, []).append(d)
    identical = [v.request_id for v in report.verdicts if v.status == "identical" and v.request_id not in moved]
    flipped = [v for v in report.verdicts if v.status == "flipped"]
    lines = [f"against the previous golden: {len(identical)} identical, {len(flipped)} flipped, "
             f"{len(report.failures)} changed beyond tolerance, {len(moved)} with tokens emitted at other steps"]
    if identical:
        lines.append(f"  identical: {name_ranges(identical)}")
    for f in report.flips:
        lines.append(f"  flipped {f.request_id}@{f.position}: {f.ref_token} -> {f.cand_token} (gap "
                     f"{f.ref_gap:.4f} in the old golden's logits, {f.cand_gap:.4f} in the new; site {f.site}"
                     + (", teacher-forced)" if f.teacher_forced else ")"))
    for f in report.failures:
        lines.append(f"  changed {f.message()}")
    for rid, ds in moved.items():
        lines.append(f"  moved {rid}: {len(ds)} token(s) emitted at other steps, the first at position "
                     f"{ds[0].position}: step {ds[0].ref_step} -> {ds[0].cand_step}")
    if old is not None and new is not None:
        top, emitted = largest_logit_moves(old, new)
        for what, move in (("largest logit move", top), ("largest move of an emitted token's logit", emitted)):
            lines.append(f"  {what}: " + (move.describe(report.threshold) if move else "none (nothing in common)"))
    return "\n".join(lines)


def default_targets(references: list[str]) -> list[tuple[str, str]]:
    """(workload, reference) pairs a regen without --workload writes: the token gates' workloads for every reference,
    and the smoke gate's for hf, the only reference it reads."""
    return [(wl, ref) for wl in ("mixed-cpu", "uniform-cpu") for ref in references] + \
        ([(SMOKE_CPU.name, "hf")] if "hf" in references else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("gates.golden"), description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("regen", help="write goldens (atomically) and print what changed")
    r.add_argument("--model", default="small",
                   help="small, small-trained, qwen2.5-1.5b-random, or a checkpoint directory (default: small)")
    r.add_argument("--workload", action="append", help="repeatable; default: mixed-cpu and uniform-cpu (and "
                                                       "smoke-cpu for hf, the smoke gate's reference)")
    r.add_argument("--reference", action="append", choices=REFERENCES, help="repeatable; default: hf")
    r.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the reference runs (default: cpu)")
    r.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (default: float32)")
    r.add_argument("--golden-dir", default=None, help=f"the golden folder (default: {GOLDEN_DIR})")
    r.add_argument("--tie-threshold", type=float, default=TIE_THRESHOLD,
                   help=f"the raw-logit gap under which a changed token is a near-tie flip (default: {TIE_THRESHOLD})")
    r.add_argument("--check", action="store_true",
                   help="generate and report against the stored golden, write nothing; exit 1 if a request changed "
                        "beyond the tie rule or moved to another step")
    s = sub.add_parser("show", help="print a golden's metadata and per-request summary")
    s.add_argument("base", help="the golden's path without its suffixes, e.g. "
                                "golden/qwen2-small/mixed-cpu/hf-cpu-float32")
    a = ap.parse_args(argv)
    if a.cmd == "show":
        records, meta = read_golden(Path(a.base))
        print(json.dumps(meta, indent=2, sort_keys=True))
        for rec in records.values():
            print(f"{rec.request_id}: prompt {len(rec.prompt)}, {len(rec.tokens)} tokens {rec.tokens[:8]}...")
        return 0
    targets = default_targets(a.reference or ["hf"]) if not a.workload else \
        [(wl, ref) for wl in a.workload for ref in a.reference or ["hf"]]
    try:
        if not a.check:      # every folder before the first generation
            for wl, ref in targets:
                check_writable(golden_path(a.golden_dir, a.model, wl, ref, a.device, a.dtype).parent)
        reports = [regenerate(a.model, wl, ref, a.device, a.dtype, a.golden_dir, a.tie_threshold, check=a.check)
                   for wl, ref in targets]
    except GoldenError as e:
        print(f"gates.golden: {e}", file=sys.stderr)
        return 2
    return 1 if a.check and any(changed(r) for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
