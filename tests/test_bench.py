"""The bench package on CPU with the small model: every CLI answers --help, the serving and chunk-sweep function APIs
return rows without touching the disk, the peer's rows are numbered by the runner, and Engine.run's stop condition
(the disturbance's loop) leaves the engine resumable."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import chunk_sweep, serving
from bench.cli import kernel_options
from bench.serving import ServingOptions, serve
from engine import Engine, RequestSpec, lineage_config
from engine.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
# every probe, found rather than listed: a GPU-only probe that stops importing is otherwise first seen on a device
# call (session 36: splitk_gemm's import of skinny_gemm's shapes, lost in a tidy-up); left out: two read log files
# named on their command line, not --help, and two are helpers of the others (chain, read_kernel), not commands
PROBES = sorted(f"scripts.probes.{p.stem}" for p in (ROOT / "scripts" / "probes").glob("*.py")
                if p.stem not in ("__init__", "durations_by_file", "prof_report", "chain", "read_kernel"))
CLIS = ["bench.serving", "bench.disturbance", "bench.chunk_sweep", "bench.kernel_bench", "bench.tp_bench",
        "bench.profile_steps", *PROBES]


@pytest.fixture(scope="module")
def small():
    torch.set_num_threads(1)
    return load_model("small", torch.float32, "cpu")


def test_serving_help_as_a_module():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "bench.serving", "--help"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "usage: python -m bench.serving" in p.stdout and "--closed" in p.stdout and "--peer" in p.stdout


@pytest.mark.parametrize("name", CLIS)
def test_every_cli_answers_help(name, capsys):
    mod = importlib.import_module(name)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert f"python -m {name}" in capsys.readouterr().out


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="--prefix-cache: on, off or on,off"):
        ServingOptions(prefix_cache=["maybe"]).resolved()
    with pytest.raises(ValueError, match="--passes must be >= 1"):
        ServingOptions(passes=0).resolved()
    with pytest.raises(SystemExit):
        serving.parse_args(["--prefix-cache", "maybe"])


def test_quick_defaults_and_sorted_rates():
    o = ServingOptions(quick=True, rates=[8.0, 2.0, 4.0, 1.0]).resolved()
    assert (o.closed, o.open, o.peer) == (True, True, True)          # no part named: all of them
    assert (o.batches, o.uniform, o.warmups, o.reps, o.arrivals) == ([8], [32], 1, 1, 24)
    assert o.rates == [1.0, 2.0, 4.0]                                 # ascending, cut to max_rates (3) by --quick


def test_chunk_sweep_function_api(small, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = chunk_sweep.sweep(chunk_sweep.SweepOptions(chunks=(32, 64), arrivals=3, rate=200.0, new_tokens=4,
                                                      threads=1), loaded=small)
    assert [r["chunk_tokens"] for r in rows] == [32, 64]
    assert all(r["served_rate"] > 0 and r["steps"] > 0 and r["gap_worst_ms"] >= r["gap_median_ms"] for r in rows)
    assert list(tmp_path.iterdir()) == []                             # no files: the rows came back in memory
    assert "| 32 |" in chunk_sweep.table(rows)


def test_closed_rows_and_the_peers_rows_numbered_by_the_runner(small, monkeypatch):
    class FakePeer:
        """Stands in for transformers' continuous batching: two runs, rows without the runner's columns."""
        def __init__(self, setup, options):
            pass

        def closed(self, specs, name, warmups, reps, ours):
            rows = [dict(batch=len(specs), rep=i, warmup=i < warmups, time_to_last_s=1.0, requests=len(specs))
                    for i in range(warmups + reps)]
            return [1.0] * reps, dict(attn_implementation="fake", budgets_honoured="-", same_tokens=0), rows

        def close(self):
            pass

    monkeypatch.setattr(serving, "Peer", FakePeer)
    run = serve(ServingOptions(closed=True, peer=True, batches=[2], uniform=[], warmups=0, reps=1, new_tokens=3,
                               threads=1, no_progress=True), loaded=small)
    assert [(r["part"], r["run"]) for r in run.runs] == [("closed", 1), ("peer", 2)]
    peer = run.runs[1]
    assert list(peer)[:7] == ["part", "engine", "model", "device", "dtype", "workload", "run"]
    assert run.summary["peer"]["mixed-cpu-new3-2"]["ours_over_peer"] > 0
    assert run.steps and all(s["run"] == 1 for s in run.steps)


def test_engine_run_until_stops_and_resumes(small):
    e = Engine(lineage_config("fused", device="cpu", dtype="float32", chunk_tokens=32), loaded=small)
    specs = [RequestSpec("a", list(range(5, 25)), 6), RequestSpec("b", list(range(30, 70)), 6)]
    e.run(specs, until=lambda eng: len(eng.requests["a"].output) >= 2)
    assert len(e.requests["a"].output) == 2 and not e.requests["a"].done
    done = e.run()                                                    # nothing new: drains what is queued
    assert all(len(r.tokens) == 6 for r in done.values())
    assert e.pool.num_free == e.pool.capacity


def test_sdpa_probe_times_every_choice_or_says_why_not():
    from scripts.probes.sdpa_probe import CHOICES, probe
    rows = probe("cpu", calls=1, rows=2)
    assert [(r["choice"], r["max_q"]) for r in rows] == [(c, q) for c in CHOICES for q in (1, 64)]
    math = [r for r in rows if r["choice"] == "math"]
    assert all(r["ms"] > 0 for r in math)
    assert all(("ms" in r) != ("error" in r) for r in rows)


def test_host_step_time_engine_mode_times_every_kind_and_profiles(capsys):
    """--engine serves a closed mixed draw to its end with the instant forward and the captured steps emulated: every
    request gets its whole budget from the replays (no eager fallback), and the report names each step kind and the
    profile's top functions."""
    from scripts.probes import host_step_time as h
    steps, eng = h.serve_pass(rows=4, chunk=256, requests=6, new_tokens=3)
    assert all(len(r.output) == 3 and r.done for r in eng.requests.values()) and len(eng.requests) == 6
    assert {k for k, _, _ in steps} == {"pure-decode", "loaded", "chunk-only"}
    assert eng.runner.step_graphs.fallbacks == 0 and eng.runner.graphs.replays > 0
    assert eng.pool.num_free == eng.pool.capacity
    assert h.main(["--engine", "--rows", "4", "--chunk", "256", "--requests", "6", "--new-tokens", "3",
                   "--passes", "1", "--profile", "5"]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in ("pure-decode", "loaded", "chunk-only", "cProfile", "tottime"))


