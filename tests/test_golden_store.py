"""The golden store: atomic regeneration that reports what moved (per request, named, with the largest logit move),
`--check` that writes nothing, file modes, an unwritable folder found before generating, and gate runs that never
write goldens."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import workload as wl_mod
from engine.runner import ModelRunner
from engine.workload import Workload
from gates import golden as golden_mod
from gates.compare import TIE_THRESHOLD, compare
from gates.golden import (GOLDEN_DIR, GoldenError, describe_changes, golden_path, read_golden, regen_command,
                          regenerate, write_golden)
from gates.records import GenRecord
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
    assert "4 identical, 0 flipped, 0 changed beyond tolerance, 0 with tokens emitted at other steps" in lines[-1]
    assert "identical: tiny-0000..0003" in lines[-1] and "largest logit move: 0.0000 at tiny-" in lines[-1]
    assert not [p for p in base.parent.iterdir() if p.name.endswith(".tmp")], "a temporary file was left behind"


def test_regen_after_a_change_says_what_moved(tiny, tmp_path, monkeypatch):
    regenerate("small", tiny, "fused", "cpu", "float32", tmp_path, out=lambda s: None)
    sample = ModelRunner.sample_async

    def changed(self, logits):       # an intended change that moves every request's second token
        logits = logits.clone()
        second = logits.topk(2, dim=-1).indices[:, 1]
        logits[range(len(logits)), second] += 100.0
        return sample(self, logits)

    monkeypatch.setattr(ModelRunner, "sample_async", changed)
    lines = []
    report = regenerate("small", tiny, "fused", "cpu", "float32", tmp_path, out=lines.append)
    assert report.counts()["failed"] == 4
    assert "changed beyond tolerance" in lines[-1] and "changed tiny-0000 position 0" in lines[-1]


def test_regen_check_reports_and_writes_nothing(tiny, tmp_path, monkeypatch, capsys):
    """`regen --check`: exit 1 on a missing golden or a change beyond tolerance, 0 when nothing moved; never a
    write (the folder is not even created)."""
    args = ["regen", "--check", "--workload", tiny, "--reference", "fused", "--golden-dir", str(tmp_path / "g")]
    assert golden_mod.main(args) == 1
    assert "no usable previous golden" in capsys.readouterr().out and not (tmp_path / "g").exists()
    regenerate("small", tiny, "fused", "cpu", "float32", tmp_path / "g", out=lambda s: None)
    base = golden_path(tmp_path / "g", "small", tiny, "fused", "cpu", "float32")
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in base.parent.iterdir()}
    assert golden_mod.main(args) == 0
    out = capsys.readouterr().out
    assert "nothing written" in out and "4 identical" in out
    sample = ModelRunner.sample_async
    monkeypatch.setattr(ModelRunner, "sample_async", lambda self, logits: sample(self, -logits))   # a changed engine
    assert golden_mod.main(args) == 1
    assert "  changed tiny-0000 position" in capsys.readouterr().out
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in base.parent.iterdir()} == files


def test_an_unwritable_golden_folder_fails_before_generating(tiny, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the golden folder should be")      # unwritable even for root

    def no_generation(*a, **k):
        raise AssertionError("generated before finding that the folder is unwritable")
    monkeypatch.setattr(golden_mod, "generate", no_generation)
    with pytest.raises(GoldenError, match=r"cannot write goldens to .*not-a-folder.*nothing was generated"):
        regenerate("small", tiny, "fused", "cpu", "float32", blocker, out=lambda s: None)
    rc = golden_mod.main(["regen", "--workload", tiny, "--reference", "fused", "--golden-dir", str(blocker)])
    assert rc == 2 and "cannot write goldens to" in capsys.readouterr().err


def test_a_regen_without_workloads_also_writes_the_smoke_gates_hf_golden(tmp_path, monkeypatch):
    done = []
    monkeypatch.setattr(golden_mod, "regenerate", lambda model, wl, ref, *a, **k: done.append((wl, ref)))
    assert golden_mod.main(["regen", "--reference", "hf", "--reference", "fused", "--golden-dir", str(tmp_path)]) == 0
    assert done == [("mixed-cpu", "hf"), ("mixed-cpu", "fused"), ("uniform-cpu", "hf"), ("uniform-cpu", "fused"),
                    ("smoke-cpu", "hf")]
    done.clear()
    assert golden_mod.main(["regen", "--reference", "fused", "--golden-dir", str(tmp_path)]) == 0
    assert ("smoke-cpu", "fused") not in done and done


def two_positions(token: int) -> GenRecord:
    return GenRecord("r", [1, 2], [token, 4], [[token, 9], [4, 9]], [[2.0, 1.0], [2.0, 1.0]], [0, 1])


# -- a golden of the wrong shape (valid JSON; for the data file, its checksum recomputed) ----------------------------
def rewrite_data(base: Path, payload) -> None:
    """Replace a golden's data and recompute the checksum in its metadata, as a careful hand edit would."""
    import gzip
    import hashlib
    import json
    data = gzip.compress(json.dumps(payload).encode(), mtime=0)
    base.with_suffix(".json.gz").write_bytes(data)
    meta_p = base.with_suffix(".meta.json")
    meta = json.loads(meta_p.read_text())
    meta_p.write_text(json.dumps({**meta, "data_sha256": hashlib.sha256(data).hexdigest()}))


