"""Parity report: compare two engines' outputs on a workload and count differing requests by prompt length (as the
seeds did: "of the 125 requests with 4,096-token prompts, 75 differ"), with flip sites and their gaps.

    python -m gates.parity --a hf --b fused --workload mixed-cpu [--device cpu --dtype float32]
    python -m gates.parity --a golden:fused --b flash --workload mixed-cpu --device cuda --dtype float16

An engine is `hf`, a lineage configuration (chunked, fused, flash), or `golden:<reference>` to read a stored golden.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from engine.workload import get_workload

from .compare import TIE_THRESHOLD, compare
from .golden import golden_path, read_golden, regen_command
from .prog import prog
from .reference import make_reference


def records_of(name: str, workload, model, device, dtype):
    if name.startswith("golden:"):
        ref = name.split(":", 1)[1]
        base = golden_path(None, model, workload.name, ref, device, dtype)
        return read_golden(base, regen_command(model, workload.name, ref, device, dtype))[0], None
    overrides = {} if name == "hf" else {"chunk_tokens": workload.chunk_tokens}
    ref = make_reference(name, None if model == "small" else model, device, dtype, **overrides)
    return ref.generate(workload.requests()), ref


def parity(a_records, b_records, scorer, threshold: float) -> dict:
    report = compare("parity", a_records, b_records, scorer, threshold, flip_cap=10 ** 9, check_steps=False)
    by_len: dict[int, dict] = defaultdict(lambda: {"requests": 0, "differ": 0, "flipped": 0, "failed": 0})
    for v in report.verdicts:
        row = by_len[v.prompt_len]
        row["requests"] += 1
        rid = v.request_id
        row["differ"] += a_records[rid].tokens != b_records[rid].tokens if rid in b_records else 1
        row["flipped"] += v.status == "flipped"
        row["failed"] += v.status == "failed"
    return {"by_prompt_length": dict(sorted(by_len.items())), "counts": report.counts(),
            "flip_sites": [{"request": f[0].request_id, "position": f[0].position, "ref_gap": f[0].ref_gap,
                            "cand_gap": f[0].cand_gap, "requests": len(f)} for f in report.sites.values()],
            "problems": report.problems()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("gates.parity"), description=__doc__.splitlines()[0])
    engine = "hf, chunked, fused, flash, or golden:<reference> (a stored golden)"
    ap.add_argument("--a", default="hf", help=f"the reference side: {engine} (default: hf)")
    ap.add_argument("--b", default="fused", help=f"the candidate side: {engine} (default: fused)")
    ap.add_argument("--workload", default="mixed-cpu", help="workload name (default: mixed-cpu)")
    ap.add_argument("--model", default="small",
                    help="small, small-trained, qwen2.5-1.5b-random, or a checkpoint directory (default: small)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ap.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (default: float32)")
    ap.add_argument("--tie-threshold", type=float, default=TIE_THRESHOLD,
                    help=f"the raw-logit gap under which a changed token is a near-tie flip (default: {TIE_THRESHOLD})")
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("--offline", action="store_true",
                    help="two goldens, no live engine (e.g. GPU goldens read on a CPU): a first difference is judged "
                         "from both sides' stored logits; what follows an accepted flip is reported as unchecked")
    args = ap.parse_args(argv)
    wl = get_workload(args.workload)
    a, a_ref = records_of(args.a, wl, args.model, args.device, args.dtype)
    b, _ = records_of(args.b, wl, args.model, args.device, args.dtype)
    if args.offline:
        a_ref = None
    elif a_ref is None:   # a golden: teacher-force with the live engine it came from
        name = args.a.split(":", 1)[1]
        a_ref = make_reference(name, None if args.model == "small" else args.model, args.device, args.dtype,
                               **({} if name == "hf" else {"chunk_tokens": wl.chunk_tokens}))
    rep = parity(a, b, a_ref.score if a_ref is not None else None, args.tie_threshold)
    print(f"{args.b} against {args.a} on {args.workload} ({args.device}, {args.dtype}):")
    print(f"{'prompt':>7} {'requests':>9} {'differ':>7} {'flipped':>8} {'failed':>7}")
    for n, row in rep["by_prompt_length"].items():
        print(f"{n:>7} {row['requests']:>9} {row['differ']:>7} {row['flipped']:>8} {row['failed']:>7}")
    for s in rep["flip_sites"]:
        print(f"  flip site {s['request']}@{s['position']}: gaps {s['ref_gap']:.4f} / {s['cand_gap']:.4f}, "
              f"{s['requests']} request(s)")
    for p in rep["problems"]:
        print(f"  FAIL {p}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0 if not rep["counts"]["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
