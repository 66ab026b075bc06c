"""Gate trust: bad options stop a run before collection, a model's class comes from its config, every backend is
required on CUDA, a gate file that ran nothing fails the run, a plain run that touches a golden fails, and the cheap
gates run first. Inner runs (pytester, in process) use tiny synthetic gate folders, not the real gates."""
from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest

import kernels
from engine.loader import QWEN25_1P5B, SMALL_MODEL_DIR, model_class, model_config, parameter_count
from gates import options
from gates.golden import GOLDEN_DIR, golden_path
from gates.options import GateOptions, read_options
from gates.snapshot import differences, snapshot
from tests import plants

REPO = Path(__file__).resolve().parent.parent
INNER_CONFTEST = 'pytest_plugins = ["gates.options", "gates.snapshot"]\n'
DEFAULTS = {"--device": "cpu", "--dtype": None, "--backend": "all", "--engine": "all", "--golden-dir": None,
            "--tie-threshold": 0.02, "--flip-cap": 3, "--regen-golden": False, "--model": "small",
            "--allow-skipped-files": False, "--tp": 1, "--decode-kernel": None}


def opts_of(**given) -> GateOptions:
    values = {**DEFAULTS, **{f"--{k.replace('_', '-')}": v for k, v in given.items()}}
    return read_options(values.__getitem__)


def fake_config(**given):
    """Enough of a pytest config for code that reads the gate options."""
    values = {**DEFAULTS, **{f"--{k.replace('_', '-')}": v for k, v in given.items()}}
    return types.SimpleNamespace(stash=pytest.Stash(), getoption=values.__getitem__)


@pytest.fixture
def gate_dir(gate_folder):
    """A synthetic gate folder (with an empty golden/) that loads the stepgate plugins."""
    return gate_folder(INNER_CONFTEST, **{"test_one.py": "def test_one():\n    pass\n"})


def run(pytester, *args):
    return pytester.runpytest("-p", "no:cacheprovider", "--golden-dir", "golden", *args)


# -- options checked before collection -----------------------------------------------------------------------------
def test_a_typo_in_engine_is_a_usage_error_that_names_the_known_values(gate_dir):
    r = run(gate_dir, "--engine", "fussed")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --engine fussed: unknown engine configuration 'fussed' (did you mean 'fused'?);"
                            " known: chunked, fused, flash, all"])
    assert not r.stdout.lines, "a usage error must stop the run before collection"


# messages are fnmatch patterns: `*` for any text, `?` for a bracket (which fnmatch would read as a set)
@pytest.mark.parametrize("args,message", [
    (("--backend", "torch,fussed"), "--backend torch,fussed: unknown attention backend 'fussed'*known: torch, flex, "
                                    "flash, all"),
    (("--dtype", "fp17"), "--dtype: unknown dtype 'fp17' (did you mean 'fp16'?); known: float32*bf16"),
    (("--device", "gpu"), "--device: unknown device 'gpu'*known: cpu, cuda, cuda:N"),
    (("--device", "cuda"), "--device cuda: torch * sees no CUDA device; on this machine use --device cpu"),
    (("--tie-threshold", "-0.01"), "--tie-threshold -0.01: must be a finite number >= 0*"),
    (("--tie-threshold", "nan"), "--tie-threshold nan: must be a finite number >= 0*"),
    (("--flip-cap", "-1"), "--flip-cap -1: must be >= 0*"),
    (("--model", "smal"), "--model: unknown model 'smal' (did you mean 'small'?); known: small, small-trained, "
                          "qwen2.5-1.5b-random, or a checkpoint directory*"),
    (("--model", "golden"), "--model golden: the directory has no config.json*"),
    (("--engine", "fused,,flash"), "--engine 'fused,,flash': an empty name*"),
    (("--engine", "chunked", "--backend", "flex"), "--engine chunked --backend flex: no engine configuration runs on "
                                                   "these backends; the candidates: chunked?torch?, fused?torch?*"),
])
def test_bad_option_values_are_usage_errors(gate_dir, args, message, monkeypatch):
    monkeypatch.setattr(options, "cuda_devices", lambda: 0)     # the same on a GPU machine
    r = run(gate_dir, *args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR, r.stdout.str()
    r.stderr.fnmatch_lines([f"ERROR: {message}"])


def test_all_expands_without_duplicates_and_a_list_keeps_its_order():
    assert opts_of().backends == tuple(kernels.BACKENDS) == ("torch", "flex", "flash")
    assert opts_of(backend="all,flex,torch").backends == ("torch", "flex", "flash")
    assert opts_of(backend="flash,torch,flash").backends == ("flash", "torch")
    assert opts_of(engine="all").engines == ("chunked", "fused", "flash")
    assert opts_of(engine="fused,chunked,fused").engines == ("fused", "chunked")
    assert opts_of(dtype="bf16").dtype == "bfloat16", "an alias is stored by its canonical name (goldens use it)"


@pytest.mark.parametrize("given, kernel, how", [(None, "triton", "its default"), ("flash", "flash", "--decode-kernel")])
def test_the_header_shows_what_the_run_gates(gate_dir, given, kernel, how):
    """...including which kernel the flash configuration's decode runs (the same gates pass or fail either way)."""
    r = run(gate_dir, "--backend", "all,torch", "--collect-only", *(("--decode-kernel", given) if given else ()))
    assert r.ret == 0
    r.stdout.fnmatch_lines([
        "stepgate: device cpu, dtype float32, model small (class small), engines chunked,fused,flash, "
        f"backends torch,flex,flash (skipped where they cannot run; flash decodes with {kernel} ({how}))",
        "stepgate: hypothesis profile * (*); goldens golden (read-only)"])


def test_a_misspelt_decode_kernel_stops_the_run_before_any_gate(gate_dir):
    r = run(gate_dir, "--decode-kernel", "tritn")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --decode-kernel: unknown flash decode kernel 'tritn' (did you mean "
                            "'triton'?); known: triton, flash"])


