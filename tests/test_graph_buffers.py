"""The CUDA-graph decode path: static buffers refreshed in place, rows padded up the ladder, padding confined to the
pad page, and a planted stale block table caught.

Two modes. `cuda` (with --device cuda and flash-attn): the real captured graphs. `cpu-emulated`: off CUDA,
DecodeGraphs captures nothing and a "replay" runs the same forward over the same static buffers eagerly, so
everything but the capture itself runs in CI; the torch backend stands in for flash (its decode reads the table's
whole width, masked by the device lengths: correct, but on the 1.5B shape that width is 32k positions a row, which
is why it is not marked graph-safe for real use)."""
from __future__ import annotations

import numpy as np
import pytest

from engine import Engine, PoisonedLogitsError
from engine.graphs import DecodeGraphs, ladder, width_ladder
from engine.workload import MIXED_CPU
from gates.compare import compare
from gates.reference import EngineReference

SUBSET = MIXED_CPU.scaled(40)     # 40 requests over 32 rows: rows change requests as they finish
MAX_LEN = 1024 + 64               # the subset's longest prompt + budget: a narrow table keeps the CPU gathers small


@pytest.fixture
def mode(graph_mode):
    return graph_mode


def run(mode, graphs: bool):
    ref = EngineReference(mode["engine"], mode["model"], device=mode["device"], dtype=mode["dtype"], poison=True,
                          chunk_tokens=SUBSET.chunk_tokens, cuda_graphs=graphs, max_model_len=MAX_LEN, progress=False)
    return ref, ref.generate(SUBSET.requests())


def plant_stale_block_table(monkeypatch):
    """The plant: a refresh that rewrites tokens, positions, slots and lengths but keeps the block table of the
    first replay. When a row's request changes, its decode reads another request's pages, freed ones (NaN in
    poison mode) or the pad page's unwritten slots."""
    fill = DecodeGraphs.fill

    def stale_fill(self, decodes, pages_of):
        need = fill(self, decodes, pages_of)
        if not hasattr(self, "_first_table"):
            self._first_table = self.table.copy()
        else:
            self.table[:] = self._first_table
            self.dev.copy_(self.host)
        return need

    monkeypatch.setattr(DecodeGraphs, "fill", stale_fill)


def test_ladder():
    assert ladder(32) == [1, 2, 4, 8, 16, 24, 32]
    assert ladder(1) == [1]
    assert ladder(12) == [1, 2, 4, 8, 12]
    assert ladder(64)[-1] == 64


def test_width_ladder():
    assert width_ladder(128) == [16, 24, 32, 64, 128]
    assert width_ladder(25) == [16, 24, 25]
    assert width_ladder(24) == [16, 24]
    assert width_ladder(17) == [16, 17]
    assert width_ladder(16) == [16]
    assert width_ladder(5) == [5]


