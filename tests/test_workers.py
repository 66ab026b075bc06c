"""The gates over xdist workers (gates/workers.py, gates/summary.py): each worker's GPU and KV budget (GPUs
simulated), one summary from the controller equal to a plain run's, serial gates left to their own run, the unrun-file
and golden checks on the controller, and a hung gate that fails with a trace instead of holding the runner. Inner runs use tiny synthetic gate
folders (pytester), not the real gates."""
from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path

import pytest

from engine.config import KV_CACHE_BYTES
from gates import durations, options, summary, workers
from gates.workers import KV_ENV, placement

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

REWRITE = """
from pathlib import Path

def test_rewrites_a_golden():     # the same bytes, written again: the guard sees the write
    golden = Path("golden/g.json")
    golden.write_bytes(golden.read_bytes())
"""


@pytest.fixture
def gate_dir(gate_folder):
    return gate_folder(PLUGINS, **{"test_synthetic.py": GATES})


def run(pytester, *args, name="serial", subprocess=False):
    """A run of the synthetic gates writing its summaries as `name`.json / `name`.md."""
    args = ("-p", "no:cacheprovider", "--golden-dir", "golden", "--gate-summary", f"{name}.json",
            "--gate-summary-md", f"{name}.md", *args)
    if subprocess:     # the plugins from this checkout, not an installed copy
        return pytester.runpytest_subprocess(*args)
    return pytester.runpytest(*args)


# -- each worker's device and KV budget ----------------------------------------------------------------------------
GPU = KV_CACHE_BYTES["cuda"]


