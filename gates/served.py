"""The served record: what each engine configuration serves on a device by default, committed beside the smoke
golden (golden/<model>/smoke-cpu/served-<device>-<dtype>.json) and checked by the smoke gate. A configuration's
record is its resolved configuration's key (forward, backend, page size, decode kernel and append, captured or
eager, launched ahead or serial, ...) and the step paths its smoke run took (engine/census.py: the step kind, the
kernel paths, captured / uncaptured / eager, launched ahead). The tokens of a run whose steps stopped being captured,
or whose decode stopped appending, agree with the golden's: only this record says that what is served changed. After
an intended change, `pytest gates/test_smoke.py::test_smoke --regen-golden` rewrites it (atomically) and prints what
moved. (A mutation campaign found a backend's graph-safety flags and its fused append switched off unseen.)"""
from __future__ import annotations

import fcntl
import hashlib
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .golden import _atomic_write, golden_path

WORKLOAD = "smoke-cpu"


def record_path(opts) -> Path:
    base = golden_path(opts.golden_dir, opts.model, WORKLOAD, "served", opts.device, opts.dtype)
    return base.with_suffix(".json")


def section(opts, backend: str) -> str:
    """The record's section: tp and any option that changes what a candidate runs (a served record is of defaults)."""
    extra = opts.overrides(backend)
    return f"tp{opts.tp}" + "".join(f",{k}={v}" for k, v in sorted(extra.items()))


def observed(engine) -> dict:
    """What this engine served: its configuration's key and the step paths of its run (sorted, counts left out)."""
    paths = {f"{r['kind']}: {' + '.join(r['kernels']) or 'no attention'}, {r['mode']}"
             + (", launched ahead" if r["ahead"] else "") for r in engine.runner.path_census()}
    return {"key": engine.served.key(), "paths": sorted(paths)}


def differences(recorded: dict, now: dict) -> list[str]:
    out = []
    if recorded.get("key") != now["key"]:
        out.append(f"configuration: recorded {recorded.get('key')}, serves {now['key']}")
    rec = set(recorded.get("paths", []))
    out += [f"step path no longer taken: {p}" for p in sorted(rec - set(now["paths"]))]
    out += [f"step path taken, not recorded: {p}" for p in sorted(set(now["paths"]) - rec)]
    return out


# Each engine configuration's defaults as a user gets them (lineage_config(name) with nothing given: the chunk
# budget, the rows, the page size, the kernel switches left to the device), before any device resolves them: one
# record for every device. A mutation campaign found the default chunk budget (CHUNK_TOKENS) moved unseen: every gate
# runs its workload's own budget, and the CPU workloads' is a quarter of the default, rounded down.
DEFAULTS_FILE = "served-defaults.json"


def defaults_now() -> dict:
    from engine.config import LINEAGE, lineage_config
    return {name: lineage_config(name).describe() for name in sorted(LINEAGE)}


def default_problems(opts) -> list[str]:
    """The defaults against their record (golden/served-defaults.json); under --regen-golden, the record rewritten."""
    path, now = Path(opts.golden_dir) / DEFAULTS_FILE, defaults_now()
    if opts.regen:
        with _locked(path):
            old = json.loads(path.read_text()) if path.is_file() else {}
            _atomic_write(path, (json.dumps(now, indent=1, sort_keys=True) + "\n").encode())
        moved = default_differences(old, now)
        if moved:
            print(f"\nstepgate: served defaults {path}: " + "; ".join(moved))
        return []
    if not path.is_file():
        return [f"no record of the engines' defaults {path}: make it with pytest gates/test_smoke.py::"
                f"test_served_defaults --regen-golden"]
    moved = default_differences(json.loads(path.read_text()), now)
    if moved:
        moved.append("(what a user who passes nothing gets. If the change was intended, regenerate: pytest "
                     "gates/test_smoke.py::test_served_defaults --regen-golden)")
    return moved


def default_differences(recorded: dict, now: dict) -> list[str]:
    out = []
    for name in sorted(set(recorded) | set(now)):
        old, new = recorded.get(name), now.get(name)
        if old is None or new is None:
            out.append(f"{name}: {'no longer a configuration' if new is None else 'a new configuration'}")
            continue
        out += [f"{name}: {field} {old.get(field, '(none)')!r} -> {new.get(field, '(none)')!r}"
                for field in sorted(set(old) | set(new)) if old.get(field) != new.get(field)]
    return out


def regen_command(opts) -> str:
    dev = "" if not opts.is_cuda else f" --device {opts.device}"
    model = "" if opts.model == "small" else f" --model {opts.model}"
    return f"pytest gates/test_smoke.py::test_smoke --regen-golden{dev}{model} --dtype {opts.dtype}"


def problems(opts, candidate: str, backend: str, engine) -> list[str]:
    """The served check of one candidate's smoke run; under --regen-golden, its record written instead."""
    path, sec, now = record_path(opts), section(opts, backend), observed(engine)
    if opts.regen:
        write(path, sec, candidate, now)
        return []
    if not path.is_file():
        return [f"no served record {path} for this device and dtype: make it with {regen_command(opts)}"]
    recorded = json.loads(path.read_text()).get(sec, {}).get(candidate)
    if recorded is None:
        return [f"{path} records nothing for {candidate} at {sec}: make it with {regen_command(opts)}"]
    diffs = differences(recorded, now)
    if diffs:
        diffs.append(f"(the tokens may agree: this is what is served. If the change was intended, regenerate: "
                     f"{regen_command(opts)})")
    return diffs


@contextmanager
def _locked(path: Path):
    """One writer at a time (xdist workers regenerate candidates side by side); the lock lives outside golden/."""
    lock = Path(tempfile.gettempdir()) / f"stepgate-served-{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write(path: Path, sec: str, candidate: str, now: dict) -> None:
    with _locked(path):
        data = json.loads(path.read_text()) if path.is_file() else {}
        old = data.get(sec, {}).get(candidate)
        data.setdefault(sec, {})[candidate] = now
        _atomic_write(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
    moved = differences(old, now) if old is not None else ["(new record)"]
    if old != now:
        print(f"\nstepgate: served record {path} [{sec}] {candidate}: " + "; ".join(moved))


__all__ = ["default_problems", "problems", "record_path"]
