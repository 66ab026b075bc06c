"""The same-job A/B (gates/ab.py): its statistic on timings of known shape (process pairs that agree and that do
not), its record and report, the base revision's checkout (gates/ab_tree.py), and on this CPU, over two process
pairs alive at once (gates/ab_rounds.py), A/A (this checkout against itself: no alert) and head planted 10% slower
(alerted); the baseline refresh into a folder of its own. The command line end to end (a base worktree, two runs)
is marked slow."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gates import ab, ab_rounds, ab_tree
from gates.ab_stats import IMPROVED, OK, REGRESSION, THRESHOLDS, StatsError, compare
from tests.child import child_env

REPO = Path(__file__).resolve().parent.parent
# the tests' state: the small model, 4 decode rows at the uniform control's 64-position histories (a step of a few
# ms on one thread; the default 32 rows of the mixed draw take half a second a step on a shared 2-core host)
SMALL_STATE = ["--workload", "uniform-cpu", "--rows", "4", "--kinds", "pure-decode"]


def drifting_rounds(n: int, reps: int, scale: float, seed: int) -> list[list[float]]:
    """Timings of a 10 ms step on a host whose speed drifts by up to 3x between rounds, with 5% noise per step; the
    same seed gives the same drift, as base and head of one round share the host."""
    rng = np.random.default_rng(seed)
    drift = 1 + 2 * rng.random(n)
    noise = np.random.default_rng(seed + 1000 + int(scale * 100))
    return [list(0.010 * scale * d * np.abs(1 + 0.05 * noise.standard_normal(reps))) for d in drift]


# -- the statistic -------------------------------------------------------------------------------------------------
def test_a_ten_percent_slower_head_is_a_regression_through_a_drifting_host():
    base, head = drifting_rounds(40, 5, 1.0, 0), drifting_rounds(40, 5, 1.10, 0)
    c = compare(base, head, threshold=0.05)
    assert c.verdict == REGRESSION, c
    assert 1.0 < c.low <= 1.10 <= c.high and abs(c.ratio - 1.10) < 0.03, c


def test_same_speed_through_a_drifting_host_is_no_regression():
    c = compare(drifting_rounds(40, 5, 1.0, 0), drifting_rounds(40, 5, 1.0, 0), threshold=0.05)
    assert c.verdict == OK and c.low <= 1.0 <= c.high, c


def test_a_sure_but_small_difference_is_under_the_threshold():
    """A 2% offset that the interval is sure of (two processes of the same code can differ so) is not alerted at
    a 5% threshold, and is at a 1% one."""
    base, head = drifting_rounds(60, 5, 1.0, 3), drifting_rounds(60, 5, 1.02, 3)
    c = compare(base, head, threshold=0.05)
    assert c.low > 1.0 and c.verdict == OK, c
    assert compare(base, head, threshold=0.01).verdict == REGRESSION


def test_a_faster_head_is_improved_and_the_interval_is_seeded():
    base, head = drifting_rounds(40, 5, 1.0, 5), drifting_rounds(40, 5, 0.8, 5)
    c = compare(base, head, threshold=0.05, seed=7)
    assert c.verdict == IMPROVED and c.high < 1.0, c
    assert compare(base, head, threshold=0.05, seed=7) == c


def pair_rounds(ratios: list[float], rounds: int = 30, seed: int = 0) -> tuple[list, list, list[int]]:
    """Rounds of several process pairs on a drifting host, pair p's head slower than its base by ratios[p] (a
    process's own speed, which no number of its rounds averages out), and the pair of each round."""
    base, head, pairs = [], [], []
    for p, r in enumerate(ratios):
        base += drifting_rounds(rounds, 5, 1.0, seed + p)
        head += drifting_rounds(rounds, 5, r, seed + p)
        pairs += [p + 1] * rounds
    return base, head, pairs


def test_process_pairs_that_disagree_give_a_wide_interval_and_no_alert():
    """Three pairs at 0.99x, 1.16x and 1.03x: their mean (1.058x) is above the threshold, but one pair of processes
    read head faster, so the interval reaches below 1. Taking the rounds as the unit instead (one pair) would be
    sure of a ratio those rounds' processes alone decided."""
    base, head, pairs = pair_rounds([0.99, 1.16, 1.03])
    c = compare(base, head, threshold=0.05, pairs=pairs)
    assert c.verdict == OK and c.low < 1.0 and c.high > 1.12 and c.ratio > 1.05, c
    assert [round(r, 2) for r in c.pairs] == [0.99, 1.16, 1.03], c.pairs
    pooled = compare(base, head, threshold=0.05)
    assert pooled.low > 1.0 > c.low, (pooled, c)


