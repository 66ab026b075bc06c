"""The GitHub workflows checked beyond GitHub's schema: jobs and steps well formed, the self-hosted runner's labels
declared for actionlint, every script, module, pytest path and pytest option a step names present here, every file
a job uploads written by one of its steps and every file it writes uploaded; and the two recipes doing what they
are for (the GPU gates: parallel, serial step timings, the same-job A/B against the merge base on pull requests and
no alert from a stored baseline, gates.alert, flash-attn cached; CPU: .ci/run).

    python scripts/check_workflows.py        # .github/workflows/*.yml: one line a problem, exit 1 if any
"""
from __future__ import annotations

import fnmatch
import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"
ACTIONLINT_CONFIG = REPO / ".github" / "actionlint.yaml"
GITHUB_LABELS = {"self-hosted", "linux", "windows", "macos", "x64", "arm64", "arm"}
VALUED = {"-n", "-m", "-p", "-k", "-c", "-o", "--dist"}          # pytest's short options that take a value
WRITERS = ("--gate-summary", "--gate-summary-md", "--benchmark-json", "--markdown")   # each names a file written
GATE_SUMMARY_DEFAULTS = ("gate-summary.json", "gate-summary.md")  # gates/options.py: where a gate run writes them
SEPARATORS = {"&&", "||", ";", "|", "(", ")", "&", "$(", "`", "{", "}"}
KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!"}
WRAPPERS = frozenset({"timeout", "env", "time", "exec", "nice", "stdbuf"})   # run the command after their options


def load(path: Path) -> dict:
    """A workflow as a dict; YAML 1.1 reads the key `on` as True, given back its name."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a mapping")
    if True in data:
        data["on"] = data.pop(True)
    return data


def declared_labels(config: Path = ACTIONLINT_CONFIG) -> set[str]:
    if not config.is_file():
        return set()
    return set((yaml.safe_load(config.read_text()) or {}).get("self-hosted-runner", {}).get("labels", []))


def pytest_options(repo: Path = REPO) -> set[str]:
    """Every long option `pytest --help` lists in this repository (its plugins and conftest included)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=repo,
                         capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(?<![\w-])(--[a-zA-Z][\w-]*)", out))


def commands(script: str) -> list[list[str]]:
    """The simple commands of a step's shell script: words, with variable assignments and keywords left out."""
    script = re.sub(r"\\\n\s*", " ", script)
    out: list[list[str]] = []
    for line in script.splitlines():
        if line.strip().startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            words = list(lexer)
        except ValueError:           # an unclosed quote: a line continued in a way this reader does not follow
            continue
        cmd: list[str] = []
        for w in words + [";"]:
            if w in SEPARATORS or w.endswith("$(") or set(w) <= set(";&|()"):
                if cmd:
                    out.append(cmd)
                cmd = []
            elif cmd or not (w in KEYWORDS or re.fullmatch(r"\w+=.*", w)):
                cmd.append(w)
    return out


def variable(word: str) -> bool:
    return "$" in word


def path_like(word: str) -> bool:
    return not variable(word) and "://" not in word and ("/" in word or word.endswith((".py", ".sh")))


def norm(path: str) -> str:
    """A path with every variable ($X, ${X}, ${{ ... }}) as a wildcard, no quotes, no trailing slash."""
    path = re.sub(r"\$\{\{[^}]*\}\}|\$\{\w+\}|\$\w+", "*", path.strip().strip("'\""))
    return path.rstrip("/") or path


@dataclass
class Job:
    problems: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)      # files and folders its commands write (normalised)
    seen: list[list[str]] = field(default_factory=list)   # every command, scripts it runs expanded