def test_tp_bench_on_cpu_labels_eager_rows_and_compares_like_for_like(capsys, tmp_path):
    """tp 1 and tp 2 (gloo) on the small model: every row eager off CUDA, so labelled so; the ratio is against tp 1
    eager; both engines chose the same tokens."""
    import json
    from bench import tp_bench
    out = tmp_path / "tp.json"
    assert tp_bench.main(["--model", "small", "--device", "cpu", "--engine", "fused", "--tp", "1,2", "--rows", "4",
                          "--steps", "3", "--rounds", "1", "--closed", "4", "--new-tokens", "4",
                          "--warmup-requests", "2", "--tp1-eager", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tp"] for r in rows] == ["1, eager", "2, eager"]
    assert all(r["ratio_to"] == "1, eager" and r["pure_decode_ratio"] > 0 for r in rows)
    assert rows[0]["pure_decode_ratio"] == 1.0 and rows[1]["same_tokens"] == 4
    assert "x of 1, eager" in capsys.readouterr().out


def test_profile_steps_on_cpu(tmp_path):
    """The step profile runs on the step bench's fixed state and splits each kind's time by kernel family (on CPU:
    the ops' self time); its families add up to the total it reports."""
    from bench.profile_steps import family, main
    assert family("nvjet_sm90_hsh_192x160_64x4_1x2_h_bz_coopB_TNT") == "gemm"
    assert family("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
                  "cutlass::half_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::half_t>>, ...>") == "attention"
    assert family("triton_poi_fused_mul_silu_split_0") == "pointwise (compiled)"
    assert family("attend_items") == family("combine_items") == "attention"     # the Triton decode's two kernels
    assert family("gate_up_silu") == "gemm"             # kernels/mlp.py's fused gate/up GEMM
    out = tmp_path / "p.json"
    assert main(["--model", "small", "--device", "cpu", "--dtype", "float32", "--engine", "fused", "--rows", "2",
                 "--kinds", "pure-decode,chunk-only", "--steps", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["kinds"]) == {"pure-decode", "chunk-only"}
    for kind in r["kinds"].values():
        assert kind["device_ms"] > 0 and kind["families_ms"]["gemm"] > 0
        assert sum(kind["families_ms"].values()) == pytest.approx(kind["device_ms"])
    assert r["kinds"]["chunk-only"]["describe"]["prompt_positions"] == 512


def test_profile_trace_profiles_each_step_of_a_served_workload(tmp_path):
    """The second pass of a served workload, one profile per step: the steps the run really takes (a chunk-only
    first step, loaded steps while prompts remain), each step's families adding up to its device time, and a
    summary per kind."""
    from scripts.probes.profile_trace import main
    out = tmp_path / "t.json"
    assert main(["--model", "small", "--device", "cpu", "--dtype", "float32", "--engine", "fused", "--rows", "4",
                 "--chunk", "64", "--requests", "5", "--new-tokens", "3", "--steps", "6", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    steps = r["steps"]
    assert len(steps) == 6 and steps[0]["kind"] == "chunk-only" and steps[0]["decode_rows"] == 0
    assert any(s["kind"] == "loaded" and s["decode_rows"] > 0 and s["prompt_positions"] > 0 for s in steps)
    for s in steps:
        assert s["families_ms"]["gemm"] > 0 and sum(s["families_ms"].values()) == pytest.approx(s["device_ms"])
    assert {k: v["steps"] for k, v in r["kinds"].items()} == {
        kind: sum(s["kind"] == kind for s in steps) for kind in {s["kind"] for s in steps}}


def test_gate_run_profile_profiles_a_gate_run(small):
    """One configuration serves a gate workload as the gates do, warmed up, then profiled: its steps, the time per
    step and the model's functions among the top ones by own time."""
    import re
    from scripts.probes.gate_run_profile import profile_run
    text = profile_run("fused", "torch", "smoke-cpu", "cpu", "float32", small, top=30)
    m = re.match(r"fused\[torch\] on smoke-cpu \(cpu, float32\): first run [\d.]+ s; then [\d.]+ s, [\d.]+ ms a "
                 r"step; profiled run [\d.]+ s, (\d+) steps, [\d.]+ ms a step", text)
    assert m and int(m.group(1)) > 0, text.splitlines()[0]
    assert "engine/model.py" in text and "tottime" in text


def test_durations_by_file_sums_a_logs_durations_by_file_and_phase(tmp_path, capsys):
    """scripts/probes/durations_by_file.py over a pytest log's --durations=0 section: each file's setup, call and
    teardown seconds, slowest file first, and the run's sums; other lines ignored."""
    from scripts.probes.durations_by_file import by_file, main
    log = tmp_path / "gates.log"
    log.write_text("============ slowest durations ============\n"
                   "15.03s call     gates/test_smoke.py::test_smoke[chunked-torch]\n"
                   "2.50s setup    gates/test_kernels.py::test_kernel_gate[x-p64]\n"
                   "1.00s call     gates/test_kernels.py::test_kernel_gate[x-p64]\n"
                   "0.70s teardown gates/test_smoke.py::test_smoke[chunked-torch]\n"
                   "stepgate: 3 engines built in 1.0 s\n400 passed in 151.27s\n")
    sums = by_file(log.read_text())
    assert sums == {"gates/test_smoke.py": {"call": 15.03, "teardown": 0.7},
                    "gates/test_kernels.py": {"setup": 2.5, "call": 1.0}}
    assert main([str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split() == ["gates/test_smoke.py", "0.0", "15.0", "0.7", "15.7"]
    assert out[3].split() == ["gates/test_kernels.py", "2.5", "1.0", "0.0", "3.5"]
    assert out[4].split() == ["(all)", "2.5", "16.0", "0.7", "19.2"]


def test_profile_steps_chunk_option(tmp_path):
    """--chunk sets the loaded and chunk-only steps' prompt positions, past the state's build chunk (1024) too."""
    from bench.profile_steps import main
    out = tmp_path / "p.json"
    assert main(["--model", "small", "--device", "cpu", "--dtype", "float32", "--engine", "fused", "--rows", "2",
                 "--chunk", "1100", "--kinds", "chunk-only", "--steps", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["chunk"] == 1100 and r["kinds"]["chunk-only"]["describe"]["prompt_positions"] == 1100


def test_the_loaded_table_reads_each_part_and_says_what_did_not_run(tmp_path):
    """scripts.probes.loaded_table over one call's files: targets judged from the runs' summaries, the Triton
    decode's A/B rows where those parts ran, "not run" where a part left nothing."""
    from scripts.probes import loaded_table

    def summary(part, seconds, pure):
        d = tmp_path / part / "flash"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"closed": {loaded_table.WORKLOAD: {
            "time_to_last_median_s": seconds, "step_pure-decode_median_ms": pure, "step_loaded_median_ms": 5.5,
            "gap_worst_ms": 13.0}}}))
    summary("c512", 4.0, 2.4)            # 50 req/s
    summary("c8192", 4.0, 2.6)           # 50 req/s: under 55
    summary("c8192-splitkv", 3.5, 2.1)
    table = {r[0]: r for r in loaded_table.rows(tmp_path)}
    assert table["closed 200, chunk 512: req/s"][2:4] == ("50.00 req/s", "PASS")
    assert table["closed 200, chunk 8192: req/s"][2:4] == ("50.00 req/s", "FAIL")
    assert table["worst token gap, chunk 512"][2:4] == ("13.00 ms", "FAIL")
    assert table["closed 200, 512 rows, chunk 16384: req/s"][2:4] == ("not run", "-")
    assert table["closed 200, c8192-splitkv (flash-attn split-KV decode): req/s; pure decode step"][2] == "57.14 req/s; 2.10 ms"
    assert not any("r512-splitkv" in k for k in table), "a part that did not run has no A/B row"


def test_gc_watch_counts_the_collections_of_a_run(small):
    import gc
    from bench.runs import GcWatch
    with GcWatch() as w:
        gc.collect()
    assert (w.collections, w.full) == (1, 1) and w.worst_ms > 0
    run = serve(ServingOptions(closed=True, batches=[2], uniform=[], warmups=0, reps=1, new_tokens=3, threads=1,
                               no_progress=True), loaded=small)
    row = run.runs[0]
    assert {"gc_collections", "gc_full", "gc_worst_ms"} <= set(row) and row["gc_full"] >= 0
    assert run.summary["closed"]["mixed-cpu-new3-2"]["gc_worst_ms"] == row["gc_worst_ms"]


def test_the_engine_defaults_to_the_one_served_on_the_device():
    """Issue 34: the CLIs defaulted to fused, so on CUDA they measured the eager torch-attention engine, not the one
    served there (flash)."""
    from bench import disturbance
    assert serving.parse_args([]).engine == "fused"
    assert serving.parse_args(["--device", "cuda"]).engine == "flash"
    assert disturbance.parse_args(["--device", "cuda:1"]).engine == "flash"
    assert disturbance.parse_args(["--device", "cuda", "--engine", "fused"]).engine == "fused"
    with pytest.raises(SystemExit):
        serving.parse_args(["--device", "gpu"])


def test_the_step_time_plot_without_a_step_kind(tmp_path):
    """Issue 34: `--passes 2 --warmups 0` ran no loaded step; the plot's labels then went one short and set_xticks
    raised after the run (exit 1)."""
    pytest.importorskip("matplotlib")
    from bench.plots import draw_serving
    (tmp_path / "runs.jsonl").write_text("")
    rows = [("pure-decode", 1.5), ("pure-decode", 1.7), ("chunk-only", 9.0)]
    (tmp_path / "steps.csv").write_text("kind,duration_ms\n" + "".join(f"{k},{d}\n" for k, d in rows))
    assert draw_serving(tmp_path) == ["step_time_by_kind.png"]
    assert (tmp_path / "step_time_by_kind.png").stat().st_size > 0


def test_serving_passes_the_kernel_choices_to_the_engine():
    """--decode-kernel and --decode-append reach the engine's config (since 68a58ba they were parsed and dropped:
    ServingOptions had no field for them, so an A/B of two kernels would have run one kernel twice)."""
    from engine.config import lineage_config
    o = serving.parse_args(["--decode-kernel", "flash", "--decode-append", "off"]).options
    extra = kernel_options(o)
    assert extra == dict(decode_kernel="flash", decode_append=False)
    assert lineage_config("flash", device="cpu", **extra).decode_kernel == "flash"