def test_replay_uses_the_narrowest_table_that_holds_its_rows(mode, monkeypatch):
    """Each replay reads only the first w table columns, w the narrowest captured width holding the step's longest
    row; a row's table lists only the pages its cache length reaches, the pad page after them."""
    seen = []
    fill = DecodeGraphs.fill

    def recording_fill(self, decodes, pages_of):
        need = fill(self, decodes, pages_of)
        used = [r.num_cached // self.runner.page_size + 1 for r in decodes]
        assert need == max(used)
        for i, u in enumerate(used):
            assert list(self.table[i, :u]) == pages_of[decodes[i].request_id][:u]
            assert (self.table[i, u:] == self.runner.pad_page).all()
        seen.append(need)
        return need

    monkeypatch.setattr(DecodeGraphs, "fill", recording_fill)
    replay = DecodeGraphs.replay
    keys = []

    def recording_replay(self, decodes, pages_of, *source):     # source: a step launched ahead (overlap, CUDA)
        out = replay(self, decodes, pages_of, *source)
        keys.append(self.last_key)
        return out

    monkeypatch.setattr(DecodeGraphs, "replay", recording_replay)
    ref, _ = run(mode, True)
    e = ref.last_engine
    for i in range(3):          # short rows alone: the narrowest table
        e.submit([5 + i] * 16, 4, f"short-{i}")
    while e.scheduler.has_work:
        e.step()
    g = e.runner.graphs
    assert len(keys) == len(seen) > 0
    for need, (b, w) in zip(seen, keys):
        assert w >= need and all(x < need for x in g.widths if x < w), (need, w, g.widths)
    # the CPU mode's 64-slot pages give two widths (16, 17); the GPU mode's 256-slot pages make this subset's
    # whole table (5 pages) the narrowest width, so one graph width serves every step there
    if len(g.widths) > 1:
        assert len({w for _, w in keys}) > 1, "the subset should reach more than one captured width"


def test_incremental_table_refresh_sees_a_page_list_changed_in_place(mode):
    """DecodeGraphs rewrites only the rows whose length entered a new page when a step's page lists equal the last
    fill's. Equal by value: a list changed in place (the pool never does; a bug or a plant might) is rewritten."""
    if mode["device"] != "cpu":
        pytest.skip("the table bookkeeping is the same on every device")
    ref, _ = run(mode, True)
    g = ref.last_engine.runner.graphs
    pad = ref.last_engine.runner.pad_page
    pages = [[3, 4, 5], [6, 7]]
    g._table_rows(pages, np.array([2, 1]))
    assert g.table[0, :3].tolist() == [3, 4, pad] and g.table[1, :2].tolist() == [6, pad]
    g._table_rows(pages, np.array([3, 1]))          # row 0 entered its third page: only it changes
    assert g.table[0, :3].tolist() == [3, 4, 5]
    pages[1][0] = 9                                  # the same list object, another page
    g._table_rows(pages, np.array([3, 1]))
    assert g.table[1, :2].tolist() == [9, pad], "a page list changed in place kept its stale table row"


def test_graph_path_matches_eager(mode):
    eager_ref, eager = run(mode, False)
    ref, graphed = run(mode, True)
    g = ref.last_engine.runner.graphs
    pure = sum(s.kind == "pure-decode" for s in ref.last_engine.trace)
    assert g is not None and g.replays == pure > 0, f"{g and g.replays} replays for {pure} pure decode steps"
    assert g.capture_graphs == (mode["device"] != "cpu")
    report = compare("decode graphs vs eager", eager, graphed, eager_ref.score, 0.02, 3, check_steps=True)
    assert report.ok, report.problems()
    assert ref.last_engine.pool.num_free == ref.last_engine.pool.capacity


def test_a_width_free_decode_captures_one_table_width(mode, monkeypatch):
    """A backend whose decode costs follow the rows' lengths (width_free_decode: the Triton decode, the flash
    backend's default) gets one captured width, the whole table, and every replay reads it; its tokens are the
    eager engine's. On CPU the torch backend stands in (its decode is correct over any width)."""
    if mode["device"] == "cpu":
        from kernels.torch_backend import TorchBackend
        monkeypatch.setattr(TorchBackend, "width_free_decode", True)
    eager_ref, eager = run(mode, False)
    ref, graphed = run(mode, True)
    e = ref.last_engine
    g = e.runner.graphs
    assert e.runner.backend.width_free_decode
    assert g.widths == [g.W] and {w for _, w in g.keys} == {g.W}, g.widths
    assert g.replays > 0 and g.last_key[1] == g.W
    report = compare("one width vs eager", eager, graphed, eager_ref.score, 0.02, 3, check_steps=True)
    assert report.ok, report.problems()


def test_a_second_build_warms_up_only_what_this_process_has_not_run(mode, monkeypatch):
    """A capture's warm-up forwards run each key once a process (engine.graphs.WARMED), plus the first key of every
    capture (its new stream); an engine built again in the same configuration serves the same tokens with one
    warm-up, and a change of what its forwards launch (here the runner's layer kernels) warms every key again. Off
    CUDA nothing is captured, so the choice is checked on the graph set directly."""
    import engine.graphs as graphs_module
    monkeypatch.setattr(graphs_module, "WARMED", set())
    if mode["device"] == "cpu":                 # no capture, so no warm-up: the graph set of one build is enough
        runner = EngineReference(mode["engine"], mode["model"], device="cpu", dtype=mode["dtype"], cuda_graphs=True,
                                 max_model_len=MAX_LEN, progress=False).engine().runner
        assert runner.graphs.warm_keys(runner.graphs.keys) == runner.graphs.keys
    else:
        _, first = run(mode, True)
        ref, second = run(mode, True)
        runner = ref.last_engine.runner
        assert runner.graphs.warmed == 1, runner.graphs.describe()
        report = compare("rebuilt vs first", first, second, ref.score, 0.02, 3, check_steps=True)
        assert report.ok, report.problems()
    g, keys = runner.graphs, runner.graphs.keys
    assert len(keys) > 1
    assert g.warm_keys(keys) == keys[:1]
    runner.mlp_rows += 1            # this engine's own runner: nothing else sees it
    assert g.warm_keys(keys) == keys


def test_padding_rows_touch_only_the_pad_page(mode):
    ref, _ = run(mode, True)
    e = ref.last_engine
    g = e.runner.graphs
    for i in range(3):          # admitted and prefilled together, so they decode together: 3 rows
        e.submit([5 + i] * 16, 4, f"three-{i}")
    while e.scheduler.has_work:
        e.step()
    # the last pure decode step (3 rows, padded to a graph of 4): its rows, then padding
    pad = e.runner.pad_page
    n_live = [s for s in e.trace if s.kind == "pure-decode"][-1].decode_tokens
    assert g.size_for(n_live) > n_live, "the step should have needed padding"
    assert all(int(x) != g.pad_slot for x in g.view["slots"][:n_live])
    assert all(int(x) == g.pad_slot for x in g.view["slots"][n_live:])
    assert (g.table[n_live:] == pad).all()
    assert all(int(x) == 1 for x in g.view["kv_lens"][n_live:])
    assert pad == e.pool.num_pages and pad not in {p for ps in e.pool.owned.values() for p in ps}


def test_stale_block_table_is_caught(mode, monkeypatch):
    plant_stale_block_table(monkeypatch)
    eager_ref, eager = run(mode, False)
    try:
        _, graphed = run(mode, True)
    except PoisonedLogitsError as e:     # poison mode names the step, the requests and their pages
        assert "non-finite logits" in str(e) and "pages" in str(e), str(e)
        return
    report = compare("decode graphs vs eager", eager, graphed, eager_ref.score, 0.02, 3, check_steps=True)
    assert not report.ok, "a stale block table in the graph's static buffer went unnoticed"
    assert "reference token" in report.problems()[0]
