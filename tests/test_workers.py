"""The gates over xdist workers (gates/workers.py, gates/summary.py): each worker's device and KV budget, one summary
from the controller equal to a plain run's, serial gates left to their own run, the unrun-file check counted on the
controller, and a hung gate that fails with a trace instead of holding the runner. Inner runs use tiny synthetic gate
folders (pytester), not the real gates."""
from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch

from gates import options, summary, workers
from gates.options import GateOptions, gate_options
from gates.workers import GPU_KV_BYTES, KV_ENV, placement

REPO = Path(__file__).resolve().parent.parent
PLUGINS = 'pytest_plugins = ["gates.workers", "gates.options", "gates.snapshot", "gates.summary"]\n'
GiB = 1 << 30

# Synthetic gates: four that pass (one with an accepted flip), one that fails with a triage verdict, one skipped,
# one marked serial. Records as gates/test_tokens.py makes them (summary.record of a compare report).
GATES = '''
import time
import pytest
import torch
from gates import summary
from gates.compare import compare
from gates.records import GenRecord

def rec(tokens, ids, logits):
    return {"r": GenRecord("r", [5, 6], tokens, ids, logits, [0, 1])}

REF = rec([7, 8], [[7, 1], [8, 9]], [[3.0, 1.0], [3.0, 2.995]])
FLIP = rec([7, 9], [[7, 1], [9, 8]], [[3.0, 1.0], [3.0, 2.99]])
BAD = rec([9, 8], [[9, 7], [8, 1]], [[3.0, 1.0], [3.0, 1.0]])

def score(prompt, tokens):
    logits = torch.zeros(len(tokens), 16)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 3.0
    return logits

@pytest.mark.parametrize("i", range(3))
def test_identical(i):
    time.sleep(0.05 * i)
    assert summary.record(compare(f"identical {i}", REF, REF, score)).ok

def test_flip():
    assert summary.record(compare("flipped", REF, FLIP, score)).ok

def test_planted_failure():
    report = summary.record(compare("planted", REF, BAD, score))
    assert report.ok, "\\n".join(["gate planted failed:", *report.problems(), "verdict: only when batched with r2"])

def test_skipped():
    pytest.skip("not on this machine")

@pytest.mark.serial
def test_timing():
    pass
'''


@pytest.fixture
def gate_dir(pytester):
    pytester.makeconftest(PLUGINS)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    (pytester.path / "golden").mkdir()
    (pytester.path / "gates").mkdir()
    (pytester.path / "gates" / "test_synthetic.py").write_text(GATES)
    return pytester


def run(pytester, *args, name="serial", subprocess=False):
    """A run of the synthetic gates writing its summaries as `name`.json / `name`.md."""
    args = ("-p", "no:cacheprovider", "--golden-dir", "golden", "--gate-summary", f"{name}.json",
            "--gate-summary-md", f"{name}.md", *args)
    if subprocess:     # the plugins from this checkout, not an installed copy
        return pytester.runpytest_subprocess(*args)
    return pytester.runpytest(*args)


