"""engine/build_cost.py and its gate-run line (gates/build_cost.py): each engine built leaves one record of where its
construction time went, and the run's totals add up across processes (xdist workers)."""
from __future__ import annotations

from engine import Engine, EngineConfig, build_cost
from gates import build_cost as gate_cost


def test_each_engine_built_records_its_cost(loaded):
    before = len(build_cost.BUILDS)
    e = Engine(EngineConfig(cuda_graphs=True, progress=False, max_model_len=512), loaded=loaded)
    assert len(build_cost.BUILDS) == before + 1
    rec = build_cost.BUILDS[-1]
    assert rec is e.build_cost and rec["config"] == e.served.key()
    # on a CPU the captured steps' path is emulated: shapes set up, nothing captured, no compile or warm-up
    assert rec["graphs"] == 0 and e.runner.graphs is not None and e.runner.graphs.keys
    assert rec["total_s"] > 0 and all(rec[k] >= 0 for k in build_cost.PARTS)
    assert sum(rec[k] for k in build_cost.PARTS) <= rec["total_s"]


def test_totals_and_the_line_add_up_across_workers():
    a = [dict(config="x", graphs=10, total_s=3.0, compile_s=1.0, warmup_s=0.5, graph_warm_s=0.25, capture_s=1.0),
         dict(config="y", graphs=5, total_s=1.0, compile_s=0.0, warmup_s=0.0, graph_warm_s=0.5, capture_s=0.25)]
    t = build_cost.totals(a)
    assert t == dict(engines=2, graphs=15, total_s=4.0, compile_s=1.0, warmup_s=0.5, graph_warm_s=0.75,
                     capture_s=1.25)
    both = gate_cost.add(gate_cost.add(None, t), build_cost.totals(a[:1]))
    assert both["engines"] == 3 and both["graphs"] == 25 and both["total_s"] == 7.0
    assert gate_cost.line(t) == ("2 engines built in 4.0 s: compile 1.0 s, backend warm-up 0.5 s, captured steps "
                                 "2.0 s (15 graphs; warm-up forwards 0.8 s, captures 1.2 s)")


def test_graph_sets_split_warm_up_forwards_from_captures():
    from types import SimpleNamespace as Set
    parts = {"compile_s": 1.0}
    build_cost.add_graph_sets(parts, [Set(warm_s=0.5, capture_s=2.0, graphs={1: 0, 2: 0}), None,
                                      Set(warm_s=0.25, capture_s=1.0, graphs={3: 0})])
    assert parts == {"compile_s": 1.0, "graph_warm_s": 0.75, "capture_s": 2.25, "graphs": 3}
    assert build_cost.record("k", parts, 5.0)["graphs"] == 3
    build_cost.BUILDS.pop()


def test_timed_adds_a_blocks_time_even_when_it_raises():
    parts = {}
    try:
        with build_cost.timed(parts, "compile_s"):
            raise ValueError("compile failed")
    except ValueError:
        pass
    with build_cost.timed(parts, "compile_s"):
        pass
    assert set(parts) == {"compile_s"} and parts["compile_s"] >= 0


def test_candidate_runs_are_summed_by_configuration_and_across_workers():
    """gates/build_cost.py's run line: each candidate run adds its steps and seconds to its configuration, workers'
    sums add up, and the line names the slowest configuration first with its mean step."""
    saved = dict(gate_cost.RUNS)
    gate_cost.RUNS.clear()
    try:
        gate_cost.record_run("fused[torch]", 100, 1.0)
        gate_cost.record_run("fused[torch]", 50, 0.5)
        gate_cost.record_run("flash[flash]", 200, 0.4)
        assert gate_cost.RUNS == {"fused[torch]": [2, 150, 1.5], "flash[flash]": [1, 200, 0.4]}
        both = gate_cost.add_runs(gate_cost.RUNS, {"flash[flash]": [1, 100, 0.2], "chunked[torch]": [1, 10, 0.1]})
        assert both["flash[flash]"] == [2, 300, 0.6000000000000001] and both["chunked[torch]"] == [1, 10, 0.1]
        assert gate_cost.RUNS["flash[flash]"] == [1, 200, 0.4]       # the sum is a new dict
        assert gate_cost.runs_line(gate_cost.RUNS) == (
            "candidate runs took 1.9 s: fused[torch] 1.5 s (2 runs, 150 steps, 10.00 ms a step); flash[flash] 0.4 s "
            "(1 run, 200 steps, 2.00 ms a step)")
    finally:
        gate_cost.RUNS.clear()
        gate_cost.RUNS.update(saved)


def test_builds_are_grouped_by_configuration_and_across_workers():
    """The configurations line: each configuration's engines, seconds and graphs, workers' groups added up, the
    slowest first (how often one configuration was built again: what sharing engines between gates would save)."""
    a = [dict(config="x", graphs=10, total_s=3.0), dict(config="y", graphs=5, total_s=1.0),
         dict(config="x", graphs=10, total_s=2.0)]
    mine = gate_cost.by_config(a)
    assert mine == {"x": [2, 5.0, 20], "y": [1, 1.0, 5]}
    both = gate_cost.add_runs(mine, gate_cost.by_config([dict(config="y", graphs=5, total_s=6.5)]))
    assert gate_cost.configs_line(both, top=1) == (
        "engine builds by configuration (2 configurations; the 1 slowest): y 2x 7.5 s (10 graphs)")
