"""A real package (issue 16): the embedded models are package data, the loader finds them once installed, every
console script answers --help, and the install smoke test (.ci/run, scripts/installed_smoke.py) fails when what it
checks came from the checkout instead of the install."""
from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import tomllib

import pytest

import engine.loader as loader
from gates import alert, golden
from gates.paths import CHECKOUT

PYPROJECT = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]


def smoke_module():
    spec = importlib.util.spec_from_file_location("installed_smoke", CHECKOUT / "scripts" / "installed_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def unshipped(root, patterns) -> list[str]:
    """Files under `root` that the package-data `patterns` leave out."""
    return [str(f.relative_to(root)) for f in sorted(root.rglob("*")) if f.is_file() and
            not any(fnmatch.fnmatch(str(f.relative_to(root)), p) for p in patterns)]


def test_the_console_scripts_are_the_clis():
    assert {"stepgate-bench", "stepgate-golden", "stepgate-alert"} <= set(SCRIPTS)
    assert smoke_module().script_problems(SCRIPTS) == []


def test_a_broken_console_script_is_named():
    problems = smoke_module().script_problems({"gone": "bench.serving:no_such_main", "data": "engine.loader:REPO",
                                               "mod": "engine.no_such_module:main"})
    assert len(problems) == 3, problems
    assert problems[0].startswith("gone = 'bench.serving:no_such_main': AttributeError")
    assert problems[1] == "data = 'engine.loader:REPO' is not callable"
    assert problems[2].startswith("mod = 'engine.no_such_module:main': ModuleNotFoundError")


def test_every_embedded_model_file_is_package_data():
    tool = PYPROJECT["tool"]["setuptools"]
    assert "stepgate_models" in tool["packages"]
    shipped = CHECKOUT / tool["package-dir"]["stepgate_models"]
    assert unshipped(shipped, tool["package-data"]["stepgate_models"]) == []
    for name, d in loader.NAMED_MODELS.items():      # every named model lives in the shipped folder
        assert d.parent == shipped and (d / "config.json").is_file(), name


def test_unshipped_names_a_file_the_patterns_miss(tmp_path):
    (tmp_path / "m").mkdir()
    for f in ("m/config.json", "m/model.safetensors", "m/tokenizer.json"):
        (tmp_path / f).write_text("{}")
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["stepgate_models"]
    assert unshipped(tmp_path, patterns) == ["m/tokenizer.json"]


def test_the_loader_finds_the_installed_models(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "REPO", tmp_path)
    (tmp_path / "stepgate_models").mkdir()
    assert loader.models_dir() == tmp_path / "stepgate_models"          # installed: beside the engine package
    (tmp_path / "golden" / "models").mkdir(parents=True)
    assert loader.models_dir() == tmp_path / "golden" / "models"        # a checkout's own folder first


def test_a_missing_embedded_model_says_where_it_ships(monkeypatch, tmp_path):
    monkeypatch.setitem(loader.NAMED_MODELS, "small", tmp_path / "qwen2-small")
    with pytest.raises(FileNotFoundError, match=r"qwen2-small does not exist: the embedded model 'small' ships "
                                                r"with stepgate .*stepgate_models package once installed"):
        loader.load_model("small")


def test_golden_folders_default_to_the_checkout_here_and_the_working_directory_once_installed(monkeypatch, tmp_path):
    assert golden.GOLDEN_DIR == CHECKOUT / "golden"
    assert alert.DEFAULT_STORAGE == CHECKOUT / "golden" / "benchmarks"
    import gates.paths as paths
    monkeypatch.setattr(paths, "CHECKOUT", tmp_path / "site-packages")     # no golden/ beside an installed package
    monkeypatch.chdir(tmp_path)
    assert paths.golden_root() == tmp_path / "golden"


def test_the_install_smoke_fails_on_the_checkout(capsys):
    # run here, the engine and its models come from the checkout: the smoke test must say so, not pass
    assert smoke_module().main([str(CHECKOUT)]) == 1
    err = capsys.readouterr().err
    assert "installed_smoke: FAIL: engine imported from the checkout" in err
    assert "installed_smoke: FAIL: model 'small' found in the checkout" in err


# -- what a newcomer reads (issue 34) -------------------------------------------------------------------------------
def console_main(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_console_script_names_itself_in_its_usage(script, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [f"/venv/bin/{script}", "--help"])
    with pytest.raises(SystemExit) as e:
        console_main(SCRIPTS[script])(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script} ")
    monkeypatch.setattr("sys.argv", [f"/checkout/{SCRIPTS[script].split(':')[0].replace('.', '/')}.py"])
    with pytest.raises(SystemExit):
        console_main(SCRIPTS[script])(["--help"])
    assert capsys.readouterr().out.startswith(f"usage: python -m {SCRIPTS[script].split(':')[0]} ")


class Parsed(Exception):
    """Raised in place of parsing, carrying the parser a CLI built."""


def parsers_of(target: str, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parser a console script's main builds, and its subcommands' parsers."""
    def grab(self, args=None, namespace=None):
        raise Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(Parsed) as caught:
        console_main(target)([])
    top = caught.value.args[0]
    subs = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return [top] + [p for s in subs for p in s.choices.values()]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_option_of_a_console_script_has_help(script, monkeypatch):
    bare = [f"{p.prog}: {'/'.join(a.option_strings or [a.dest])}" for p in parsers_of(SCRIPTS[script], monkeypatch) for a in p._actions
            if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert bare == [], f"options without help: {bare}"


def test_every_package_folder_is_listed():
    """A subpackage missing from pyproject's explicit list is missing from a wheel (engine/tp/ once was)."""
    listed = set(tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(CHECKOUT).parts) for top in ("engine", "kernels", "gates", "bench")
             for p in (CHECKOUT / top).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
