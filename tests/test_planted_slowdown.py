"""A planted slowdown is caught: by the alert report (two synthetic pytest-benchmark JSONs; the report also fails on
a benchmark the current run lacks and refuses runs of other machines or engine configurations), by pytest-benchmark's
own compare against a stored baseline (the step-timing benchmarks run twice in a subprocess, the second time with a
sleep planted inside the timed step), and by the fused-vs-chunked ratio gate (the fused step planted slower)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gates import alert
from tests.child import child_env

REPO = Path(__file__).resolve().parent.parent


# -- (a) the alert report ------------------------------------------------------------------------------------------
MACHINE = {"node": "synthetic", "processor": "x86_64", "machine": "x86_64",
           "cpu": {"brand_raw": "Intel(R) Xeon(R) Processor", "count": 16}}
CONFIG = {"model": "small", "engine": "fused", "device": "cpu", "dtype": "float32", "backend": "torch",
          "page_size": 64, "chunk_history": 128, "rows": 32}


def bench_json(medians: dict[str, float], tokens_per_s: dict[str, float] | None = None, machine: dict | None = None,
               extra: dict[str, dict] | None = None) -> dict:
    """A minimal pytest-benchmark JSON: one benchmark per name, with the given median (seconds); `machine` updates
    machine_info, `extra` a benchmark's extra_info (by name) over CONFIG."""
    out = []
    for name, m in medians.items():
        b = {"group": "step", "name": name, "fullname": f"gates/test_step_timings.py::{name}", "params": None,
             "stats": {"min": m * 0.9, "max": m * 1.2, "mean": m * 1.02, "stddev": m * 0.05, "median": m,
                       "rounds": 5, "iterations": 1, "ops": 1 / (m * 1.02)},
             "extra_info": {**CONFIG, **(extra or {}).get(name, {})}}
        if tokens_per_s and name in tokens_per_s:
            b["extra_info"]["tokens_per_s"] = tokens_per_s[name]
        out.append(b)
    return {"machine_info": {**MACHINE, **(machine or {})}, "commit_info": {}, "benchmarks": out,
            "datetime": "2026-01-01T00:00:00", "version": "5.2.3"}


BASE = {"test_step_time[cpu-small-fused-loaded]": 0.200, "test_step_time[cpu-small-fused-pure-decode]": 0.100,
        "test_step_time[cpu-small-chunked-loaded]": 0.250}


