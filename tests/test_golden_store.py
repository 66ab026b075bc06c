"""The golden store: atomic regeneration that reports what moved, and gate runs that never write goldens."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import workload as wl_mod
from engine.runner import ModelRunner
from engine.workload import Workload
from gates.compare import TIE_THRESHOLD
from gates.golden import golden_path, read_golden, regenerate
from gates.parity import parity

TINY = Workload("tiny", (4, 40), (4, 8), 4, chunk_tokens=32)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(wl_mod.WORKLOADS, "tiny", TINY)
    return "tiny"


def test_regen_is_atomic_and_reports_identical(tiny, tmp_path):
    lines = []
    assert regenerate("small", tiny, "fused", "cpu", "float32", tmp_path, out=lines.append) is None
    base = golden_path(tmp_path, "small", tiny, "fused", "cpu", "float32")
    records, meta = read_golden(base)
    assert len(records) == 4 and meta["reference"]["name"] == "fused" and meta["dtype"] == "float32"
    assert all(r.steps is not None for r in records.values()), "engine goldens record steps"
    report = regenerate("small", tiny, "fused", "cpu", "float32", tmp_path, out=lines.append)
    assert report.counts() == {"identical": 4, "flipped": 0, "failed": 0}
    assert "4 identical, 0 flipped, 0 changed beyond tolerance" in lines[-1]
    assert not [p for p in base.parent.iterdir() if p.name.endswith(".tmp")], "a temporary file was left behind"


def test_regen_after_a_change_says_what_moved(tiny, tmp_path, monkeypatch):
    regenerate("small", tiny, "fused", "cpu", "float32", tmp_path, out=lambda s: None)
    sample = ModelRunner.sample

    def changed(self, logits):       # an intended change that moves every request's second token
        logits = logits.clone()
        second = logits.topk(2, dim=-1).indices[:, 1]
        logits[range(len(logits)), second] += 100.0
        return sample(self, logits)

    monkeypatch.setattr(ModelRunner, "sample", changed)
    lines = []
    report = regenerate("small", tiny, "fused", "cpu", "float32", tmp_path, out=lines.append)
    assert report.counts()["failed"] == 4
    assert "changed beyond tolerance" in lines[-1] and "changed tiny-0000 position 0" in lines[-1]


def test_parity_counts_by_prompt_length(tiny, tmp_path):
    from gates.reference import EngineReference
    ref = EngineReference("fused", chunk_tokens=32)
    a = ref.generate(TINY.requests())
    b = {k: v for k, v in a.items()}
    rep = parity(a, b, ref.score, TIE_THRESHOLD)
    assert sum(r["requests"] for r in rep["by_prompt_length"].values()) == 4
    assert all(r["differ"] == 0 for r in rep["by_prompt_length"].values())


def test_a_plain_gate_run_never_writes_goldens():
    golden = REPO / "golden" / "qwen2-small"
    before = {p: p.stat().st_mtime_ns for p in golden.rglob("*") if p.is_file()}
    r = subprocess.run([sys.executable, "-m", "pytest", "gates/test_tokens.py", "-q", "-p", "no:cacheprovider",
                        "-k", "test_against_hf and fused-torch and uniform", "--gate-summary", os.devnull],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:]
    after = {p: p.stat().st_mtime_ns for p in golden.rglob("*") if p.is_file()}
    assert before == after, "a plain gate run wrote to golden/"


def test_gate_summary_is_on_disk_after_every_gate(tmp_path, monkeypatch):
    """A run cut short (a CI timeout) still leaves the summary of the gates it finished."""
    import json

    from gates import summary
    from gates.compare import compare
    from gates.records import GenRecord
    path = tmp_path / "gate-summary.json"
    monkeypatch.setattr(summary, "REPORTS", [])
    monkeypatch.setattr(summary, "PATH", path)
    rec = {"r": GenRecord("r", [5, 6], [7, 8], [[7, 1], [8, 1]], [[3.0, 1.0], [3.0, 1.0]], [0, 1])}
    summary.record(compare("first", rec, rec, None))
    assert [g["gate"] for g in json.loads(path.read_text())] == ["first"]
    bad = {"r": GenRecord("r", [5, 6], [9, 8], [[9, 7], [8, 1]], [[3.0, 1.0], [3.0, 1.0]], [0, 1])}
    summary.record(compare("second", rec, bad, None))
    got = json.loads(path.read_text())
    assert [(g["gate"], g["ok"]) for g in got] == [("first", True), ("second", False)]


def test_parity_offline_compares_two_goldens_without_an_engine(capsys):
    """GPU goldens can be compared on a CPU: no live engine, first differences judged from the stored logits."""
    from gates.parity import main
    assert main(["--a", "golden:hf", "--b", "golden:fused", "--workload", "uniform-cpu", "--offline"]) == 0
    out = capsys.readouterr().out
    assert "golden:fused against golden:hf on uniform-cpu" in out and "     64        48" in out
