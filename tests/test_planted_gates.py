"""Planted bugs that the token and poison gates must catch, each failing with the message the gate promises:
request, position, both tokens, both gaps and the recent context (or, for a stale read, the step, the requests
and their pages)."""
from __future__ import annotations

import gzip
import hashlib
import json
import shutil

import pytest

from engine import PoisonedLogitsError
from engine.workload import MIXED_CPU
from engine.loader import model_checksum
from gates.compare import compare
from gates.golden import GoldenError, golden_path, read_golden
from gates.reference import EngineReference, HFReference
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
    specs = SUBSET.requests()
    ref = EngineReference(engine, poison=True, chunk_tokens=SUBSET.chunk_tokens, **overrides)
    cand = ref.generate(specs)
    return compare("planted", {s.request_id: golden[s.request_id] for s in specs}, cand, hf.score, 0.02, 3)


def assert_caught(report):
    assert not report.ok, "the gate passed on a planted bug"
    msg = report.problems()[0]
    for part in ("position", "reference token", "candidate token", "gap in reference logits", "context"):
        assert part in msg, msg
    return msg


def test_unplanted_subset_passes(golden, hf):
    report = gate(golden, hf)
    assert report.ok, report.problems()


def test_decode_row_with_wrong_rotary_position_is_caught(golden, hf, monkeypatch):
    plants.rotary(monkeypatch)
    assert_caught(gate(golden, hf))


def test_cache_length_off_by_one_is_caught(golden, hf, monkeypatch):
    plants.cache_len(monkeypatch)
    assert_caught(gate(golden, hf))


def test_sampling_change_that_flips_a_non_tie_is_caught(golden, hf, monkeypatch):
    plants.token_choice(monkeypatch, at=25)       # once, the runner-up of a row
    msg = assert_caught(gate(golden, hf))
    assert "not a near tie under 0.02" in msg


def test_decode_kernel_reading_one_slot_past_the_length_is_caught_by_poison(monkeypatch):
    plants.read_past_length(monkeypatch)      # the mask still hides the extra slot: poison must catch the read
    with pytest.raises(PoisonedLogitsError) as e:
        EngineReference("fused", poison=True, chunk_tokens=128).generate(SUBSET.requests())
    msg = str(e.value)
    assert "non-finite logits" in msg and "pages [" in msg and "step " in msg


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
