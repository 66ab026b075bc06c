"""The non-editable install's smoke test (.ci/run). Run from outside the checkout with only the installed package
first on the path: the engine comes from the install, finds its embedded small models there (the same bytes as the
checkout's golden/models) and serves a request; every console script of the installed distribution answers --help,
in this process and through its installed wrapper.
Usage: python scripts/installed_smoke.py CHECKOUT"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def script_problems(scripts: dict[str, str]) -> list[str]:
    """{console script: "module:function"} -> what is wrong: a target that does not import, is not callable, or does
    not answer ["--help"] with usage and exit status 0. tests/test_packaging.py runs it on pyproject.toml's list."""
    import importlib
    problems = []
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        try:
            main = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            problems.append(f"{name} = {target!r}: {type(e).__name__}: {e}")
            continue
        if not callable(main):
            problems.append(f"{name} = {target!r} is not callable")
            continue
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                main(["--help"])
            code = 0
        except SystemExit as e:
            code = e.code
        if code not in (0, None) or "usage:" not in out.getvalue():
            problems.append(f"{name} = {target!r}: --help exited {code!r} with {out.getvalue()[:200]!r}")
    return problems


def wrapper_of(name: str, site: Path) -> Path | None:
    """The installed console script: in the target folder's bin/ (pip install --target) or the environment's."""
    for d in (site / "bin", Path(sysconfig.get_path("scripts"))):
        if (d / name).is_file():
            return d / name
    return None


def main(argv: list[str]) -> int:
    checkout = Path(argv[0]).resolve()
    import engine
    from engine import Engine, EngineConfig
    from engine.loader import NAMED_MODELS
    site = Path(engine.__file__).resolve().parent.parent
    problems = []
    if site == checkout:
        problems.append(f"engine imported from the checkout ({engine.__file__}), not from the install")
    for name, d in NAMED_MODELS.items():
        d = Path(d).resolve()
        ours = checkout / "golden" / "models" / d.name
        if d.is_relative_to(checkout):
            problems.append(f"model {name!r} found in the checkout ({d}), not in the install")
        elif not d.is_dir():
            problems.append(f"model {name!r}: {d} is not installed")
        else:
            problems += [f"model {name!r}: installed {f.name} differs from the checkout's" for f in ours.iterdir()
                         if f.is_file() and digest(f) != digest(d / f.name)]
    dist = metadata.distribution("stepgate")
    if Path(dist.locate_file("")).resolve() != site:
        problems.append(f"the stepgate distribution found first is at {dist.locate_file('')}, not {site}")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    if not scripts:
        problems.append("the installed distribution declares no console scripts")
    problems += script_problems(scripts)
    for name in scripts:
        exe = wrapper_of(name, site)
        if exe is None:
            problems.append(f"console script {name} was not installed")
            continue
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env, cwd=site)
        if run.returncode != 0 or "usage:" not in run.stdout:
            problems.append(f"{exe} --help exited {run.returncode}: {(run.stderr or run.stdout)[-300:]}")
        break       # one wrapper run is enough: they differ only in the target checked in-process above
    if not problems:
        e = Engine(EngineConfig(chunk_tokens=64, max_batch=2))
        e.submit([5, 17, 300, 42], 4, request_id="smoke")
        e.run()
        result = e.pop_result("smoke")
        if result.state != "finished" or len(result.tokens) != 4:
            problems.append(f"the installed engine did not serve: {result}")
    for p in problems:
        print(f"installed_smoke: FAIL: {p}", file=sys.stderr)
    if not problems:
        print(f"installed_smoke: ok: engine from {site}, models {sorted(NAMED_MODELS)}, console scripts "
              f"{sorted(scripts)}, served {result.tokens}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