@pytest.mark.parametrize("text, what", [("null", "null"), ("[]", "a list"), ('"text"', r'a string \("text"\)'),
                                        ("5", r"a number \(5\)")])
def test_metadata_of_the_wrong_shape_is_a_golden_error(tmp_path, text, what):
    base = tmp_path / "g" / "hf-cpu-float32"
    write_golden(base, {"r": two_positions(3)}, {})
    base.with_suffix(".meta.json").write_text(text)
    with pytest.raises(GoldenError, match=rf"^golden metadata {base}\.meta\.json is corrupt: it holds {what}, not an "
                                          rf"object of fields; regenerate it with: REGEN$"):
        read_golden(base, "REGEN")


def good_request() -> dict:
    return two_positions(3).to_json()


WRONG_DATA = {
    "requests-null": ({"requests": None}, r"requests is null, not a list of requests"),
    "top-level-list": ([good_request()], r"the top level is a list, not an object with \"requests\""),
    "request-not-object": ({"requests": [5]}, r"requests\[0\] is a number \(5\), not an object"),
    "no-tokens": ({"requests": [{k: v for k, v in good_request().items() if k != "tokens"}]},
                  r"requests\[0\] has no tokens"),
    "prompt-text": ({"requests": [{**good_request(), "prompt": "12"}]},
                    r"requests\[0\]\.prompt is a string \(\"12\"\), not a list of token ids"),
    "id-number": ({"requests": [{**good_request(), "request_id": 7}]},
                  r"requests\[0\]\.request_id is a number \(7\), not a string of its own"),
    "topk-short": ({"requests": [{**good_request(), "topk_ids": [[3, 9]]}]},
                   r"requests\[0\]\.topk_ids is a list, not a list of 2 rows \(one per token\)"),
    "topk-row-null": ({"requests": [{**good_request(), "topk_vals": [[2.0, 1.0], None]}]},
                      r"requests\[0\]\.topk_vals\[1\] is null, not a non-empty list of logits"),
    "steps-text": ({"requests": [{**good_request(), "steps": "01"}]},
                   r"requests\[0\]\.steps is a string \(\"01\"\), not null or a list of 2 step indices"),
}


@pytest.mark.parametrize("name", sorted(WRONG_DATA))
def test_data_of_the_wrong_shape_is_a_golden_error_naming_the_field(tmp_path, name):
    payload, field = WRONG_DATA[name]
    base = tmp_path / "g" / "hf-cpu-float32"
    write_golden(base, {"r": two_positions(3)}, {})
    assert read_golden(base)[0]["r"] == two_positions(3)          # the untouched golden reads back
    rewrite_data(base, payload)
    with pytest.raises(GoldenError, match=rf"^golden {base}\.json\.gz is corrupt: {field}"):
        read_golden(base)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_written_goldens_follow_the_umask_like_a_plain_file(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_golden(tmp_path / "g" / "hf-cpu-float32", {"r": two_positions(3)}, {})
    finally:
        os.umask(old)
    got = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "g").iterdir()}
    assert got == {"hf-cpu-float32.json.gz": mode, "hf-cpu-float32.meta.json": mode}


def test_regen_hint_carries_a_golden_dir_that_is_not_the_default(tmp_path):
    plain = regen_command("small", "mixed-cpu", "hf", "cpu", "float32")
    assert "--golden-dir" not in plain and plain == regen_command("small", "mixed-cpu", "hf", "cpu", "float32",
                                                                   GOLDEN_DIR)
    hint = regen_command("small", "mixed-cpu", "hf", "cpu", "float32", tmp_path)
    assert f"--dtype float32 --golden-dir {tmp_path}" in hint and f"--regen-golden --golden-dir {tmp_path}" in hint