# -- each worker's device and KV budget ----------------------------------------------------------------------------
@pytest.mark.parametrize("device,tp,worker,workers,gpus,want", [
    ("cpu", 1, None, 0, 0, ("cpu", 1, None)),                       # a plain CPU run: the engine's default
    ("cpu", 1, 1, 2, 0, ("cpu", 1, None)),                          # CPU workers share memory, not a GPU
    ("cuda", 1, None, 0, 1, ("cuda", 1, None)),                     # a plain GPU run
    ("cuda", 1, 2, 4, 1, ("cuda", 4, GPU_KV_BYTES // 4)),           # four workers on one GPU split its budget
    ("cuda", 1, 3, 4, 2, ("cuda:1", 2, GPU_KV_BYTES // 2)),         # two GPUs: worker k on GPU k mod 2
    ("cuda", 1, 2, 4, 4, ("cuda:2", 1, None)),                      # a GPU each: the whole budget
    ("cuda:1", 1, 0, 3, 2, ("cuda:1", 3, GPU_KV_BYTES // 3)),       # a named device: every worker shares it
    ("cuda", 2, 1, 2, 2, ("cuda", 2, GPU_KV_BYTES // 2)),           # tp 2 spans the GPUs from the first: shared
])
def test_each_worker_gets_a_device_and_a_share_of_its_kv_budget(device, tp, worker, workers, gpus, want):
    p = placement(device, tp, worker, workers, gpus, env={})
    assert (p.device, p.sharers, p.kv_bytes) == want


def test_the_kv_budget_can_be_named_and_a_bad_one_is_a_usage_error():
    assert placement("cuda", 1, 0, 4, 1, env={KV_ENV: "2GiB"}).kv_bytes == 2 * GiB
    assert placement("cpu", 1, None, 0, 0, env={KV_ENV: "512M"}).kv_bytes == 512 << 20
    assert placement("cuda", 1, None, 0, 1, env={KV_ENV: str(3 * GiB)}).kv_bytes == 3 * GiB
    for bad in ("lots", "2 parsecs", "100"):
        with pytest.raises(pytest.UsageError, match=KV_ENV):
            placement("cpu", 1, None, 0, 0, env={KV_ENV: bad})


def worker_config(workerid: str, workercount: int, **given):
    values = {"--device": "cuda", "--dtype": None, "--backend": "torch", "--engine": "fused", "--golden-dir": None,
              "--tie-threshold": 0.02, "--flip-cap": 3, "--regen-golden": False, "--model": "small",
              "--allow-skipped-files": False, "--tp": 1, **given}
    return types.SimpleNamespace(stash=pytest.Stash(), getoption=values.__getitem__,
                                 workerinput={"workerid": workerid, "workercount": workercount})


def test_a_worker_on_a_machine_of_two_gpus_makes_its_gpu_current_before_any_cuda_work(monkeypatch):
    monkeypatch.delenv(KV_ENV, raising=False)
    monkeypatch.setattr(options, "cuda_devices", lambda: 2)
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    o: GateOptions = gate_options(worker_config("gw3", 4))
    assert (o.device, o.kv_bytes) == ("cuda:1", GPU_KV_BYTES // 2)
    assert current == [torch.device("cuda:1")], "a bare 'cuda' must mean the worker's own GPU"
    current.clear()
    monkeypatch.setattr(options, "cuda_devices", lambda: 1)
    o = gate_options(worker_config("gw0", 1))
    assert (o.device, o.kv_bytes) == ("cuda", None) and not current, "one worker on one GPU: as a plain run"


def test_engines_built_by_the_gates_take_the_budget(monkeypatch):
    from gates import reference
    monkeypatch.setattr(reference, "KV_BYTES", 64 << 20)
    assert reference.EngineReference("fused").config.kv_cache_bytes == 64 << 20
    assert reference.EngineReference("fused", kv_cache_bytes=32 << 20).config.kv_cache_bytes == 32 << 20


# -- one summary from the controller, as a plain run's -------------------------------------------------------------
def outcome_counts(r) -> dict:
    return {k: v for k, v in r.parseoutcomes().items() if k in ("passed", "failed", "skipped")}


def test_a_run_over_two_workers_is_summarised_as_a_plain_run(gate_dir):
    """The same gates, counts, unrun files and Markdown from the controller; the serial gate is left to its own run,
    and the header says which."""
    (gate_dir.path / "gates" / "test_nothing.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(4))\ndef test_n(i):\n    pytest.skip('no device')\n")
    plain = run(gate_dir, "-p", "no:xdist", name="plain")
    spread = run(gate_dir, "-n", "2", "-m", "not gpu", name="spread")
    assert plain.ret == spread.ret == pytest.ExitCode.TESTS_FAILED
    assert outcome_counts(plain) == {"passed": 5, "failed": 1, "skipped": 5}
    assert outcome_counts(spread) == {"passed": 4, "failed": 1, "skipped": 5}, "the serial gate is left out"
    spread.stdout.fnmatch_lines(["stepgate: 2 xdist workers on cpu (*); gates marked serial are deselected here: "
                                 "run them with pytest gates/ -m 'serial and (not gpu)' (without -n)"])
    gates = {n: json.loads((gate_dir.path / f"{n}.json").read_text()) for n in ("plain", "spread")}
    assert gates["plain"] == gates["spread"], "the same gates, in the same (collection) order"
    assert [(g["gate"], g["ok"]) for g in gates["plain"]] == [
        ("identical 0", True), ("identical 1", True), ("identical 2", True), ("flipped", True), ("planted", False)]
    assert gates["plain"][4]["test"] == "gates/test_synthetic.py::test_planted_failure"
    for r in (plain, spread):
        r.stdout.fnmatch_lines(["*stepgate gate summary*", "identical 0 *", "identical 1 *", "identical 2 *",
                                "flipped  *0  *1  *0  *1  *0  ok", "*flip site r@1: 8->9 gaps ref 0.0050 cand 0.0100",
                                "planted  *0  *0  *1  *0  *0  FAIL"])
        r.stdout.fnmatch_lines(["gates/test_nothing.py: 4 collected, all skipped: no device"])
    md = (gate_dir.path / "spread.md").read_text()
    for part in ("## stepgate gates: FAILED (1 failed, 4 passed, 5 skipped)",
                 "| planted | 0 | 0 | 1 | 0 | 0 | **FAIL** |",
                 "- flipped: flip site r@1: 8->9 gaps ref 0.0050 cand 0.0100",
                 "#### `gates/test_synthetic.py::test_planted_failure`", "```text\nAssertionError: gate planted failed:\n"
                 "r position 0: reference token 7, candidate token 9;",
                 "**triage verdict:** only when batched with r2", "### Slowest gates (10 of 10)"):
        assert part in md, f"{part!r} not in the Markdown summary:\n{md}"
    assert "test_timing" not in md and "assert False" not in md
    assert outcome_counts(run(gate_dir, "-m", "serial")) == {"passed": 1}, "without -n the serial gates run"


def test_the_markdown_summary_is_appended_to_the_github_step_summary(gate_dir, monkeypatch):
    step = gate_dir.path / "step-summary.md"
    step.write_text("# earlier steps\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    run(gate_dir, "-p", "no:xdist", "-k", "identical")
    text = step.read_text()
    assert text.startswith("# earlier steps\n## stepgate gates: passed (3 passed)"), text[:300]
    assert text.count("## stepgate gates") == 1


def test_the_json_summary_is_on_disk_after_every_gate(tmp_path):
    """A run cut short (a CI timeout) still leaves the summary of the gates it finished."""
    collector = summary.GateSummary(types.SimpleNamespace(getoption={"--gate-summary": tmp_path / "s.json",
                                                                     "--gate-summary-md": tmp_path / "s.md"}.get))
    for name, ok in (("first", True), ("second", False)):
        gate = {"gate": name, "ok": ok}
        collector.pytest_runtest_logreport(types.SimpleNamespace(
            nodeid="tests/x.py::t", user_properties=[(summary.KEY, gate)]))
        assert json.loads((tmp_path / "s.json").read_text())[-1] == gate
    assert [g["gate"] for g in json.loads((tmp_path / "s.json").read_text())] == ["first", "second"]


def test_a_summary_path_that_is_not_a_file_is_written_in_place_never_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        summary.write_json(fifo, [{"gate": "g"}])
        assert json.loads(os.read(fd, 1000)) == [{"gate": "g"}]
        assert fifo.is_fifo(), "the pipe was replaced by a file (as /dev/null would be)"
    finally:
        os.close(fd)


# -- a hung gate fails with a trace --------------------------------------------------------------------------------
HANG = "import time\n\ndef test_hangs():\n    time.sleep(300)   # a kernel that never returns\n"


def test_every_gate_has_the_default_timeout_unless_one_is_given(gate_dir):
    (gate_dir.path / "gates" / "conftest.py").write_text(
        "def pytest_collection_finish(session):\n"
        "    for item in session.items:\n"
        "        m = item.get_closest_marker('timeout')\n"
        "        print('TIMEOUT', item.name, m.args, m.kwargs)\n")
    r = run(gate_dir, "--collect-only", "-s", "-k", "identical and 0")
    r.stdout.fnmatch_lines([f"stepgate: every gate times out after {workers.GATE_TIMEOUT_S['cpu']} s (thread method*",
                            f"TIMEOUT test_identical[0] ({workers.GATE_TIMEOUT_S['cpu']},) {{'method': 'thread'}}"])
    r = run(gate_dir, "--collect-only", "-q", "-s", "-k", "identical and 0", "--timeout", "7")
    r.stdout.fnmatch_lines(["TIMEOUT test_identical[0] (7.0,) {'method': 'thread'}"])


def test_a_hung_gate_fails_with_every_threads_stack_and_the_summary_says_where(gate_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    (gate_dir.path / "gates" / "test_hang.py").write_text(HANG)
    r = run(gate_dir, "gates/test_hang.py", "gates/test_synthetic.py", "-k", "hang or identical", "-p", "no:xdist",
            "--timeout", "2", name="hung", subprocess=True)
    assert r.ret != 0
    assert_hung(r.stderr.str(), (gate_dir.path / "hung.md").read_text(), passed=0)


def test_a_hung_gate_under_xdist_fails_and_the_controller_goes_on_and_summarises(gate_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    (gate_dir.path / "gates" / "test_hang.py").write_text(HANG)
    r = run(gate_dir, "gates/test_hang.py", "gates/test_synthetic.py", "-k", "hang or identical", "-n", "1",
            "--timeout", "3", name="hung", subprocess=True)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*worker 'gw*' crashed while running 'gates/test_hang.py::test_hangs'*"])
    assert_hung(r.stderr.str(), (gate_dir.path / "hung.md").read_text(), passed=3)


def assert_hung(stderr: str, md: str, passed: int) -> None:
    """The stacks on stderr (where an xdist worker's reach the log), and in the Markdown where it hung."""
    for part in ("+++ Timeout: gates/test_hang.py::test_hangs ran past", "Stack of MainThread",
                 "time.sleep(300)   # a kernel that never returns"):
        assert part in stderr, f"{part!r} missing from stderr:\n{stderr[-3000:]}"
    assert "#### `gates/test_hang.py::test_hangs` (timeout)" in md, md
    assert "time.sleep(300)   # a kernel that never returns" in md, md
    assert f"1 failed, {passed} passed" in md if passed else "(1 failed)" in md, md