def write(tmp_path: Path, name: str, data: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def test_alert_names_a_planted_regression_and_fails(tmp_path, capsys):
    slow = dict(BASE)
    slow["test_step_time[cpu-small-fused-loaded]"] *= 1.5          # the planted slowdown
    slow["test_step_time[cpu-small-chunked-loaded]"] *= 0.95       # noise within threshold
    base = write(tmp_path, "0001_base.json", bench_json(BASE))
    cur = write(tmp_path, "0002_cur.json", bench_json(slow))
    md = tmp_path / "summary.md"
    rc = alert.main(["--baseline", str(base), "--current", str(cur), "--markdown", str(md)])
    out = capsys.readouterr().out
    assert rc == 1, out
    lines = [ln for ln in out.splitlines() if "REGRESSION" in ln]
    assert len(lines) == 1 and "cpu-small-fused-loaded" in lines[0] and "1.50x" in lines[0], out
    assert "1 regression(s): gates/test_step_timings.py::test_step_time[cpu-small-fused-loaded]" in out
    text = md.read_text()
    assert "**REGRESSION**" in text and "cpu-small-fused-loaded" in text and "| benchmark |" in text


def test_alert_passes_within_threshold(tmp_path, capsys):
    near = {k: v * 1.15 for k, v in BASE.items()}                  # 15% slower: under the 1.2x rule
    base = write(tmp_path, "0001_base.json", bench_json(BASE))
    cur = write(tmp_path, "0002_cur.json", bench_json(near))
    assert alert.main(["--baseline", str(base), "--current", str(cur)]) == 0
    out = capsys.readouterr().out
    assert "REGRESSION" not in out and "no regression" in out
    # the threshold is an option: at 1.1x the same run regresses
    assert alert.main(["--baseline", str(base), "--current", str(cur), "--latency-threshold", "1.1"]) == 1


def test_alert_throughput_rule(tmp_path, capsys):
    name = "test_step_time[cpu-small-fused-loaded]"
    base = write(tmp_path, "0001_base.json", bench_json({name: 0.2}, {name: 1000.0}))
    cur = write(tmp_path, "0002_cur.json", bench_json({name: 0.2}, {name: 700.0}))   # latency same, 0.7x tokens/s
    assert alert.main(["--baseline", str(base), "--current", str(cur)]) == 1
    out = capsys.readouterr().out
    assert any("tokens_per_s" in ln and "REGRESSION" in ln for ln in out.splitlines()), out


def alert_run(tmp_path, capsys, base: dict, cur: dict, *flags: str) -> tuple[int, str, str]:
    b, c = write(tmp_path, "0001_base.json", base), write(tmp_path, "0002_cur.json", cur)
    rc = alert.main(["--baseline", str(b), "--current", str(c), *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_alert_fails_when_the_current_run_lacks_a_baseline_benchmark(tmp_path, capsys):
    """A skipped or deselected benchmark is unmeasured, not unchanged: missing fails by default, --allow-missing
    makes it a warning; a benchmark new in the current run is listed, never a failure."""
    gone = "test_step_time[cpu-small-chunked-loaded]"
    added = "test_step_time[cpu-small-flash-loaded]"
    cur = {k: v for k, v in BASE.items() if k != gone} | {added: 0.1}
    md = tmp_path / "summary.md"
    rc, out, _ = alert_run(tmp_path, capsys, bench_json(BASE), bench_json(cur), "--markdown", str(md))
    assert rc == 1, out
    fail = (f"FAIL: 1 benchmark(s) of the baseline missing from the current run: gates/test_step_timings.py::{gone} "
            "(unmeasured is not unchanged; --allow-missing to accept)")
    assert "no regression" in out and fail in out, out
    assert f"1 new benchmark(s), no baseline: gates/test_step_timings.py::{added}" in out
    assert fail in md.read_text()
    rc, out, _ = alert_run(tmp_path, capsys, bench_json(BASE), bench_json(cur), "--allow-missing")
    assert rc == 0 and f"warning: 1 benchmark(s) of the baseline missing from the current run: " in out, out
    rc, out, _ = alert_run(tmp_path, capsys, bench_json(BASE), bench_json({**BASE, added: 0.1}))
    assert rc == 0 and "missing" not in out and "1 new benchmark(s)" in out, out


def test_alert_fails_when_a_benchmark_lost_its_throughput(tmp_path, capsys):
    name = "test_step_time[cpu-small-fused-loaded]"
    rc, out, _ = alert_run(tmp_path, capsys, bench_json({name: 0.2}, {name: 1000.0}), bench_json({name: 0.2}))
    assert rc == 1 and f"missing from the current run: gates/test_step_timings.py::{name} [tokens_per_s]" in out, out


@pytest.mark.parametrize("machine,named", [
    ({"cpu": {"brand_raw": "AMD EPYC 9654"}}, "cpu 'Intel(R) Xeon(R) Processor' -> 'AMD EPYC 9654'"),
    ({"node": "runner-7"}, "node 'synthetic' -> 'runner-7'"),
    ({"gpu": "NVIDIA H100 80GB HBM3"}, "gpu 'NVIDIA H200' -> 'NVIDIA H100 80GB HBM3'")])
def test_alert_refuses_runs_of_different_machines(tmp_path, capsys, machine, named):
    slow = {k: v * 1.5 for k, v in BASE.items()}        # a regression is not judged across machines either
    base = bench_json(BASE, machine={"gpu": "NVIDIA H200"})
    rc, out, err = alert_run(tmp_path, capsys, base, bench_json(slow, machine={"gpu": "NVIDIA H200", **machine}))
    assert rc == 2 and not out, out
    assert "refusing to compare" in err and "different machines (baseline -> current): " + named in err, err
    assert "pass --allow-different-machines to compare anyway" in err
    rc, out, err = alert_run(tmp_path, capsys, base, bench_json(slow, machine={"gpu": "NVIDIA H200", **machine}),
                             "--allow-different-machines")
    assert rc == 1 and "warning: different machines (baseline -> current): " + named in out, out


def test_alert_reads_a_gpu_name_recorded_in_extra_info(tmp_path, capsys):
    name = "test_step_time[cpu-small-fused-loaded]"
    rc, _, err = alert_run(tmp_path, capsys, bench_json({name: 0.2}, extra={name: {"gpu_name": "NVIDIA H200"}}),
                           bench_json({name: 0.2}, extra={name: {"gpu_name": "NVIDIA A100"}}))
    assert rc == 2 and "gpu 'NVIDIA H200' -> 'NVIDIA A100'" in err, err


def test_alert_refuses_runs_of_different_engine_configurations(tmp_path, capsys):
    name = "test_step_time[cpu-small-fused-loaded]"
    other = {name: {"dtype": "bfloat16", "chunk_history": 512}}
    rc, out, err = alert_run(tmp_path, capsys, bench_json(BASE), bench_json(BASE, extra=other))
    assert rc == 2 and not out, out
    assert (f"different engine configurations (baseline -> current): gates/test_step_timings.py::{name}: "
            "chunk_history 128 -> 512, dtype 'float32' -> 'bfloat16'; pass --allow-different-config") in err, err
    rc, out, _ = alert_run(tmp_path, capsys, bench_json(BASE), bench_json(BASE, extra=other),
                           "--allow-different-config")
    assert rc == 0 and "warning: different engine configurations" in out and "no regression" in out, out


def test_alert_cli_defaults_to_newest_two_runs(tmp_path):
    """`python -m gates.alert --storage DIR`: the newest two runs of one machine's folder, as pytest-benchmark
    saves them (NNNN_*.json), passing over a folder of one run (another machine's first baseline); a missing input,
    or only one run, exits 2."""
    machine = tmp_path / "Linux-CPython-3.11-64bit"
    machine.mkdir()
    write(machine, "0001_aaa.json", bench_json(BASE))
    time.sleep(0.01)
    slow = {k: v * 1.5 for k, v in BASE.items()}
    write(machine, "0002_bbb.json", bench_json(slow))
    env = child_env(PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "gates.alert", "--storage", f"file://{tmp_path}"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "0002_bbb.json against baseline" in p.stdout and p.stdout.count("REGRESSION") >= 3
    # another machine's first baseline, saved later (golden/benchmarks/h100 beside h200): one run, nothing to compare
    first = tmp_path / "h100" / "Linux-CPython-3.12-64bit"
    first.mkdir(parents=True)
    time.sleep(0.01)
    write(first, "0001_ccc.json", bench_json(BASE))
    p = subprocess.run([sys.executable, "-m", "gates.alert", "--storage", f"file://{tmp_path}"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "0002_bbb.json against baseline" in p.stdout, p.stdout + p.stderr
    alone = tmp_path / "h100"
    p = subprocess.run([sys.executable, "-m", "gates.alert", "--storage", str(alone)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "holds one saved run (0001_ccc.json)" in p.stderr, p.stdout + p.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    p = subprocess.run([sys.executable, "-m", "gates.alert", "--storage", str(empty)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no pytest-benchmark JSON" in p.stderr


# -- (b) pytest-benchmark's compare against a stored baseline ------------------------------------------------------
CASE = "cpu-small-fused-chunk-only"     # the smallest step: needs no decoding rows, only the cached first chunk


def run_bench(storage: Path, *extra: str, plant_ms: float = 0.0) -> subprocess.CompletedProcess:
    env = child_env(STEPGATE_BENCH_ROUNDS="3", PYTHONPATH=str(REPO))
    env.pop("STEPGATE_PLANT_SLOWDOWN_MS", None)
    if plant_ms:
        env["STEPGATE_PLANT_SLOWDOWN_MS"] = str(plant_ms)
    cmd = [sys.executable, "-m", "pytest", "gates/test_step_timings.py", "-k", f"test_step_time and {CASE}",
           "-q", "-p", "no:cacheprovider", "--device", "cpu", f"--benchmark-storage=file://{storage}",
           f"--gate-summary={storage.parent / 'gate-summary.json'}", "--benchmark-autosave", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_planted_sleep_in_the_timed_step_fails_benchmark_compare(tmp_path):
    storage = tmp_path / "benchmarks"
    first = run_bench(storage)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "1 passed" in first.stdout, first.stdout[-3000:]
    saved = list(storage.rglob("*.json"))
    assert len(saved) == 1, saved
    median = max(b["stats"]["median"] for b in json.loads(saved[0].read_text())["benchmarks"])
    plant = max(300.0, 2000.0 * median)                 # ms: far beyond the baseline's noise
    second = run_bench(storage, "--benchmark-compare", "--benchmark-compare-fail=median:10%", plant_ms=plant)
    out = second.stdout + second.stderr
    assert second.returncode != 0, f"a {plant:.0f} ms sleep in the timed step went unnoticed:\n{out[-3000:]}"
    assert "Performance has regressed" in out and CASE in out, out[-3000:]
    # and the report command names it too
    rc = alert.main(["--storage", str(storage)])
    assert rc == 1


# -- (c) the ratio gate --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ratio_state():
    """The CPU ratio gate's state: the small model, 32 rows at the uniform control's histories and a 128 chunk."""
    from engine.workload import MIXED_CPU
    from gates.step_states import ModelCase, States, ratio_case_for
    states = States("cpu", "float32")
    st = states.get(ratio_case_for(ModelCase("small", MIXED_CPU), "cpu"), "fused")
    st.decodes, st.chunk                                     # build it now, not inside a timing
    yield st
    states.close()


def test_ratio_gate_fails_when_the_fused_step_is_planted_slower(ratio_state):
    from gates.ratio import fused_vs_chunked

    def run_twice(step):            # the plant: the fused step's forward runs twice
        def planted():
            step()
            return step()
        return planted
    with pytest.raises(AssertionError) as e:
        fused_vs_chunked(ratio_state, reps=5, warmup=1, plant=run_twice)
    msg = str(e.value)
    assert "fused loaded step (one forward) is not cheaper than chunked loaded step (two forwards)" in msg, msg
    assert msg.count(" ms") >= 2 and "median" in msg, msg


def test_ratio_check_passes_and_fails_by_the_medians():
    """The checking function itself, on callables with known costs: it passes the cheap one, fails the dear one."""
    from gates.ratio import check_faster

    def cost(ms):
        return lambda: time.sleep(ms / 1000)
    r = check_faster("cheap", cost(2), "dear", cost(12), reps=5, warmup=1)
    assert r.fast_median < r.slow_median and r.ratio < 0.5
    both = r"dear is not cheaper than cheap .*: dear: median 1\d\.\d+ ms; cheap: median \d\.\d+ ms"
    with pytest.raises(AssertionError, match=both):
        check_faster("dear", cost(12), "cheap", cost(2), reps=5, warmup=1)


def test_a_chunk_near_the_models_positions_is_timed_after_what_they_leave():
    """The step bench's timed chunk sits after a chunk's worth of cached positions, or fewer where the model's
    positions run out: a 4,096-position chunk of the small model's 8,192 follows 4,095 (call K: the 1.5B shape's
    16,384-position chunk after 16,384 needed 129 pages of a 128-page table and failed)."""
    import dataclasses

    from engine.workload import MIXED_CPU
    from gates.step_states import ModelCase, States
    states = States("cpu", "float32")
    try:
        st = states.get(ModelCase("small", dataclasses.replace(MIXED_CPU, chunk_tokens=4096)), "fused")
        assert st.engine.max_model_len == 8192 and st.chunk_history == 4095
        assert (st.chunk.start, st.chunk.length) == (4095, 4096)
        assert st.describe("chunk-only")["chunk_history"] == 4095
        out = st.step_fn("chunk-only", "fused")()
        assert out is not None
    finally:
        states.close()