def synthetic_goldens():
    """Seven requests, old and new: four identical (one with a top-k logit moved by 0.0084 and one with its emitted
    token's logit moved by 0.0030), a tie flip, a change beyond the tie rule, and tokens moved to later steps."""
    def rec(rid, tokens, steps=None):
        return GenRecord(rid, [1, 2], list(tokens), [[t, 50 + p, 60 + p] for p, t in enumerate(tokens)],
                         [[1.0, 0.5, 0.0] for _ in tokens], list(steps or range(len(tokens))))
    old = {f"r-{i:04d}": rec(f"r-{i:04d}", [3, 4, 5, 6]) for i in range(7)}
    new = {rid: rec(rid, r.tokens) for rid, r in old.items()}
    new["r-0001"].topk_vals[1][1] += 0.0084
    new["r-0002"].topk_vals[2][0] -= 0.003
    old["r-0004"].topk_ids[1], old["r-0004"].topk_vals[1] = [4, 9, 51], [1.0, 0.995, 0.5]
    new["r-0004"] = rec("r-0004", [3, 9, 5, 6])
    new["r-0004"].topk_ids[1], new["r-0004"].topk_vals[1] = [9, 4, 51], [1.0, 0.998, 0.5]
    new["r-0004"].topk_vals[2][1] += 5.0           # after the flip: another context, not a logit move
    new["r-0005"] = rec("r-0005", [3, 8, 5, 6])
    new["r-0005"].topk_ids[1], new["r-0005"].topk_vals[1] = [8, 4, 51], [2.0, 1.0, 0.5]
    new["r-0006"] = rec("r-0006", [3, 4, 5, 6], steps=[0, 2, 3, 4])
    return old, new


def test_regen_report_names_every_request_and_the_largest_logit_move():
    import torch
    old, new = synthetic_goldens()
    score = lambda prompt, tokens: torch.eye(64)[tokens]       # noqa: E731  forced over the new tokens, it agrees
    report = compare("regen", old, new, score, TIE_THRESHOLD, flip_cap=10 ** 9, check_steps=True)
    text = describe_changes(report, old, new)
    expected = [
        "4 identical, 1 flipped, 1 changed beyond tolerance, 1 with tokens emitted at other steps",
        "identical: r-0000..0003",
        "flipped r-0004@1: 4 -> 9 (gap 0.0050 in the old golden's logits, 0.0020 in the new; site ",
        "changed r-0005 position 1: reference token 4, candidate token 8",
        "moved r-0006: 3 token(s) emitted at other steps, the first at position 1: step 1 -> 2",
        "largest logit move: 0.0084 at r-0001@1 token 51: 42% of the 0.02 tie rule",
        "largest move of an emitted token's logit: 0.0030 at r-0002@2 token 5: 15% of the 0.02 tie rule"]
    for part in expected:
        assert part in text, f"{part!r} not in:\n{text}"
    assert golden_mod.changed(report)
    assert not golden_mod.changed(compare("regen", old, old, score, TIE_THRESHOLD, 10 ** 9))


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


def test_parity_offline_compares_two_goldens_without_an_engine(capsys):
    """GPU goldens can be compared on a CPU: no live engine, first differences judged from the stored logits."""
    from gates.parity import main
    assert main(["--a", "golden:hf", "--b", "golden:fused", "--workload", "uniform-cpu", "--offline"]) == 0
    out = capsys.readouterr().out
    assert "golden:fused against golden:hf on uniform-cpu" in out and "     64        48" in out


def test_a_golden_made_under_another_decode_kernel_is_reported_as_another_configuration(tmp_path):
    """A golden's meta records the reference engine's configuration as served (every None decided); a gate reading
    it under a configuration that now resolves otherwise (here: the decode kernel) fails, naming the field, both
    values and the command that regenerates it, instead of comparing against another engine's tokens."""
    import json
    import shutil

    from gates.runs import Runs
    from gates.options import read_options
    src = Path(__file__).resolve().parents[1] / "golden" / "qwen2-small" / "mixed-cpu"
    dst = tmp_path / "qwen2-small" / "mixed-cpu"
    dst.mkdir(parents=True)
    for f in src.glob("fused-cpu-float32.*"):
        shutil.copy(f, dst / f.name)
    opts = read_options({"--device": "cpu", "--dtype": None, "--backend": "all", "--engine": "all",
                         "--golden-dir": str(tmp_path), "--tie-threshold": 0.02, "--flip-cap": 3,
                         "--regen-golden": False, "--model": "small", "--allow-skipped-files": False, "--tp": 1,
                         "--decode-kernel": None}.__getitem__)
    records = Runs(opts).golden("fused", "mixed-cpu")       # as committed: the configuration it serves today
    assert len(records) == 48
    meta_path = dst / "fused-cpu-float32.meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["reference"]["config"]["decode_kernel"] == "gather", "goldens record the resolved decode kernel"
    meta["reference"]["config"]["decode_kernel"] = "packed"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(pytest.fail.Exception, match=r"made under another configuration of 'fused'.*"
                        r"decode_kernel: 'packed' -> 'gather'.*Regenerate it if the change was intended: "):
        Runs(opts).golden("fused", "mixed-cpu")
