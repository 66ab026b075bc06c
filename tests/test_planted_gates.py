"""Planted bugs that the token and poison gates must catch, each failing with the message the gate promises:
request, position, both tokens, both gaps and the recent context, then where the token was computed and a triage
verdict that names the cause (or, for a stale read, the step, the reader, the slot read and whose it was)."""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil

import pytest

from engine import Engine, EngineConfig, PoisonedLogitsError
from engine.runner import ModelRunner
from engine.workload import MIXED_CPU, RequestSpec
from engine.loader import model_checksum
from gates.compare import compare
from gates.golden import GoldenError, golden_path, read_golden
from gates.reference import EngineReference, HFReference
from gates.triage import ALWAYS, failure_message
from kernels.torch_backend import TorchBackend
from tests import plants

SUBSET = MIXED_CPU.scaled(12)     # the first 12 requests of the golden workload


@pytest.fixture(scope="module")
def golden():
    records, _ = read_golden(golden_path(None, "small", "mixed-cpu", "hf", "cpu", "float32"))
    return records


@pytest.fixture(scope="module")
def hf():
    return HFReference()


def gate(golden, hf, engine="fused", **overrides):
    return run_gate(golden, hf, SUBSET.requests(), engine, chunk_tokens=SUBSET.chunk_tokens, **overrides)[0]


def run_gate(golden, hf, specs, engine="fused", **overrides):
    """The token gate on `specs` against `golden`: (report, its failure message with provenance and triage)."""
    ref = EngineReference(engine, poison=True, **overrides)
    cand = ref.generate(specs)
    gold = {s.request_id: golden[s.request_id] for s in specs}
    report = compare("planted", gold, cand, hf.score, 0.02, 3)
    return report, (lambda: failure_message(report, ref.last_engine, gold, hf.score))


def verdict_of(msg: str) -> str:
    m = re.search(r"^verdict: (.*)$", msg, re.M)
    assert m, f"no triage verdict in:\n{msg}"
    return m.group(1)


def assert_triaged(message, verdict: str, row: str) -> str:
    """The gate's message names where the token was computed (`row`: decode row / prompt chunk) and the verdict."""
    msg = message()
    for part in ("provenance:", "was computed at step", row, "in page", "slot", "backend torch", "triage of",
                 "alone:", "unchunked"):
        assert part in msg, f"{part!r} missing from:\n{msg}"
    assert verdict_of(msg).startswith(verdict), msg
    return msg


def assert_caught(report):
    assert not report.ok, "the gate passed on a planted bug"
    msg = report.problems()[0]
    for part in ("position", "reference token", "candidate token", "gap in reference logits", "context"):
        assert part in msg, msg
    return msg


def assert_caught_in_decode_rows(golden, hf, cause: str) -> str:
    """A bug in decode rows that needs no batch: caught, traced to a decode row, and triaged "always" (the prefix
    read as a prompt passes) with `cause`: the one change of the reference that reproduces the candidate's logits.
    Returns the first problem."""
    report, message = run_gate(golden, hf, SUBSET.requests(), chunk_tokens=SUBSET.chunk_tokens)
    first = assert_caught(report)
    msg = assert_triaged(message, f"always: {cause}", "from a decode row")
    assert "in decode rows only" in verdict_of(msg), msg
    return first


def test_unplanted_subset_passes(golden, hf):
    report = gate(golden, hf)
    assert report.ok, report.problems()


def test_decode_row_with_wrong_rotary_position_is_caught(golden, hf, monkeypatch):
    plants.rotary(monkeypatch)
    assert_caught_in_decode_rows(golden, hf, "a decode row's rotary position (the reference with its decode rows +1")


def test_cache_length_off_by_one_is_caught(golden, hf, monkeypatch):
    plants.cache_len(monkeypatch)
    # batch-free, prompt-chunk-free like a rotary bug: only the probe's changes of the reference tell them apart
    assert_caught_in_decode_rows(golden, hf, "a decode row's cache length (the reference with each decode row blind")


def test_decode_rows_choosing_their_runner_up_are_caught(golden, hf, monkeypatch):
    plants.token_choice(monkeypatch)
    assert "not a near tie under 0.02" in assert_caught_in_decode_rows(golden, hf, "token choice (every top-k logit")


def test_prompt_chunks_after_the_first_at_shifted_positions_are_caught(golden, hf, monkeypatch):
    plants.chunk_position(monkeypatch)
    report, message = run_gate(golden, hf, SUBSET.requests(), chunk_tokens=SUBSET.chunk_tokens)
    assert_caught(report)
    msg = assert_triaged(message, "only when its prompt is chunked", "from its last prompt chunk")
    assert re.search(r"unchunked: passes \[chunk_tokens=\d+\]", msg), msg