@pytest.mark.parametrize("device,tp,worker,workers,gpus,want", [
    ("cpu", 1, None, 0, 0, (None, 1, None)),                        # a plain CPU run: the engine's default
    ("cpu", 1, 1, 2, 0, (None, 1, None)),                           # CPU workers share memory, not a GPU
    ("cuda", 1, None, 0, 1, (None, 1, None)),                       # a plain GPU run
    ("cuda", 1, 2, 4, 1, (None, 4, GPU // 4)),                      # four workers on one GPU split its budget
    ("cuda", 1, 3, 4, 2, ("1", 2, GPU // 2)),                       # two GPUs: worker k on GPU k mod 2
    ("cuda", 1, 2, 4, 4, ("2", 1, None)),                           # a GPU each: the whole budget
    ("cuda", 1, 4, 5, 4, ("0", 2, GPU // 2)),                       # five on four: GPU 0 has two
    ("cuda:1", 1, 0, 3, 2, (None, 3, GPU // 3)),                    # a named device: every worker shares it
    ("cuda", 2, 1, 2, 2, (None, 2, GPU // 2)),                      # tp 2 spans the GPUs from the first: shared
])
def test_each_worker_gets_a_gpu_and_a_share_of_its_kv_budget(device, tp, worker, workers, gpus, want):
    p = placement(device, tp, worker, workers, gpus, env={})
    assert (p.visible, p.sharers, p.kv_bytes) == want
    assert p.device == device, "a worker names its device as the run does: the mask makes its GPU cuda:0"


def test_a_worker_gets_its_gpu_by_the_controllers_own_mask():
    env = {"CUDA_VISIBLE_DEVICES": "5, 7"}
    assert [placement("cuda", 1, w, 4, 2, env=env).visible for w in range(4)] == ["5", "7", "5", "7"]


def test_the_kv_budget_can_be_named_and_a_bad_one_is_a_usage_error():
    assert placement("cuda", 1, 0, 4, 1, env={KV_ENV: "2GiB"}).kv_bytes == 2 * GiB
    assert placement("cpu", 1, None, 0, 0, env={KV_ENV: "512M"}).kv_bytes == 512 << 20
    assert placement("cuda", 1, None, 0, 1, env={KV_ENV: str(3 * GiB)}).kv_bytes == 3 * GiB
    for bad in ("lots", "2 parsecs", "100"):
        with pytest.raises(pytest.UsageError, match=KV_ENV):
            placement("cpu", 1, None, 0, 0, env={KV_ENV: bad})


# Simulated GPUs for a CPU run over workers: as many as CUDA_VISIBLE_DEVICES names, --device cuda
# accepted, the backends' CUDA check left out. Each gate writes where it ran and what its engines may take.
FAKE_GPUS = """
import os
import pytest
from gates import options

def fake_gpus():
    return len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))

FAKE = pytest.MonkeyPatch()     # an inline run's controller is the test's own process: undone when it ends
FAKE.setattr(options, "cuda_devices", fake_gpus)
FAKE.setattr(options, "check_required_backends", lambda opts: None)

def pytest_unconfigure(config):
    FAKE.undo()
"""
WHERE = """
import json, os
import pytest
from gates import reference
from gates.options import gate_options

@pytest.mark.parametrize("i", range(8))
def test_where(request, i):
    o = gate_options(request.config)
    seen = dict(worker=os.environ["PYTEST_XDIST_WORKER"], visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                gpus=options_gpus(), device=o.device, kv=o.kv_bytes, engines_kv=reference.KV_BYTES)
    with open(f"where-{seen['worker']}.jsonl", "a") as f:
        f.write(json.dumps(seen) + "\\n")

def options_gpus():
    from gates import options
    return options.cuda_devices()
"""


def where_workers_ran(pytester, *args) -> dict:
    r = run(pytester, "gates/test_where.py", "--device", "cuda", *args)
    assert r.ret == pytest.ExitCode.OK, r.stdout.str()[-3000:]
    seen = {}
    for path in pytester.path.glob("where-gw*.jsonl"):
        rows = {json.dumps(row, sort_keys=True) for row in map(json.loads, path.read_text().splitlines())}
        assert len(rows) == 1, f"one worker, one placement: {rows}"
        row = json.loads(rows.pop())
        seen[row.pop("worker")] = row
    return seen


@pytest.mark.parametrize("nodeid,group", [
    ("gates/test_smoke.py::test_smoke[chunked-torch]", "chunked-torch"),
    ("gates/test_page_safety.py::test_tiny_pool[fused-flex-256]", "fused-flex"),
    ("gates/test_tokens.py::test_against_hf[fused-torch-mixed-cpu]", "fused-torch"),    # not fused-flex's
    ("gates/test_step_timings.py::test_step_time[cuda-small-trained-flash-flash-pure-decode]", "flash-flash"),
    ("gates/test_kernels.py::test_kernel_gate[flex-prefill-h4kv2d64-p64-bf16-edges]", "kernels-flex-prefill"),
    ("gates/test_kernels.py::test_decode_kernels_agree[torch]", "kernels-torch"),
    ("gates/test_admission.py::TestAdmissionPage64::runTest", "test_admission"),
    ("gates/test_prefill_share.py::test_cancellation_leaves_the_others_identical[0.5]", "test_prefill_share"),
])
def test_a_gate_joins_the_work_unit_of_its_engine_configuration(nodeid, group):
    assert workers.worker_group(nodeid) == group


GROUPED = """
import os
import pytest

@pytest.mark.parametrize("cfg", ["chunked-torch-64", "fused-torch-64", "fused-flex-64", "flash-flash-256"])
@pytest.mark.parametrize("gate", ["smoke", "tokens", "tiny_pool"])
def test_gate(gate, cfg):
    with open(f"ran-{os.environ['PYTEST_XDIST_WORKER']}.txt", "a") as f:
        f.write(cfg.rsplit("-", 1)[0] + "\\n")
"""


def test_minus_n_alone_keeps_an_engine_configurations_gates_on_one_worker(gate_dir):
    """So its memoised runs are made once per run: with xdist's default (load) they were made on every worker that
    drew one of its gates (seen on the H200: 75 s with -n 4 before, docs/RESULTS.md for after)."""
    (gate_dir.path / "gates" / "test_grouped.py").write_text(GROUPED)
    r = run(gate_dir, "gates/test_grouped.py", "-n", "3", subprocess=True)
    assert r.ret == pytest.ExitCode.OK, r.stdout.str()[-3000:]
    where = {}
    for path in gate_dir.path.glob("ran-gw*.txt"):
        for cfg in path.read_text().split():
            where.setdefault(cfg, set()).add(path.stem)
    assert sorted(where) == ["chunked-torch", "flash-flash", "fused-flex", "fused-torch"]
    assert all(len(w) == 1 for w in where.values()), where


def test_units_go_longest_first_by_their_summed_seconds():
    units = {"chunked-torch": ["a::x[chunked-torch]", "b::x[chunked-torch]"], "b": ["b::z"],
             "fused-flex": ["a::y[fused-flex]", "b::y[fused-flex]"], "c": ["c::new"]}
    seconds = {"a::x[chunked-torch]": 1.0, "b::x[chunked-torch]": 2.0, "b::z": 4.0, "a::y[fused-flex]": 5.0,
               "b::y[fused-flex]": 6.0}                                  # c::new unknown: the mean, 3.6
    assert durations.longest_first(units, seconds) == ["fused-flex", "b", "c", "chunked-torch"]
    assert durations.longest_first(units, {}) == ["chunked-torch", "fused-flex", "b", "c"]    # nothing known: by gates


def test_minus_n_starts_the_longest_units_first_by_the_committed_durations(gate_dir):
    """The planted order: the durations name flash-flash, then fused-flex, the longest units (by default
    chunked-torch's gates come first); with -n 2 each worker's first gate is of one of those two."""
    (gate_dir.path / "gates" / "test_grouped.py").write_text(GROUPED)
    ids = [f"gates/test_grouped.py::test_gate[{g}-{c}]" for g in ("smoke", "tokens", "tiny_pool")
           for c in ("chunked-torch-64", "fused-torch-64", "fused-flex-64", "flash-flash-256")]
    (gate_dir.path / ".test_durations").write_text(json.dumps(
        {n: 30.0 if "flash-flash" in n else 20.0 if "fused-flex" in n else 1.0 for n in ids}))
    r = run(gate_dir, "gates/test_grouped.py", "-n", "2", subprocess=True)
    assert r.ret == pytest.ExitCode.OK, r.stdout.str()[-3000:]
    ran = {path.stem: path.read_text().split() for path in gate_dir.path.glob("ran-gw*.txt")}
    assert sorted(cfgs[0] for cfgs in ran.values()) == ["flash-flash", "fused-flex"], ran
    assert sorted(c for cfgs in ran.values() for c in cfgs) == sorted(c.rsplit("-", 1)[0] for c in
                                                                        [i.split("-", 1)[1][:-1] for i in ids])


def test_finer_work_units_split_a_configuration_by_file(gate_dir):
    """--work-units configuration-file: a configuration's gates of one file stay on one worker, and its files can
    go to different workers (the two units of each configuration here)."""
    assert workers.worker_group("gates/test_smoke.py::test_smoke[chunked-torch]", True) == "chunked-torch/test_smoke"
    assert workers.worker_group("gates/test_admission.py::TestAdmissionPage64::runTest", True) == "test_admission"
    for name in ("test_one", "test_two"):
        (gate_dir.path / "gates" / f"{name}.py").write_text(GROUPED.replace('cfg.rsplit("-", 1)[0]',
                                                                             f'cfg.rsplit("-", 1)[0] + "/{name}"'))
    r = run(gate_dir, "gates/test_one.py", "gates/test_two.py", "-n", "3", "--work-units", "configuration-file",
            subprocess=True)
    assert r.ret == pytest.ExitCode.OK, r.stdout.str()[-3000:]
    where = {}
    for path in gate_dir.path.glob("ran-gw*.txt"):
        for unit in path.read_text().split():
            where.setdefault(unit, set()).add(path.stem)
    assert len(where) == 8 and all(len(w) == 1 for w in where.values()), where
    assert len(set().union(*where.values())) > 1, where


def test_three_workers_on_two_gpus_see_one_each_and_the_pair_on_one_gpu_split_its_kv_budget(gate_dir, monkeypatch):
    """The controller's own mask names the GPUs (7 and 5 here): each worker sees only its own."""
    monkeypatch.delenv(KV_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,5")
    gate_dir.makeconftest(PLUGINS + FAKE_GPUS)
    (gate_dir.path / "gates" / "test_where.py").write_text(WHERE)
    seen = where_workers_ran(gate_dir, "-n", "3", "--dist", "each")
    assert seen == {"gw0": dict(visible="7", gpus=1, device="cuda", kv=GPU // 2, engines_kv=GPU // 2),
                    "gw1": dict(visible="5", gpus=1, device="cuda", kv=None, engines_kv=None),
                    "gw2": dict(visible="7", gpus=1, device="cuda", kv=GPU // 2, engines_kv=GPU // 2)}


def test_a_worker_whose_cuda_started_before_its_mask_stops_the_run(monkeypatch):
    """CUDA reads the mask once: a worker that still sees every GPU would gate on GPU 0 with all the others."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(options, "cuda_devices", lambda: 2)          # the mask came too late: both still seen
    with pytest.raises(pytest.UsageError, match=r"CUDA_VISIBLE_DEVICES=1 set too late .* sees 2 GPUs"):
        workers.see_only("1")
    monkeypatch.setattr(options, "cuda_devices", lambda: 1)
    workers.see_only("1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


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
    (gate_dir.path / "gates" / "test_rewrite.py").write_text(REWRITE)
    (gate_dir.path / "golden" / "g.json").write_text("{}\n")
    plain = run(gate_dir, "-p", "no:xdist", name="plain")
    spread = run(gate_dir, "-n", "2", "-m", "not gpu", name="spread")
    assert plain.ret == spread.ret == pytest.ExitCode.TESTS_FAILED
    assert outcome_counts(plain) == {"passed": 6, "failed": 1, "skipped": 5}
    assert outcome_counts(spread) == {"passed": 5, "failed": 1, "skipped": 5}, "the serial gate is left out"
    spread.stdout.fnmatch_lines(["stepgate: 2 xdist workers on cpu (*); gates marked serial are deselected here: "
                                 "run them with pytest gates/ -m 'serial and (not gpu)' (without -n)"])
    spread.stdout.fnmatch_lines(["stepgate: 1 gate(s) marked serial were deselected under xdist: run them with "
                                 "pytest gates/ -m 'serial and (not gpu)' (without -n)"])
    for r in (plain, spread):       # a worker's write is seen by the controller's snapshot
        r.stdout.fnmatch_lines(["*stepgate: the run changed the goldens*", "*changed  g.json: rewritten*"])
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
    for part in ("## stepgate gates: FAILED (1 failed, 5 passed, 5 skipped)",
                 "1 gate(s) marked serial were deselected under xdist: run them with pytest gates/ -m",
                 "| planted | 0 | 0 | 1 | 0 | 0 | **FAIL** |",
                 "- flipped: flip site r@1: 8->9 gaps ref 0.0050 cand 0.0100",
                 "#### `gates/test_synthetic.py::test_planted_failure`", "```text\nAssertionError: gate planted failed:\n"
                 "r position 0: reference token 7, candidate token 9;",
                 "**triage verdict:** only when batched with r2", "### Slowest gates (10 of 11)",
                 "### Time by gate file", "| `gates/test_synthetic.py` | 6 |", "| `gates/test_nothing.py` | 4 |"):
        assert part in md, f"{part!r} not in the Markdown summary:\n{md}"
    assert "test_timing" not in md and "assert False" not in md
    workers_table = re.findall(r"^\| (gw\d) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", md, re.M)
    assert sorted(w[0] for w in workers_table) == ["gw0", "gw1"], md
    assert sum(int(w[1]) for w in workers_table) == 11, "every gate run is some worker's"
    assert all(float(first) <= float(last) for _, _, _, first, last, _ in workers_table)
    # each worker's work units (here one per file), the largest first, adding up to its busy time
    units_table = dict(re.findall(r"^\| (gw\d) \| ([^|]+) \|$", md, re.M))
    assert sorted(units_table) == ["gw0", "gw1"], md
    units = {w: re.findall(r"(\S+) ([\d.]+)", cells) for w, cells in units_table.items()}
    assert sorted(u for cells in units.values() for u, _ in cells) == ["test_nothing", "test_rewrite",
                                                                        "test_synthetic"], units
    for wid, _, busy, *_ in workers_table:
        seconds = [float(b) for _, b in units[wid]]
        assert seconds == sorted(seconds, reverse=True) and abs(sum(seconds) - float(busy)) <= 0.1, (wid, busy, units)
    spread.stdout.fnmatch_lines(["workers (gates, busy s, first gate began at s): gw0 */*/*, gw1 */*/*"])
    assert "### Workers" not in (gate_dir.path / "plain.md").read_text(), "a plain run has no workers"
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
    (gate_dir.path / "gates" / "test_own.py").write_text(
        "import pytest\n\n@pytest.mark.timeout(5)\ndef test_own_timeout():\n    pass\n")
    cpu = workers.GATE_TIMEOUT_S["cpu"]
    r = run(gate_dir, "--collect-only", "-s", "-k", "identical and 0 or own")
    r.stdout.fnmatch_lines([f"stepgate: every gate times out after {cpu} s (thread method*",
                            "TIMEOUT test_own_timeout (5,) {}",           # its own, kept
                            f"TIMEOUT test_identical[0] ({cpu},) {{'method': 'thread'}}"])
    r = run(gate_dir, "--collect-only", "-q", "-s", "-k", "identical and 0 or own", "--timeout", "7")
    r.stdout.fnmatch_lines(["TIMEOUT test_own_timeout (5,) {}",
                            "TIMEOUT test_identical[0] (7.0,) {'method': 'thread'}"])


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


def test_a_gate_that_crashed_its_worker_is_not_run_again_and_its_work_unit_goes_on(gate_dir, monkeypatch):
    """The hung gate and the gate after it share a work unit (one file): the replacement worker runs the rest of the
    unit, not the hung gate again (xdist's LoadScope would queue it again, and every replacement would hang)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    (gate_dir.path / "gates" / "test_hang.py").write_text(HANG + "\n\ndef test_after():\n    pass\n")
    r = run(gate_dir, "gates/test_hang.py", "-n", "1", "--timeout", "3", name="hung", subprocess=True)
    assert r.ret == pytest.ExitCode.TESTS_FAILED, r.stdout.str()[-3000:]
    out = r.stdout.str()
    # one crash, one replacement (xdist's own LoadScope: five of each, then the run gives up), and the unit's other
    # gate ran on the replacement
    assert out.count("node down:") == 1 and out.count("replacing crashed worker") <= 1, out[-3000:]
    assert "1 failed, 1 passed" in out, out[-3000:]


def test_each_worker_takes_its_share_of_the_compile_processes(monkeypatch):
    """-n 4 on 16 cores: 4 compile processes a worker, started by the first compile job rather than the first
    compile (a warm cache needs none); the user's own settings are kept."""
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 16)
    env = {}
    assert workers.share_compile_threads(4, env) == 4
    assert env == {"TORCHINDUCTOR_COMPILE_THREADS": "4", "TORCH_WARM_POOL": "0"}
    assert workers.share_compile_threads(32, {}) == 1, "never below one"
    mine = {"TORCHINDUCTOR_COMPILE_THREADS": "12", "TORCH_WARM_POOL": "1"}
    assert workers.share_compile_threads(4, mine) == 12 and mine["TORCH_WARM_POOL"] == "1"


def test_each_worker_takes_its_share_of_torchs_threads(monkeypatch):
    """-n 4 on 16 cores: 4 intra-op threads a worker, never below one; OMP_NUM_THREADS set by the user is kept."""
    import torch
    before = torch.get_num_threads()
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 16)
    try:
        assert workers.share_intra_op_threads(4, {}) == 4 and torch.get_num_threads() == 4
        assert workers.share_intra_op_threads(32, {}) == 1 and torch.get_num_threads() == 1
        assert workers.share_intra_op_threads(4, {"OMP_NUM_THREADS": "8"}) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_each_process_of_a_run_profiles_itself_where_asked(gate_dir, monkeypatch, tmp_path):
    """STEPGATE_PROFILE_DIR: a cProfile of every worker and of the controller, readable by pstats, with the gates
    each ran in it."""
    import pstats
    monkeypatch.setenv(workers.PROFILE_ENV, str(tmp_path / "prof"))
    r = run(gate_dir, "-n", "2", "-k", "identical", subprocess=True)
    assert r.ret == 0, r.stdout.str()[-2000:]
    files = sorted(f.name for f in (tmp_path / "prof").iterdir())
    assert files == ["controller.prof", "gw0.prof", "gw1.prof"], files
    ran = [any(fn[2] == "test_identical" for fn in pstats.Stats(str(tmp_path / "prof" / f)).stats)
           for f in ("gw0.prof", "gw1.prof")]
    assert any(ran), "no worker's profile holds the gates it ran"


def test_a_workers_many_work_units_are_cut_to_the_largest_and_the_rest_summed():
    run = summary.Run()
    run.workers["gw0"] = summary.Span(units={f"u{i}": float(i) for i in range(1, 9)})
    run.workers["gw1"] = summary.Span(units={"flash-flash": 40.0})
    assert run.unit_rows(shown=3) == [("gw0", "u8 8.0, u7 7.0, u6 6.0, 5 more 15.0"), ("gw1", "flash-flash 40.0")]


def test_order_as_given_keeps_the_command_lines_order():
    """--order-as-given (a mutation suite's first gates are those likeliest to fail for its module): the files and
    node ids run in the order named; without it the gates' own order puts the smoke gate first."""
    import subprocess
    import sys
    args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
            "gates/test_redo.py", "gates/test_smoke.py::test_smoke"]

    def files(extra):
        out = subprocess.run(args + extra, cwd=REPO, capture_output=True, text=True, timeout=300).stdout
        return list(dict.fromkeys(line.split("::")[0] for line in out.splitlines() if "::" in line))
    assert files([]) == ["gates/test_smoke.py", "gates/test_redo.py"]
    assert files(["--order-as-given"]) == ["gates/test_redo.py", "gates/test_smoke.py"]
