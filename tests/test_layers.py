"""The layers of engine/ (docs/DESIGN.md's "Layers inside engine/"), held as rules on the import graph, read from the
source (runtime imports; a block under `if TYPE_CHECKING:` is a type, not an import):

- bookkeeping: requests, the pool, the prefix cache, the KV-cache manager (the scheduler's one seam to the pages),
  the scheduler and its prefill-share ledger, the schedule log, the step-path census, the checks of a step launched
  ahead (foresight): no torch, no numpy, nothing from the other layers;
- execution: the runner, its readback and its poisoned-read search, model, packing, captured steps, tensor parallel
  (engine/tp/), the loader: nothing from the facade;
- facade: Engine, its configuration and what it serves, errors, inputs, workloads, the poisoned-read report, the heap
  guard.

And no circle anywhere in engine/ or gates/, and no `__getattr__` forwarding in engine/."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LAYERS = {
    "bookkeeping": {"engine.request", "engine.pool", "engine.prefix_cache", "engine.kv_cache", "engine.scheduler",
                    "engine.prefill_share", "engine.schedule_log", "engine.census", "engine.foresight", "engine.copying",
                    "engine.errors"},
    "execution": {"engine.runner", "engine.readback", "engine.poisoned_reads", "engine.model", "engine.layer_kernels",
                  "engine.packing", "engine.graphs", "engine.step_graphs", "engine.loader", "engine.dtypes", "engine.build_cost", "engine.tp",
                  "engine.tp.runner", "engine.tp.shard", "engine.tp.worker", "engine.tp.layers"},
    "facade": {"engine", "engine.engine", "engine.intake", "engine.served", "engine.sigint", "engine.config",
               "engine.inputs", "engine.workload", "engine.poison_report", "engine.heap"},
}
# engine.errors is the one module every layer shares (a typed error is raised wherever a rule breaks)
SHARED = {"engine.errors"}
NO_TORCH = ("torch", "numpy", "kernels")
TORCH_FREE_KERNELS = {"kernels.errors"}       # ConfigError, shared below every layer (kernels/errors.py)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, name: str | None = None) -> set[str]:
    """Every module `path` (module `name`, default from its place in the repo) imports at run time, by absolute
    name (relative imports resolved). `from . import x` counts as an import of the submodule x, not of the package
    (which any submodule's import runs first anyway)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                subs = {f"{base}.{a.name}" for a in child.names}
                subs = {m for m in subs if (REPO / Path(*m.split("."))).with_suffix(".py").exists()
                        or (REPO / Path(*m.split("."))).is_dir()}
                found.update(subs or {base})
            walk(child)
    walk(ast.parse(path.read_text()))
    found.discard(name)
    return found


def graph(package: str) -> dict[str, set[str]]:
    mods = {module_name(p): p for p in sorted((REPO / package).rglob("*.py"))}
    return {m: {d for d in runtime_imports(p) if d in mods} for m, p in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in g:
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> str:
    return next(layer for layer, mods in LAYERS.items() if module in mods)


def test_every_engine_module_has_a_layer():
    missing = sorted(set(graph("engine")) - set().union(*LAYERS.values()))
    assert not missing, f"engine modules in no layer (add them to tests/test_layers.py's LAYERS): {missing}"


@pytest.mark.parametrize("package", ["engine", "gates"])
def test_no_import_circle(package):
    assert circles(graph(package)) == []


def test_bookkeeping_imports_no_torch_and_no_other_layer():
    bad = []
    for m in LAYERS["bookkeeping"]:
        path = REPO / Path(*m.split(".")).with_suffix(".py")
        for d in runtime_imports(path):
            if d.split(".")[0] in NO_TORCH and d not in TORCH_FREE_KERNELS:
                bad.append(f"{m} imports {d}")
            elif d.startswith("engine") and d != "engine" and d not in SHARED and layer_of(d) != "bookkeeping":
                bad.append(f"{m} imports {d} ({layer_of(d)})")
    assert not bad, bad


def test_execution_imports_nothing_from_the_facade():
    g = graph("engine")
    bad = [f"{m} imports {d}" for m in LAYERS["execution"] for d in g[m]
           if d in LAYERS["facade"] and d not in SHARED]
    assert not bad, bad


def test_no_getattr_forwarding_in_engine():
    found = [f"{p.relative_to(REPO)}:{n.lineno}" for p in (REPO / "engine").rglob("*.py")
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    assert not found, f"__getattr__ forwards what a class does not say it has: {found}"


def test_the_rules_see_a_planted_circle_and_a_planted_torch_import(tmp_path):
    """The checks can fail: a circle and a torch import in bookkeeping are found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    fake = REPO / "engine" / "request.py"
    source = fake.read_text()
    planted = tmp_path / "request.py"
    planted.write_text("import torch\n" + source)
    assert "torch" in runtime_imports(planted, "engine.request") and "torch" not in runtime_imports(fake)


def test_raw_run_files_are_small_and_hold_no_code():
    """Device runs' raw files (docs/runs/, cited by RESULTS.md) stay a size-capped record: summaries and tables, no
    script that imports the library, at most 1 MiB in all; older runs' files live in git history."""
    runs = REPO / "docs" / "runs"
    files = [p for p in runs.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 1 << 20
    code = [str(p.relative_to(REPO)) for p in files if p.suffix in (".py", ".sh", ".ipynb")]
    assert not code, f"code under the raw-run folder: {code}"
    assert not (REPO / "artifacts").exists(), "raw artifacts moved out of the tree (git history keeps them)"


def test_bench_keeps_the_product_benchmarks():
    modules = sorted(p.name for p in (REPO / "bench").glob("*.py"))
    assert len(modules) <= 12, modules