def test_ci_loads_the_seeded_hypothesis_profile():
    from hypothesis import settings
    assert settings.get_profile("ci").derandomize
    assert "CI=1" in (REPO / ".ci" / "run").read_text()


# -- a model's class comes from its config -------------------------------------------------------------------------
def test_the_embedded_model_given_as_a_directory_is_small_and_gets_the_cpu_workloads():
    from gates.runs import TINY_POOL_SLOTS, workload_for
    from gates.step_states import model_cases
    from engine.workload import MIXED_CPU
    as_dir = os.path.relpath(SMALL_MODEL_DIR, REPO)        # golden/models/qwen2-small, the README's DIR form
    o = opts_of(model=as_dir)
    assert (o.model, o.model_class) == (as_dir, "small")
    assert workload_for(o, "mixed-cpu") == "mixed-cpu"
    assert TINY_POOL_SLOTS.get(o.model_class) == 4608
    assert [c.workload for c in model_cases(fake_config(model=as_dir))] == [MIXED_CPU]
    # and its goldens are the named model's
    assert golden_path(GOLDEN_DIR, as_dir, "mixed-cpu", "hf", "cpu", "float32") == \
        golden_path(GOLDEN_DIR, "small", "mixed-cpu", "hf", "cpu", "float32")
    assert golden_path(GOLDEN_DIR, as_dir, "mixed-cpu", "hf", "cpu", "float32").with_suffix(".json.gz").exists()


def test_the_class_comes_from_the_config_not_the_name(tmp_path):
    disguised = tmp_path / "qwen2-small"        # a 1.5B config under the small model's name
    disguised.mkdir()
    (disguised / "config.json").write_text(json.dumps(QWEN25_1P5B))
    assert model_class(disguised) == "large"
    assert workload_for_model(str(disguised)) == "mixed-gate"
    assert model_class("qwen2.5-1.5b-random") == "large" and model_class("small-trained") == "small"
    assert 1.5e9 < parameter_count(model_config("qwen2.5-1.5b-random")) < 1.6e9


def workload_for_model(model: str) -> str:
    from gates.runs import workload_for
    return workload_for(opts_of(model=model), "mixed-cpu")


def test_a_config_that_is_not_qwen2_is_a_usage_error(gate_dir, tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = run(gate_dir, "--model", str(bad))
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([f"ERROR: --model {bad}: its config.json cannot be read as a Qwen2 config (KeyError*"])


# -- required backends on CUDA -------------------------------------------------------------------------------------
@pytest.fixture
def cuda_without_flash(monkeypatch):
    """A GPU machine (as the options see it) whose flash-attn does not import."""
    plants.cuda_without_flash(monkeypatch)


def test_on_cuda_a_backend_that_cannot_run_fails_the_run_with_the_reason(gate_dir, cuda_without_flash):
    r = run(gate_dir, "--device", "cuda")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --device cuda: every selected attention backend must run on CUDA*",
                            "  flash: flash-attn does not import: No module named 'flash_attn' (simulated)",
                            "Fix the install, or gate without them by naming the backends to run: "
                            "--backend torch,flex"])


def test_naming_the_backends_opts_out_and_cpu_still_skips(gate_dir, cuda_without_flash):
    r = run(gate_dir, "--device", "cuda", "--backend", "torch,flex")
    assert r.ret == 0, r.stdout.str() + r.stderr.str()
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*backends torch,flex (required: each must run)"])
    assert run(gate_dir, "--device", "cpu").ret == 0


