"""Captured loaded and chunk-only steps (engine/step_graphs.py): a variable-length attention call over pieces of at
most 64 query rows and, in loaded steps, a decode call over the decode rows packed first; static metadata refreshed
in place, padding confined to the pad page; graphed against eager under the 0.02 rule; planted stale metadata and a
planted over-read caught.

Two modes, as tests/test_graph_buffers.py: `cuda` (--device cuda with flash-attn: real graphs, flash, fp16, the
trained small model) and `cpu-emulated` (nothing captured; a "replay" runs the same forward over the same static
buffers, with the torch backend standing in for flash: its prefill reads lengths from the device tensors and
gathers the whole table width the host bounds give)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine import Engine, PoisonedLogitsError
from engine.config import lineage_config
from engine.graphs import activation_bytes, ladder, width_ladder
from engine.loader import QWEN25_1P5B, qwen2_config
from engine.model import ModelShape
from engine.request import Request, State
from engine.scheduler import Chunk
from engine.step_graphs import Q_TILE, StepGraphs, token_ladder
from engine.workload import Workload
from gates.compare import compare
from gates.reference import EngineReference

# short prompts (cheap emulated steps), two-piece chunks (chunk 128 = 2 x Q_TILE), more requests than rows
REPO = Path(__file__).resolve().parent.parent
WORKLOAD = Workload("step-graphs-cpu", (4, 16, 64, 200), (8, 24), 14, chunk_tokens=128)
MAX_BATCH = 8
MAX_LEN = 200 + 24


EMULATE_STEP_GRAPHS = True     # tests/conftest.py's cpu-emulated mode graphs loaded and chunk-only steps too


@pytest.fixture
def mode(graph_mode):
    return graph_mode


def run(mode, graphs: bool):
    ref = EngineReference(mode["engine"], mode["model"], device=mode["device"], dtype=mode["dtype"], poison=True,
                          chunk_tokens=WORKLOAD.chunk_tokens, max_batch=MAX_BATCH, cuda_graphs=graphs,
                          max_model_len=MAX_LEN, progress=False)
    return ref, ref.generate(WORKLOAD.requests())


_EAGER = {}


def eager_run(mode):
    """The eager reference run, once per mode and model (it does not depend on any plant)."""
    key = (mode["engine"], mode["model"])
    if key not in _EAGER:
        _EAGER[key] = run(mode, False)
    return _EAGER[key]


_CONTROL = {}


def plant_mode(mode):
    """Where the plants run: the random small model. The trained one (cuda mode) shrugs off most context
    (docs/small-model.md: a perturbed first page changes 20 of 48 continuations), and a chunk piece's stale metadata,
    which touches no decode row, left its tokens unchanged on the H200; on the random model every position's keys
    move what follows. The unplanted graphed run must match eager on it first (the control), else fp16 rounding
    alone could flip a token and a plant would look caught without being so."""
    pm = dict(mode, model="small")
    key = (pm["engine"], pm["model"])
    if key not in _CONTROL:
        eager_ref, eager = eager_run(pm)
        _, graphed = run(pm, True)
        _CONTROL[key] = compare("step graphs vs eager (control)", eager, graphed, eager_ref.score, check_steps=True)
    if not _CONTROL[key].ok:
        pytest.skip(f"unplanted, graphed and eager runs of the random small model already differ here: "
                    f"{_CONTROL[key].problems()[:1]}")
    return pm


def graphed_kinds(engine) -> int:
    return sum(s.kind in ("loaded", "chunk-only") for s in engine.trace)


# -- the ladder and its bounds -----------------------------------------------------------------------------------
def test_token_ladder():
    assert token_ladder(544) == [16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512, 544]
    assert token_ladder(10) == [10]
    big = token_ladder(16384 + 512)
    assert big[-1] == 16896 and all(b / a <= 1.25 for a, b in zip(big[3:], big[4:])), big


def test_capture_stays_cheap_at_512_rows():
    """max_batch 512 on the 1.5B shape at chunk 8192: the graph counts and the largest forward's activations stay
    small (the decode ladder pads a step by at most 1/8 from 64 rows, the token ladder by at most 1/4 from 128).
    The graphs share one memory pool; what more graphs cost is capture time at construction. The bound is 180
    graphs of each kind since the width ladder's 24 (2026-12-01: 175 and 174; 140 and 145 before), which cut the
    32-row pure decode step's device time by 58 us on the H200 (docs/RESULTS.md)."""
    shape = ModelShape.of(qwen2_config(**QWEN25_1P5B))
    sizes, widths, tokens = ladder(512), width_ladder(32768 // 256), token_ladder(8192 + 512)
    # a step-graph bucket: one chunk-only graph and one loaded graph per decode-call width
    decode_graphs, step_graphs = len(sizes) * len(widths), len(tokens) * (len(widths) + 1)
    assert all(b / a <= 1.125 for a, b in zip(sizes, sizes[1:]) if a >= 64), sizes
    assert decode_graphs <= 180 and len(tokens) <= 32 and step_graphs <= 180, (decode_graphs, step_graphs)
    pool = activation_bytes(shape, tokens[-1], 512, 2)
    logits = 512 * shape.vocab_size * 4
    print(f"\n512 rows, chunk 8192: {decode_graphs} decode + {step_graphs} step graphs; largest forward about "
          f"{pool / 2**30:.2f} GiB, static logits {logits / 2**30:.2f} GiB")
    assert pool + logits < 2 * 2**30


# -- the static buffers, against the eager packing ----------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated_engine(graph_emulation):
    with pytest.MonkeyPatch.context() as mp:     # only while the engine "captures"
        graph_emulation(mp, prefill=True)
        return Engine(lineage_config("fused", chunk_tokens=128, max_batch=MAX_BATCH, cuda_graphs=True,
                                     max_model_len=1088, num_pages=200, progress=False))


plans = st.lists(st.tuples(st.sampled_from(["chunk", "decode"]), st.integers(1, 900), st.integers(0, 128)),
                 min_size=1, max_size=MAX_BATCH)


@settings(max_examples=30, deadline=None)
@given(plans)
def test_fill_matches_the_eager_packing(emulated_engine, spec):
    """For any plan: the real tokens, positions and slots are the eager step's with the decode rows moved first,
    and the sampled rows are the same positions in the same order; every chunk sequence is a piece of at most
    Q_TILE rows whose history ends at its last position and whose table row is its request's pages; the decode rows
    are sequences of up to Q_TILE queries over one key of the pad page for the variable-length call, and for the
    decode call its table's rows (their pages, the pad page past them) with their true lengths; padding writes and
    reads only the pad page; unused sequences have no query and no key."""
    e = emulated_engine
    runner, sg, ps = e.runner, e.runner.step_graphs, e.pool.page_size
    chunks, decodes = [], []
    for i, (kind, length, start) in enumerate(spec):
        r = Request(f"p{i}", [3 + (i * 7 + j) % 50 for j in range(length + start)], 8)
        e.pool.reserve(r.request_id, r.slots_needed)
        if kind == "chunk" and sum(c.length for c in chunks) + length <= 128:
            r.state, r.num_cached = State.PREFILL, start
            chunks.append(Chunk(r, start, min(length, 128)))
        else:
            r.state, r.num_cached, r.output = State.DECODE, length + start - 1, [5]
            decodes.append(r)
    try:
        if not chunks:
            return
        b = sg.bucket_for(chunks, decodes)
        assert b is not None
        nrows = sg.fill(chunks, decodes, e.pool.owned, b)
        tokens, positions, ctx, rows = runner.build(chunks, decodes, e.pool.owned)
        t, d = len(tokens), len(decodes)
        order = list(range(t - d, t)) + list(range(t - d))      # the graph's packed row i is eager row order[i]
        hv = sg.host_view
        assert list(hv["tokens"][:t]) == tokens[order].tolist()
        assert list(hv["positions"][:t]) == positions[order].tolist()
        assert list(hv["slots"][:t]) == ctx.slot_mapping[order].tolist()
        assert [order[i] for i in hv["logit_rows"][:nrows]] == rows.tolist()
        seqs, R = sg.seqs_for(b), sg.rows_for(b)
        cu, kv, table = hv["cu_q"][:seqs + 1], hv["kv_lens"][:seqs], hv["table"][sg.R:sg.R + seqs]
        lead, lead_table = hv["lead_kv"][:R], hv["table"][:R]
        q = np.diff(cu)
        assert cu[0] == 0 and cu[-1] == b and (q >= 0).all() and (q <= Q_TILE).all()
        assert hv["decode_rows"][0] == d and d <= R and (lead[d:] == 1).all()
        pad = runner.pad_page
        for i, r in enumerate(decodes):     # the decode call: each row's history through its pages
            pages = e.pool.owned[r.request_id]
            assert lead[i] == hv["positions"][i] + 1 and lead[i] <= len(pages) * ps
            assert list(lead_table[i, :len(pages)]) == pages and (lead_table[i, len(pages):] == pad).all()
        assert (lead_table[d:] == pad).all()
        nd = -(-d // Q_TILE)
        owner = [None] * nd + [c.request.request_id for c in chunks for _ in range(-(-c.length // Q_TILE))]
        for s in range(seqs):
            lo, hi = cu[s], cu[s + 1]
            if s < nd:                  # decode rows: one key of the pad page here (the decode call's rows)
                assert kv[s] == 1 and lo == Q_TILE * s and hi == min(d, Q_TILE * (s + 1)) and (table[s] == pad).all()
            elif s < len(owner):        # a chunk piece: its positions are the last of its history
                assert list(hv["positions"][lo:hi]) == list(range(kv[s] - q[s], kv[s]))
            elif hi > lo:               # padding: the pad page only, positions from 0, reads what it wrote
                assert kv[s] == q[s] and list(hv["positions"][lo:hi]) == list(range(q[s]))
                assert (hv["slots"][lo:hi] // ps == pad).all() and (table[s] == pad).all()
            else:
                assert kv[s] == 0
            if nd <= s < len(owner):
                pages = e.pool.owned[owner[s]]
                assert list(table[s, :len(pages)]) == pages and (table[s, len(pages):] == pad).all()
        assert pad not in {p for ps_ in e.pool.owned.values() for p in ps_}
    finally:
        for r in [c.request for c in chunks] + decodes:
            e.pool.release(r.request_id)
        e.pool.end_step()


@torch.inference_mode()    # as the runner replays (a loaded step's decode rows are merged in place, out=)
def test_many_decode_rows_are_few_sequences_of_the_variable_length_call(graph_emulation):
    """More decode rows than Q_TILE (70): the variable-length call sees them as two sequences (64 and 6 queries, one
    key of the pad page each) where it saw 70; the decode call's table rows hold their pages, and a later step with
    fewer decode rows (10) puts the pad page back in the rows it no longer uses. The emulated replay's logits are
    the eager step's."""
    with pytest.MonkeyPatch.context() as mp:
        graph_emulation(mp, prefill=True)
        e = Engine(lineage_config("fused", chunk_tokens=128, max_batch=80, cuda_graphs=True, max_model_len=256,
                                  num_pages=400, progress=False))
    runner, sg, ps, pad = e.runner, e.runner.step_graphs, e.pool.page_size, e.runner.pad_page
    reqs = []
    try:
        for i in range(70):
            r = Request(f"d{i}", [3 + (i + j) % 50 for j in range(20 + i)], 8)
            e.pool.reserve(r.request_id, r.slots_needed)
            r.state, r.num_cached, r.output = State.DECODE, 20 + i, [5]
            reqs.append(r)
        c = Request("c", [7 + j % 40 for j in range(100)], 8)
        e.pool.reserve(c.request_id, c.slots_needed)
        c.state = State.PREFILL
        chunk = Chunk(c, 0, 100)
        for n in (70, 10):
            decodes = reqs[:n]
            b = sg.bucket_for([chunk], decodes)
            sg.fill([chunk], decodes, e.pool.owned, b)
            hv, nd = sg.host_view, -(-n // Q_TILE)
            q = np.diff(hv["cu_q"][:sg.seqs_for(b) + 1])
            assert list(q[:nd]) == [min(Q_TILE, n - Q_TILE * s) for s in range(nd)]
            assert list(hv["kv_lens"][:nd]) == [1] * nd and (hv["table"][sg.R:sg.R + nd] == pad).all()
            assert list(q[nd:nd + 2]) == [64, 36] and hv["kv_lens"][nd + 1] == 100      # the chunk's two pieces
            lead_table = hv["table"][:sg.R]
            for i, r in enumerate(decodes):
                pages = e.pool.owned[r.request_id]
                assert list(lead_table[i, :len(pages)]) == pages and (lead_table[i, len(pages):] == pad).all()
            assert (lead_table[n:] == pad).all()
            graphed = sg.replay([chunk], decodes, e.pool.owned).clone()
            eager = runner.forward([chunk], decodes, e.pool.owned)
            torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    finally:
        for r in reqs + [c]:
            e.pool.release(r.request_id)
        e.pool.end_step()


@torch.inference_mode()    # as the runner replays (a loaded step's decode rows are merged in place, out=)
def test_replay_picks_the_decode_call_width(emulated_engine):
    """A loaded step replays the graph of the narrowest captured width that holds its decode rows' lengths (the
    split-KV kernel divides the width among its splits); a chunk-only step the graph without a decode call."""
    e = emulated_engine
    sg, ps = e.runner.step_graphs, e.pool.page_size
    assert {w for _, w in sg.keys} == {0, *sg.widths} and len(sg.widths) > 1
    reqs = []
    try:
        def request(name, cached, state):
            r = Request(name, [3 + j % 50 for j in range(cached + 1)], 8)
            e.pool.reserve(r.request_id, r.slots_needed)
            r.state, r.num_cached, r.output = state, cached, [5]
            reqs.append(r)
            return r
        chunk = Chunk(request("c", 0, State.PREFILL), 0, 16)
        sg.replay([chunk], [], e.pool.owned)
        assert sg.last_key[1] == 0
        short = request("short", sg.widths[0] * ps - 2, State.DECODE)       # its next position fills the page
        sg.replay([chunk], [short], e.pool.owned)
        assert sg.last_key[1] == sg.widths[0]
        longer = request("longer", sg.widths[0] * ps, State.DECODE)          # one page more
        sg.replay([chunk], [short, longer], e.pool.owned)
        assert sg.last_key[1] == sg.widths[1]
    finally:
        for r in reqs:
            e.pool.release(r.request_id)
        e.pool.end_step()


def test_construction_reports_graphs_and_memory(graph_emulation, monkeypatch, capsys):
    graph_emulation(monkeypatch, prefill=True)
    Engine(lineage_config("fused", chunk_tokens=128, max_batch=MAX_BATCH, cuda_graphs=True, max_model_len=256,
                          num_pages=40, progress=True))
    err = capsys.readouterr().err
    assert "decode step shapes emulated" in err and "loaded/chunk-only step shapes emulated" in err, err
    assert "memory:" in err and "MiB" in err


# -- graphed vs eager ------------------------------------------------------------------------------------------
def test_step_graphs_match_eager(mode):
    eager_ref, eager = eager_run(mode)
    ref, graphed = run(mode, True)
    e = ref.last_engine
    sg = e.runner.step_graphs
    n = graphed_kinds(e)
    assert sg is not None and sg.replays == n > 0 and sg.fallbacks == 0, (sg and sg.replays, n)
    assert sg.capture_graphs == (mode["device"] != "cpu")
    report = compare("step graphs vs eager", eager, graphed, eager_ref.score, check_steps=True)  # its 0.02 rule
    assert report.ok, report.problems()
    assert e.pool.num_free == e.pool.capacity


def plant_stale(monkeypatch, section: str):
    """The plant: metadata kept per bucket and not refreshed when the bucket comes again. Every refresh rewrites
    the buffer, then puts back `section` as the bucket's first replay left it: the same shapes and totals (the
    query offsets still end at the bucket), stale contents (piece boundaries, histories or pages of other steps)."""
    fill = StepGraphs.fill

    def stale_fill(self, chunks, decodes, pages_of, b):
        n = fill(self, chunks, decodes, pages_of, b)
        kept = self.__dict__.setdefault("_kept", {})
        if b not in kept:
            kept[b] = self.host_view[section].copy()
        else:
            self.host_view[section][:] = kept[b]
            self.upload()
        return n

    monkeypatch.setattr(StepGraphs, "fill", stale_fill)


CHILD_ENV = "STEPGATE_STALE_CHILD"


def crashes_contained(request) -> bool:
    """Run this test in a child process (True: this one is done) where a CUDA fault would end the test process: a
    stale history of 0 under a piece's queries takes flash-attn's split-KV kernel down its early exit, whose LSE
    write ignores the variable-length layout (Dao-AILab/flash-attention issue 2842): an illegal memory access on the
    H100 in session 34, which poisons the CUDA context for every later test. Caught either way: the child fails the
    comparison (its own assertion), or dies of that fault; anything else fails here."""
    if os.environ.get(CHILD_ENV):
        return False
    r = subprocess.run([sys.executable, "-m", "pytest", request.node.nodeid, "--device", "cuda", "-q",
                        "-p", "no:cacheprovider"], cwd=REPO, env={**os.environ, CHILD_ENV: "1"},
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 or "illegal memory access" in out, \
        f"the child run of {request.node.nodeid} neither caught the plant nor faulted:\n{out[-3000:]}"
    return True


@pytest.mark.parametrize("section", ["cu_q", "table", "kv_lens", "lead_kv", "decode_rows"])
def test_stale_metadata_is_caught(mode, monkeypatch, section, request):
    if mode["device"] == "cuda" and section == "kv_lens" and crashes_contained(request):
        return
    mode = plant_mode(mode)
    eager_ref, eager = eager_run(mode)
    plant_stale(monkeypatch, section)
    try:
        _, graphed = run(mode, True)
    except PoisonedLogitsError as e:     # poison mode names the step, the requests and their pages
        assert "non-finite logits" in str(e) and "pages" in str(e), str(e)
        return
    report = compare("step graphs vs eager", eager, graphed, eager_ref.score, check_steps=True)  # its 0.02 rule
    assert not report.ok, f"a stale {section} section in the captured step's static buffer went unnoticed"


def test_poison_catches_an_overread_in_a_captured_step(mode, monkeypatch):
    """Poison mode with captured steps: a replay whose decode rows read one slot past their history (a slot never
    written, NaN) fails the step, naming it as a loaded or chunk-only step."""
    fill = StepGraphs.fill

    def overread(self, chunks, decodes, pages_of, b):
        n = fill(self, chunks, decodes, pages_of, b)
        if decodes:         # the decode call's lengths (the decode rows are the first packed rows)
            self.host_view["lead_kv"][:len(decodes)] += 1
            self.upload()
        return n

    monkeypatch.setattr(StepGraphs, "fill", overread)
    with pytest.raises(PoisonedLogitsError, match=r"\(loaded\): non-finite logits"):
        run(mode, True)