def check_command(cmd: list[str], job: Job, where: str, options: set[str], repo: Path, depth: int = 0,
                  wrappers: frozenset[str] = frozenset()) -> None:
    while cmd and (cmd[0] in WRAPPERS | wrappers or re.fullmatch(r"-\S*|\d+[smh]?", cmd[0])):
        cmd = cmd[1:]       # `timeout 600 pytest ...`, or a function of the script that runs its arguments
    if not cmd:
        return
    job.seen.append(cmd)
    exe = Path(cmd[0]).name
    if exe in ("bash", "sh") and len(cmd) > 1 and not cmd[1].startswith("-"):
        script = cmd[1]
        if variable(script):
            return
        if not (repo / script).is_file():
            job.problems.append(f"{where}: runs {script}, which is not in the repository")
        elif depth < 2:
            text = (repo / script).read_text()
            functions = frozenset(re.findall(r"^\s*(\w+)\s*\(\)\s*\{", text, re.M))
            for inner in commands(text):
                check_command(inner, job, f"{where} ({script})", options, repo, depth + 1, functions)
        return
    if exe.startswith("python"):
        args = cmd[1:]
        if args[:1] == ["-m"] and len(args) > 1:
            if args[1] == "pytest":
                check_pytest(args[2:], job, where, options, repo)
            else:
                check_module(args[1], args[2:], job, where, repo)
        elif args and args[0] != "-c" and not args[0].startswith("-") and path_like(args[0]):
            if not (repo / args[0]).is_file():
                job.problems.append(f"{where}: runs {args[0]}, which is not in the repository")
        return
    if exe == "pytest":
        check_pytest(cmd[1:], job, where, options, repo)
        return
    for i, w in enumerate(cmd[:-1]):
        if w in (">", ">>") and not variable(cmd[i + 1]) and not cmd[i + 1].startswith("/dev/"):
            job.written.append(norm(cmd[i + 1]))


def check_module(module: str, args: list[str], job: Job, where: str, repo: Path) -> None:
    local = repo / Path(*module.split("."))
    if (repo / module.split(".")[0]).exists():          # one of this repository's packages: the file must be here
        found = local.with_suffix(".py").is_file() or (local / "__main__.py").is_file()
    else:
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    if not found:
        job.problems.append(f"{where}: python -m {module}: no such module here or installed")
    job.written += [norm(v) for v in values(args, ("--markdown", "--out"))]


def values(args: list[str], names: tuple[str, ...]) -> list[str]:
    out = []
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in names:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value:
                out.append(value)
    return out


def check_pytest(args: list[str], job: Job, where: str, options: set[str], repo: Path) -> None:
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in VALUED:
            skip = True
        elif a.startswith("--"):
            name = a.partition("=")[0]
            if options and name not in options:
                job.problems.append(f"{where}: pytest {name}: no such option (pytest --help in this repository)")
        elif path_like(a):
            target = a.split("::")[0]
            if not (repo / target).exists():
                job.problems.append(f"{where}: pytest {a}: {target} is not in the repository")
    written = [norm(v) for v in values(args, WRITERS)]
    if any(a.rstrip("/").split("/")[0] == "gates" for a in args if not a.startswith("-")):
        for default, option in zip(GATE_SUMMARY_DEFAULTS, ("--gate-summary", "--gate-summary-md")):
            if not values(args, (option,)):
                written.append(default)
    storage = values(args, ("--benchmark-storage",))
    if storage and any(a in ("--benchmark-autosave", "--benchmark-save") or variable(a) for a in args):
        written.append(norm(storage[0].removeprefix("file://")))     # a baseline saved (perhaps: "${save[@]}")
    job.written += written


def uploads(steps: list[dict]) -> list[tuple[str, str]]:
    """(step name, path pattern) of every upload-artifact step."""
    out = []
    for s in steps:
        if str(s.get("uses", "")).startswith("actions/upload-artifact"):
            for line in str((s.get("with") or {}).get("path", "")).splitlines():
                if line.strip() and not line.strip().startswith("!"):
                    out.append((s.get("name", "upload"), norm(line)))
    return out


def structure(name: str, wf: dict, labels: set[str]) -> list[str]:
    problems = [f"{name}: no `{k}`" for k in ("name", "on", "jobs") if not wf.get(k)]
    for job_id, job in (wf.get("jobs") or {}).items():
        where = f"{name} job {job_id}"
        if not isinstance(job, dict):
            problems.append(f"{where}: not a mapping")
            continue
        for key in ("runs-on", "steps", "timeout-minutes"):
            if key not in job:
                problems.append(f"{where}: no `{key}`" + (" (a hung step would hold the runner for 6 hours)"
                                                          if key == "timeout-minutes" else ""))
        runs_on = job.get("runs-on", [])
        runs_on = [runs_on] if isinstance(runs_on, str) else list(runs_on)
        if "self-hosted" in runs_on:
            missing = [x for x in runs_on if x not in GITHUB_LABELS | labels]
            if missing:
                problems.append(f"{where}: runner labels {missing} are not declared in .github/actionlint.yaml")
        for i, step in enumerate(job.get("steps") or []):
            if not isinstance(step, dict) or ("run" in step) == ("uses" in step):
                problems.append(f"{where} step {i + 1}: needs exactly one of `run` and `uses`")
    return problems