def test_a_required_candidate_that_cannot_run_fails_inside_a_gate_too(cuda_without_flash):
    from gates.runs import skip_unless_runs
    with pytest.raises(pytest.fail.Exception, match="flash backend is required on cuda and cannot run: flash-attn "
                                                    "does not import"):
        skip_unless_runs(opts_of(device="cuda"), "flash", "flash")
    with pytest.raises(pytest.skip.Exception, match="flash backend cannot run here"):
        skip_unless_runs(opts_of(), "flash", "flash")


# -- a gate file that collected tests and ran none -----------------------------------------------------------------
SKIPPING = ('import pytest\n\n\n@pytest.mark.parametrize("b", ["flash", "flex"])\ndef test_skips(b):\n'
            '    pytest.skip(f"{b} cannot run here")\n')


def test_a_gate_file_whose_tests_all_skip_fails_the_run(gate_dir):
    (gate_dir.path / "gates" / "test_skipping.py").write_text(SKIPPING)
    r = run(gate_dir)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.assert_outcomes(passed=1, skipped=2)
    r.stdout.fnmatch_lines(["*stepgate: gate files that ran none of their tests*",
                            "gates/test_skipping.py: 2 collected, all skipped: flash cannot run here; flex cannot "
                            "run here",
                            "A gate file that runs nothing gates nothing, so the run fails.*--allow-skipped-files*"])
    opted_out = run(gate_dir, "--allow-skipped-files")
    assert opted_out.ret == 0
    assert "ran none of their tests" not in opted_out.stdout.str()


def test_partly_skipped_gpu_only_and_non_gate_files_pass(gate_dir):
    (gate_dir.path / "gates" / "test_partly.py").write_text(SKIPPING + "\n\ndef test_runs():\n    pass\n")
    (gate_dir.path / "gates" / "test_gpu_only.py").write_text(
        "import pytest\n\n\n@pytest.mark.gpu\ndef test_graph():\n    pytest.skip('needs CUDA')\n")
    (gate_dir.path / "tests").mkdir()
    (gate_dir.path / "tests" / "test_elsewhere.py").write_text("import pytest\n\n\ndef test_x():\n"
                                                                 "    pytest.skip('not a gate')\n")
    r = run(gate_dir)
    assert r.ret == 0, r.stdout.str()
    r.assert_outcomes(passed=2, skipped=4)
    deselected = run(gate_dir, "-m", "not gpu", "gates/test_gpu_only.py", "gates/test_one.py")
    assert deselected.ret == 0 and "1 deselected" in deselected.stdout.str()


def test_a_failing_gate_is_reported_as_itself(gate_dir):
    (gate_dir.path / "gates" / "test_one.py").write_text("def test_one():\n    assert False, 'planted'\n")
    r = run(gate_dir)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    assert "ran none of their tests" not in r.stdout.str()


# -- goldens are read-only in a plain run --------------------------------------------------------------------------
GOLDEN_WRITER = """import os
from pathlib import Path


def test_writes_back():
    p = Path("golden/m/w/hf-cpu-float32.json")
    data = p.read_bytes()
    {how}
"""
REWRITES = {
    "replace": ('tmp = p.with_suffix(".tmp"); tmp.write_bytes(data); os.replace(tmp, p)',
                "changed  m/w/hf-cpu-float32.json: replaced by a new file, same content (inode*"),
    "in-place": ("p.write_bytes(data)",
                 "changed  m/w/hf-cpu-float32.json: rewritten or its metadata touched, same content*mtime_ns*"),
    "chmod": ("p.chmod(0o600)", "changed  m/w/hf-cpu-float32.json: mode 0644 -> 0600"),
    "content": ('p.write_bytes(data + b" ")', "changed  m/w/hf-cpu-float32.json: content (10 -> 11 bytes, sha256 *"),
    "add": ('p.with_name("extra.json").write_bytes(data)', "added    m/w/extra.json"),
    "remove": ("p.unlink()", "removed  m/w/hf-cpu-float32.json"),
}


@pytest.mark.parametrize("how", REWRITES)
def test_a_plain_run_that_touches_a_golden_fails(gate_dir, how):
    golden = gate_dir.path / "golden" / "m" / "w" / "hf-cpu-float32.json"
    golden.parent.mkdir(parents=True)
    golden.write_bytes(b'{"a": [1]}')
    golden.chmod(0o644)
    (gate_dir.path / "gates" / "test_writer.py").write_text(GOLDEN_WRITER.format(how=REWRITES[how][0]))
    r = run(gate_dir)
    assert r.ret == pytest.ExitCode.TESTS_FAILED, r.stdout.str()
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["*stepgate: the run changed the goldens*",
                            "golden: goldens are read-only in a plain run, and this one changed 1 path(s):",
                            f"  {REWRITES[how][1]}",
                            "Restore them*or regenerate deliberately: --regen-golden*"])