def test_process_pairs_that_agree_give_a_tight_interval_and_alert():
    base, head, pairs = pair_rounds([1.07, 1.07, 1.07])
    c = compare(base, head, threshold=0.05, pairs=pairs)
    assert c.verdict == REGRESSION and 1.05 < c.low <= 1.07 <= c.high < 1.09, c
    assert compare(base, head, threshold=0.05, pairs=pairs) == c         # seeded


def test_one_pair_is_the_bootstrap_over_rounds():
    base, head, _ = pair_rounds([1.10])
    one = compare(base, head, threshold=0.05, pairs=[7] * len(base))
    assert one == compare(base, head, threshold=0.05) and one.pairs == (one.ratio,), one


def test_rounds_must_pair_and_hold_timings():
    with pytest.raises(StatsError, match="paired rounds needed: base has 3, head 2"):
        compare([[1.0]] * 3, [[1.0]] * 2, threshold=0.05)
    with pytest.raises(StatsError, match="every round needs at least one timing"):
        compare([[1.0], []], [[1.0], [1.0]], threshold=0.05)
    with pytest.raises(StatsError, match="a pair for every round needed: 3 rounds, 2 pairs given"):
        compare([[1.0]] * 3, [[1.0]] * 3, threshold=0.05, pairs=[1, 2])


# -- the record and what is written --------------------------------------------------------------------------------
def record_of(head_scale: float) -> dict:
    spec = "fused:pure-decode"
    info = dict(device_name="cpu", threads=1, torch="x", benchmarks={spec: dict(rows=4, workload="uniform-cpu")})
    timings = {side: {clock: {spec: drifting_rounds(20, 3, scale, 1)} for clock in ab_rounds.CLOCKS}
               for side, scale in (("base", 1.0), ("head", head_scale))}
    run = dict(base=dict(rev="main", commit="a" * 40, tree="/b"), head=dict(rev="HEAD", commit="b" * 40, tree="/h"),
               device="cpu", model="small", clock="cpu", threshold=THRESHOLDS["cpu"], confidence=0.95,
               resamples=500, seed=0, reps=3, warmup=1, processes=2)
    return ab.decide(timings["base"], timings["head"], [spec], info, info, run, pairs=[1] * 10 + [2] * 10)


def test_the_report_names_a_regression_in_markdown_json_and_a_plot(tmp_path, monkeypatch):
    summary = tmp_path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    rec = record_of(1.25)
    assert rec["regression"] and rec["benchmarks"][0]["verdict"] == REGRESSION
    ab.write(rec, tmp_path)
    md = (tmp_path / "ab.md").read_text()
    assert ("| benchmark | base (median) | head (median) | ratio head/base [95% CI] | each process pair | wall time "
            "ratio | verdict |") in md
    assert "over 2 process pair(s), bootstrap over pairs, then rounds within them" in md
    assert "| cpu-small-fused-pure-decode |" in md and "**REGRESSION**" in md, md
    assert "1 regression(s): cpu-small-fused-pure-decode 1.2" in md
    assert summary.read_text().strip() == md.strip()          # appended for the CI run's page
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert len(saved["benchmarks"][0]["base_rounds"]) == 20 and saved["base"]["commit"] == "a" * 40
    assert saved["pair_of_round"] == [1] * 10 + [2] * 10 and len(saved["benchmarks"][0]["pair_ratios"]) == 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert any("matplotlib is not installed" in n for n in rec["notes"])
    else:
        assert (tmp_path / "ab.png").stat().st_size > 10_000