def test_decode_rows_reading_the_previous_rows_block_table_are_caught_only_batched(hf, monkeypatch):
    """Row i reads row i-1's history (of at least its own length: prompts in decreasing length, so no poisoned
    slot is read and only the numbers change)."""
    specs = [RequestSpec(f"batched-{i}", [(37 * i + 11 * k) % 3000 + 3 for k in range(n)], 10)
             for i, n in enumerate((40, 32, 24, 16))]
    golden = hf.generate(specs)
    plants.stale_read(monkeypatch)
    report, message = run_gate(golden, hf, specs, chunk_tokens=128)
    assert_caught(report)
    assert report.failures[0].request_id != "batched-0", "row 0 reads its own table: it must pass"
    msg = assert_triaged(message, "only when batched with", "from a decode row")
    mates = verdict_of(msg).removeprefix("only when batched with ")
    rid = report.failures[0].request_id
    assert set(mates.split(", ")) == {s.request_id for s in specs} - {rid}, msg


def test_decode_kernel_reading_one_slot_past_the_length_is_caught_by_poison(monkeypatch):
    plants.read_past_length(monkeypatch)      # the mask still hides the extra slot: poison must catch the read
    reads = ModelRunner.poisoned_reads
    monkeypatch.setattr(ModelRunner, "poisoned_reads", lambda self, *a: reads(self, *a, max_reads=3))
    with pytest.raises(PoisonedLogitsError) as e:
        EngineReference("fused", poison=True, chunk_tokens=128).generate(SUBSET.requests())
    msg, x = str(e.value), e.value
    assert "non-finite logits" in msg and "pages [" in msg and "step " in msg
    # the read past the length comes first; the chunk's own history, written NaN by the step before (whose chunk
    # read past its length too), after it
    assert x.owner.startswith(f"owned by {x.reader} (position ") and ", never written (" in x.owner, msg
    assert f"written with NaN at step {x.step - 1} (layers past the first)" in msg, msg
    assert len(x.reads) == 3 and len({s // 64 for s in x.reads}) == 3, msg


SHORT = [RequestSpec(f"short-{i}", [(53 * i + 7 * k) % 3000 + 3 for k in range(n)], 8) for i, n in enumerate((24, 9))]


def test_a_decode_bug_in_one_backend_is_caught_only_under_it(hf, monkeypatch):
    import kernels

    class Skewed(TorchBackend):
        name = "skewed"

        def decode(self, q, k_cache, v_cache, batch, scale):
            return super().decode(q, k_cache, v_cache, batch, scale * 1.5)

    golden = hf.generate(SHORT)
    monkeypatch.setitem(kernels.BACKENDS, "skewed", Skewed)
    report, message = run_gate(golden, hf, SHORT, backend="skewed", chunk_tokens=128)
    assert_caught(report)
    msg = message()
    assert verdict_of(msg) == "only under backend skewed (torch passes)", msg
    assert "backend torch: passes [backend=torch]" in msg and "backend skewed," in msg


def test_a_bug_only_in_replayed_decode_graphs_is_caught_only_with_graphs(hf, monkeypatch):
    """CPU-emulated graphs (tests/test_graph_buffers.py): a refresh that feeds every row one position late."""
    from engine.graphs import DecodeGraphs
    monkeypatch.setattr(TorchBackend, "graph_safe_decode", True)
    monkeypatch.setattr(Engine, "use_cuda_graphs", staticmethod(lambda config: bool(config.cuda_graphs)))
    fill = DecodeGraphs.fill

    def late(self, decodes, pages_of):
        need = fill(self, decodes, pages_of)
        self.view["positions"][:len(decodes)] += 1
        self.dev.copy_(self.host)
        return need

    golden = hf.generate(SHORT)
    monkeypatch.setattr(DecodeGraphs, "fill", late)
    report, message = run_gate(golden, hf, SHORT, chunk_tokens=128, cuda_graphs=True, max_model_len=64,
                               progress=False)
    assert_caught(report)
    msg = message()
    assert "a pure-decode step (a replayed CUDA graph)" in msg and "CUDA graphs on" in msg, msg
    assert "CUDA graphs off: passes [cuda_graphs=False]" in msg, msg
    assert verdict_of(msg) == "only with CUDA graphs", msg


def test_decode_row_reading_a_finished_requests_block_table_names_the_slot_and_its_last_owner(monkeypatch):
    """Decode rows keep the block table of the first request they served (a stale row cache): once A finishes and B
    moves up to A's row, B reads A's freed, poisoned page. The error blames the read, not B's own pages."""
    plants.stale_row_cache(monkeypatch)
    e = Engine(EngineConfig(poison=True, chunk_tokens=128, num_pages=8))
    with pytest.raises(PoisonedLogitsError) as err:
        e.run([RequestSpec("A", list(range(3, 23)), 4), RequestSpec("B", list(range(30, 40)), 10)])
    x, a_pages = err.value, e.requests["A"].pages
    freed_at = e.requests["A"].token_steps[-1]          # A's last token: its pages went back at that step's end
    assert x.reader == "B" and x.rows == ["B"] and x.step == freed_at + 1
    assert x.page in a_pages and x.slot // 64 == x.page and x.page not in e.requests["B"].pages
    assert x.owner.startswith("last owned by A (position ") and f"freed at the end of step {freed_at}" in x.owner
    assert f"B read slot {x.slot} (page {x.page}): last owned by A" in str(x), str(x)


def test_poisoned_read_of_a_never_written_slot_names_its_owner_and_cached_length(monkeypatch):
    """A decode row that reads one slot past its length reads its own never-written slot."""
    plants.decode_one_past(monkeypatch)
    e = Engine(EngineConfig(poison=True, chunk_tokens=128, num_pages=8))
    with pytest.raises(PoisonedLogitsError) as err:
        e.run([RequestSpec("A", list(range(3, 23)), 4)])
    x = err.value
    # step 1 decodes position 20 (its input token) and reads position 21, never written
    assert x.reader == "A" and x.step == 1 and x.slot == e.requests["A"].pages[0] * 64 + 21
    assert x.owner == "owned by A (position 21), never written (A has cached 21 positions, this step's included)"
    assert x.reads == [x.slot] and "also read NaN in other pages" not in str(x), str(x)


def test_golden_edited_by_hand_is_caught(golden, hf, tmp_path):
    src = golden_path(None, "small", "mixed-cpu", "hf", "cpu", "float32")
    dst = tmp_path / "hf-cpu-float32"
    for suffix in (".meta.json", ".json.gz"):
        shutil.copy(src.with_suffix(suffix), dst.with_suffix(suffix))
    data = json.loads(gzip.decompress(dst.with_suffix(".json.gz").read_bytes()))
    data["requests"][0]["tokens"][3] = (data["requests"][0]["tokens"][3] + 1) % 4096
    edited = gzip.compress(json.dumps(data).encode(), mtime=0)
    dst.with_suffix(".json.gz").write_bytes(edited)
    with pytest.raises(GoldenError, match="edited by hand or is corrupt; regenerate it with"):
        read_golden(dst, "python -m gates.golden regen")
    # an editor who also fixed the checksum is caught by the comparison itself
    meta = json.loads(dst.with_suffix(".meta.json").read_text())
    meta["data_sha256"] = hashlib.sha256(edited).hexdigest()
    dst.with_suffix(".meta.json").write_text(json.dumps(meta))
    records, _ = read_golden(dst)
    specs = SUBSET.requests()
    cand = EngineReference("fused", poison=True, chunk_tokens=128).generate(specs[:1])
    report = compare("edited", {specs[0].request_id: records[specs[0].request_id]}, cand, hf.score, 0.02, 3)
    msg = assert_caught(report)
    assert "position 3" in msg


def test_golden_of_another_model_is_stale():
    base = golden_path(None, "small", "mixed-cpu", "hf", "cpu", "float32")
    read_golden(base, model_checksum=model_checksum(None))          # the committed golden matches the model
    with pytest.raises(GoldenError, match="was made for model .* but the model now is 0123: it is stale"):
        read_golden(base, "python -m gates.golden regen", model_checksum="0123")


def test_missing_golden_names_the_file_and_how_to_regenerate(tmp_path):
    with pytest.raises(GoldenError, match=r"missing .*regenerate it with: python -m gates.golden regen"):
        read_golden(tmp_path / "nope", "python -m gates.golden regen --workload x")


def test_the_probe_names_a_change_only_when_it_reproduces_the_candidates_logits():
    """diagnose() picks the change of the reference that leaves the smallest error on the candidate's top-k, and
    only when that is a small share of the unchanged error; otherwise the verdict stays the open "always"."""
    import torch
    from gates.triage import Variant, diagnose, verdict

    def probe(prefix, decode_from, shift=0, blind_to_self=False):      # logits of a toy reference
        return torch.arange(8.0) * (1 + shift) + 3.0 * blind_to_self

    shifted = probe([1, 2], 1, shift=1)
    assert diagnose(probe, [1, 2], 1, ([7, 6], shifted[[7, 6]].tolist())).startswith(
        "a decode row's rotary position (the reference with its decode rows +1")
    blind = probe([1, 2], 1, blind_to_self=True)
    assert diagnose(probe, [1, 2], 1, ([7, 6], blind[[7, 6]].tolist())).startswith("a decode row's cache length")
    assert diagnose(probe, [1, 2], 1, ([5, 7], [9.0, 7.0])).startswith("token choice (every top-k logit but the "
                                                                      "emitted token 5's")
    assert diagnose(probe, [1, 2], 1, ([7, 6], [-40.0, 50.0])) is None
    variants = [Variant("alone", False, "fails"), Variant("prefix as a prompt", True, "passes")]
    assert verdict(variants, "torch", [], 3, None) == ALWAYS + " (in decode rows only: the same prefix read as a " \
                                                             "prompt passes)"