def test_regen_golden_may_write_them(gate_dir):
    golden = gate_dir.path / "golden" / "m" / "w" / "hf-cpu-float32.json"
    golden.parent.mkdir(parents=True)
    golden.write_bytes(b'{"a": [1]}')
    (gate_dir.path / "gates" / "test_writer.py").write_text(GOLDEN_WRITER.format(how=REWRITES["replace"][0]))
    r = run(gate_dir, "--regen-golden")
    assert r.ret == 0, r.stdout.str()
    assert "changed the goldens" not in r.stdout.str()


def test_a_run_that_saves_benchmarks_may_write_their_storage_only(tmp_path):
    root = tmp_path / "golden"
    (root / "benchmarks" / "m").mkdir(parents=True)
    (root / "a.json").write_text("{}")
    before = snapshot(root, exempt=(root / "benchmarks",))
    (root / "benchmarks" / "m" / "0001_run.json").write_text("{}")
    assert differences(before, snapshot(root, exempt=(root / "benchmarks",))) == []
    (root / "a.json").write_text("{}")
    assert [d.split(":")[0] for d in differences(before, snapshot(root, exempt=(root / "benchmarks",)))] == \
        ["changed  a.json"]


def test_the_repos_goldens_snapshot_in_well_under_a_second():
    import time
    t = time.perf_counter()
    snap = snapshot(GOLDEN_DIR)
    assert any(p.endswith(".json.gz") for p in snap) and time.perf_counter() - t < 2.0


# -- cheap decisive gates first ------------------------------------------------------------------------------------
def test_gate_files_run_cheap_first_and_unknown_files_keep_their_slot():
    from gates.conftest import gate_order
    names = ["test_step_timings.py", "test_tokens.py", "test_zzz_new.py", "test_kernels.py", "test_smoke.py",
             "test_admission.py"]
    items = [types.SimpleNamespace(path=Path("gates") / n, name=f"{n}::{i}") for n in names for i in range(2)]
    items.insert(0, types.SimpleNamespace(path=Path("tests") / "test_tokens.py", name="tests"))
    got = [(i.path.parent.name, i.path.name) for i in gate_order(items)]
    files = list(dict.fromkeys(got))
    assert files == [("tests", "test_tokens.py"), ("gates", "test_smoke.py"), ("gates", "test_kernels.py"),
                     ("gates", "test_zzz_new.py"), ("gates", "test_admission.py"), ("gates", "test_tokens.py"),
                     ("gates", "test_step_timings.py")]
    assert [i.name for i in gate_order(items) if i.path.name == "test_kernels.py"] == \
        ["test_kernels.py::0", "test_kernels.py::1"]


def test_the_real_gates_collect_in_that_order_and_deselect_what_is_not_selected(pytester):
    r = pytester.runpytest_inprocess(str(REPO / "gates"), "--collect-only", "-q", "-p", "no:cacheprovider",
                                     "--rootdir", str(REPO), "--engine", "chunked,flash", "--backend", "torch")
    assert r.ret == 0, r.stdout.str()[-2000:]
    ids = [line for line in r.stdout.lines if "::" in line]
    files = list(dict.fromkeys(i.split("::")[0] for i in ids))
    assert files == ["gates/test_smoke.py", "gates/test_kernels.py", "gates/test_mlp.py", "gates/test_linear.py",
                     "gates/test_admission.py", "gates/test_tokens.py",
                     "gates/test_redo.py", "gates/test_requests.py", "gates/test_page_safety.py",
                     "gates/test_prefix_cache.py",
                     "gates/test_graphs.py", "gates/test_prefill_share.py",
                     "gates/test_step_timings.py"], files
    tokens = [i for i in ids if i.startswith("gates/test_tokens.py")]
    assert tokens and all("chunked-torch" in i for i in tokens), "only the selected candidate is collected"
    assert "deselected" in r.stdout.lines[-1]


def test_tp_gates_need_their_ranks_in_gpus():
    """On CUDA a tensor-parallel gate with more ranks than GPUs is deselected (the machine, not a broken install);
    every other gate needs one GPU."""
    from types import SimpleNamespace

    from gates.conftest import gpus_needed

    def item(*args):
        mark = None if args == ("none",) else SimpleNamespace(args=args)
        return SimpleNamespace(get_closest_marker=lambda name: mark if name == "tp_ranks" else None)

    assert gpus_needed(item("none"), SimpleNamespace(tp=1)) == 1
    assert gpus_needed(item(None), SimpleNamespace(tp=1)) == 2
    assert gpus_needed(item(None), SimpleNamespace(tp=4)) == 4
    assert gpus_needed(item(4), SimpleNamespace(tp=1)) == 4