def test_an_unchanged_head_reports_no_regression(tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    rec = record_of(1.0)
    ab.write(rec, tmp_path, plot=False)
    assert not rec["regression"] and "**no regression**" in (tmp_path / "ab.md").read_text()
    assert not (tmp_path / "ab.png").exists()


def test_too_few_rounds_is_an_error_not_a_verdict():
    rec = record_of(1.0)
    spec = "fused:pure-decode"
    short = {c: {spec: [[0.01]] * 2} for c in ab_rounds.CLOCKS}
    with pytest.raises(ab.ABError, match="only 2 round"):
        ab.decide(short, short, [spec], {"benchmarks": {spec: {}}}, {"benchmarks": {spec: {}}},
                  {k: rec[k] for k in ("base", "head", "device", "model", "clock", "threshold", "confidence",
                                       "resamples", "seed", "reps", "warmup")})


# -- the base revision ---------------------------------------------------------------------------------------------
def git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_the_base_revision_is_checked_out_into_a_worktree_and_removed(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "f.txt").write_text("base\n")
    git(repo, "add", "f.txt")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-qb", "pr")
    (repo / "f.txt").write_text("head\n")
    git(repo, "commit", "-qam", "head")
    git(repo, "checkout", "-q", "main")
    (repo / "g.txt").write_text("main moved on\n")
    git(repo, "add", "g.txt")
    git(repo, "commit", "-qm", "main moved on")
    git(repo, "checkout", "-q", "pr")
    assert ab_tree.resolve("main", merge_base=True, repo=repo) == base          # what the pull request changes
    assert ab_tree.resolve("main", merge_base=False, repo=repo) == git(repo, "rev-parse", "main")
    with ab_tree.worktree(base, repo) as tree:
        assert (tree / "f.txt").read_text() == "base\n" and not (tree / "g.txt").exists()
        assert ab_tree.describe_tree(tree) == {"commit": base, "dirty": False}
    assert not tree.exists() and str(tree) not in git(repo, "worktree", "list")
    with pytest.raises(ab_tree.ABError, match="git rev-parse --verify --quiet no-such-branch"):
        ab_tree.resolve("no-such-branch", merge_base=False, repo=repo)


# -- on this CPU: A/A and planted over two process pairs, one interleaved session ---------------------------------
# one set of three processes: 25-45 s on the 2-core host, with its load; two sets: six process starts, 60-130 s
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_aa_is_quiet_and_a_planted_ten_percent_is_alerted_on_cpu(tmp_path, n):
    """n sets of three fresh processes of this checkout, all alive at once, timed in the same interleaved rounds:
    `base`, `again` (A/A against base) and `planted` (a busy-wait of 10% of its own step inside every timed step);
    each set times its share of the rounds. The comparisons are the command's own (gates.ab.decide, the process pair
    the unit of its interval), at its CPU defaults (CPU time of each step, the CPU threshold)."""
    a = ab.parse(SMALL_STATE + ["--base-tree", str(REPO), "--out", str(tmp_path), "--processes", str(n)])
    specs = ab.bench_specs(a)
    args = ab.worker_args(a, specs)
    sets = [{role: ab_rounds.Side(f"{role}-{p}", REPO, args + extra, tmp_path / f"{role}-{p}.log")
             for role, extra in (("base", []), ("again", []), ("planted", ["--plant-frac", "0.10"]))}
            for p in range(1, n + 1)]
    timings, pairs, info, notes = ab_rounds.measure_pairs(sets, specs, a.rounds, a.reps,
                                                          deadline=time.monotonic() + 400, startup_timeout=300,
                                                          progress=lambda *_: None)
    assert not notes, notes
    assert pairs == [p for p in range(1, n + 1) for _ in range(a.rounds // n)], pairs
    run = dict(base={}, head={}, device="cpu", model=a.model, clock=a.clock, threshold=THRESHOLDS["cpu"],
               confidence=a.confidence, resamples=a.resamples, seed=a.seed, reps=a.reps, warmup=a.warmup,
               processes=n)
    aa = ab.decide(timings["base"], timings["again"], specs, info["base"], info["again"], run, pairs=pairs)
    planted = ab.decide(timings["base"], timings["planted"], specs, info["base"], info["planted"], run, pairs=pairs)
    table = f"A/A {aa['benchmarks'][0]}\nplanted {planted['benchmarks'][0]}".replace("_rounds", "")[:3000]
    assert len(aa["benchmarks"][0]["pair_ratios"]) == n and aa["pairs"] == n, table
    assert not aa["regression"], table
    assert planted["regression"], table
    assert info["planted"]["plant_frac"] == 0.10 and info["base"]["plant_frac"] == 0


# -- the command line end to end (slow), the baseline refresh ------------------------------------------------
@pytest.fixture
def clone(tmp_path) -> Path:
    """A clone of this checkout's HEAD (sharing its objects, writing nothing into its .git): gates.ab makes its
    base worktree there."""
    dest = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(dest)], check=True, capture_output=True)
    return dest


def run_ab(clone: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = child_env(PYTHONPATH=str(REPO))
    env.pop("GITHUB_STEP_SUMMARY", None)
    return subprocess.run([sys.executable, "-m", "gates.ab", "--base", "HEAD", "--head-tree", str(clone), "--out",
                           str(out), *SMALL_STATE, *extra], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_the_command_exits_0_on_aa_and_1_on_a_planted_slowdown(clone, tmp_path):
    quiet = run_ab(clone, tmp_path / "aa")
    assert quiet.returncode == 0, quiet.stdout[-3000:] + quiet.stderr[-3000:]
    assert "no regression" in quiet.stdout and (tmp_path / "aa" / "ab.json").is_file()
    rec = json.loads((tmp_path / "aa" / "ab.json").read_text())
    assert rec["base"]["commit"] == rec["head"]["commit"] == ab_tree.git("rev-parse", "HEAD", cwd=clone)
    assert "stepgate-ab-base" not in ab_tree.git("worktree", "list", cwd=clone)      # the base worktree is gone
    loud = run_ab(clone, tmp_path / "planted", "--plant-head-frac", "0.10", "--processes", "2", "--successive")
    assert loud.returncode == 1, loud.stdout[-3000:] + loud.stderr[-3000:]
    assert "REGRESSION" in loud.stdout and "planted 10% busy-wait" in loud.stdout
    assert "over 2 process pair(s)" in loud.stdout and (tmp_path / "planted" / "head-2.log").is_file()


def test_refresh_baseline_saves_the_step_timings_with_their_commit(tmp_path):
    storage = tmp_path / "benchmarks" / "mymachine"
    env = child_env(STEPGATE_BENCH_ROUNDS="3", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "gates.ab", "refresh-baseline", "--storage", str(storage),
                        "--allow-dirty", "-k", "test_step_time and cpu-small-fused-chunk-only"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    saved = list(storage.rglob("*.json"))
    assert len(saved) == 1 and saved[0].name.startswith("0001_mymachine_"), saved
    data = json.loads(saved[0].read_text())
    assert data["commit_info"]["id"] == ab_tree.git("rev-parse", "HEAD")
    assert f"new baseline: {saved[0]}" in p.stdout and data["benchmarks"]


def test_more_rows_than_the_workload_has_requests_take_a_longer_draw():
    """`--rows` past the workload's requests (the 512-row serving bench's 200 decode rows against the mixed draw's
    32) builds the fixed state from the draw's first `rows` prompts, as bench.profile_steps does, not a ValueError."""
    from gates import ab_worker
    from engine.workload import WORKLOADS
    rows = WORKLOADS["uniform-cpu"].num_requests + 2
    a = ab_worker.parse(["--tree", str(REPO), "--workload", "uniform-cpu", "--rows", str(rows),
                         "--bench", "fused:pure-decode"])
    benches, info = ab_worker.build(a)
    assert benches["fused:pure-decode"]["describe"]["rows"] == rows
    assert info["workload"] == "uniform-cpu"


def test_out_of_memory_with_every_pair_alive_says_how_to_fit(monkeypatch):
    """A worker that runs out of GPU memory while every pair is alive at once (session 32: three pairs of 200-row
    engines on an 80 GB card) fails the run with the way out: fewer pairs or --successive. One pair alone, or any
    other failure, is reported as it was."""
    oom = "head-2 worker (/tree) failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"

    def failing(*a, **k):
        raise ab_rounds.ABError(oom)
    monkeypatch.setattr(ab_rounds, "measure", failing)
    sets = [{"base": ab_rounds.Side(f"base-{i}", REPO, [], Path(f"b{i}")),
             "head": ab_rounds.Side(f"head-{i}", REPO, [], Path(f"h{i}"))} for i in (1, 2, 3)]
    with pytest.raises(ab_rounds.ABError) as e:
        ab_rounds.measure_pairs(sets, ["x"], 4, 1, time.monotonic() + 60, 10, progress=lambda *a: None)
    assert oom in str(e.value) and "6 worker processes were alive at once" in str(e.value)
    assert "--processes 2" in str(e.value) and "--successive" in str(e.value)
    with pytest.raises(ab_rounds.ABError) as e:      # one pair at a time: nothing to suggest
        ab_rounds.measure_pairs(sets, ["x"], 4, 1, time.monotonic() + 60, 10, successive=True,
                                progress=lambda *a: None)
    assert str(e.value) == oom