def check_workflow(name: str, wf: dict, options: set[str], labels: set[str], repo: Path = REPO) -> list[str]:
    """Every problem of one workflow, one line each."""
    problems = structure(name, wf, labels)
    for job_id, job in (wf.get("jobs") or {}).items():
        if not isinstance(job, dict):
            continue
        state = Job()
        steps = [s for s in job.get("steps") or [] if isinstance(s, dict)]
        for s in steps:
            for cmd in commands(str(s.get("run", ""))):
                check_command(cmd, state, f"{name} job {job_id} step {s.get('name', '?')!r}", options, repo)
        problems += state.problems
        ups = uploads(steps)
        for step, pattern in ups:
            if not any(fnmatch.fnmatch(w, pattern) or w == pattern for w in state.written):
                problems.append(f"{name} job {job_id}: {step!r} uploads {pattern}, which no step of the job writes")
        if ups:
            for w in state.written:
                if not any(fnmatch.fnmatch(w, p) or w == p for _, p in ups):
                    problems.append(f"{name} job {job_id}: writes {w}, which no upload-artifact step uploads")
        problems += recipe(name, job_id, job, state, {**(wf.get("env") or {}), **(job.get("env") or {})})
    return problems


def recipe(name: str, job_id: str, job: dict, state: Job, env: dict) -> list[str]:
    """What each recipe is for (issue 17): the self-hosted GPU job and the CPU job (`env`: the job's, over the
    workflow's)."""
    text = [" ".join(c) for c in state.seen]
    runs_on = job.get("runs-on", [])
    problems = []

    def need(ok: bool, what: str):
        if not ok:
            problems.append(f"{name} job {job_id}: {what}")
    if "self-hosted" in (runs_on if isinstance(runs_on, list) else [runs_on]):
        need(any(re.search(r"pytest gates/? .*-n ", t) for t in text), "no parallel gate run (pytest gates/ -n ...)")
        need(any("test_step_timings" in t and " -n " not in t for t in text), "no serial step-timing run")
        # issue 36: the alert is a same-job A/B against the merge base; a stored baseline may be another host's
        need(not any("--benchmark-compare-fail" in t for t in text),
             "a step fails on a stored baseline (--benchmark-compare-fail): another host's baseline alerts nobody; "
             "gates.ab decides")
        need(any(re.search(r"-m gates\.ab .*--base .*--merge-base", t) for t in text) and any(
            "gates.ab" in str(st.get("run", "")) and "pull_request" in str(st.get("if", ""))
            for st in job.get("steps") or [] if isinstance(st, dict)),
             "no same-job A/B on pull requests (python -m gates.ab --base ... --merge-base)")
        need(any("gates.alert" in t for t in text), "no gates.alert report")
        built = [t for t in text if "build_flash_attn.py" in t]
        need(bool(built), "no flash-attn build (build_flash_attn.py)")
        cached = [str((s.get("with") or {}).get("path", "")) for s in job.get("steps") or []
                  if str(s.get("uses", "")).startswith("actions/cache")]
        need(any(f"--workdir {p.strip()}" in t for t in built for p in cached), "the flash-attn build is not cached")
        need(any(re.search(r"--benchmark-json", t) for t in text), "no benchmark JSON written (--benchmark-json)")
        prefix = str(env.get("PYTHONPYCACHEPREFIX", ""))
        need(bool(prefix) and any(p.strip() and prefix.rstrip("/").endswith(p.strip().rstrip("/")) for p in cached),
             "Python's bytecode is not kept between runs (PYTHONPYCACHEPREFIX in a cached folder)")
    elif any(t.startswith("bash .ci/run") for t in text):
        need(any("pytest gates/" in t for t in text), ".ci/run runs no gates")
    return problems


def main() -> int:
    options, labels = pytest_options(), declared_labels()
    problems = []
    for path in sorted(WORKFLOWS.glob("*.y*ml")):
        problems += check_workflow(path.name, load(path), options, labels)
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s) in {len(list(WORKFLOWS.glob('*.y*ml')))} workflow(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
