"""The planted-bug harness: the plugin plants a named bug for a whole gate run and records the first failure; the
plant table classifies a run as caught by a gate, caught by the session, or not caught."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import plants

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import plant_table  # noqa: E402


def pytest_run(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_every_plant_plants_something_or_changes_the_command():
    for name, p in plants.PLANTS.items():
        assert p.patch is not None or p.args, name
        assert p.cause, name


def test_unknown_plant_is_a_usage_error():
    p = pytest_run("gates/test_smoke.py", "-p", "tests.plants", "--plant", "rotery")
    assert p.returncode == 4, p.stdout + p.stderr
    assert "--plant 'rotery': unknown plant; known: rotary, cache-len" in p.stderr


def test_a_plant_is_in_place_before_the_options_are_read():
    """The simulated GPU machine without flash-attn: the options must see a CUDA device (else the run stops on
    "sees no CUDA device" instead) and then refuse the missing backend with its reason."""
    p = pytest_run("gates/test_smoke.py", "-p", "tests.plants", "--plant", "missing-backend", "--device", "cuda")
    assert p.returncode == 4, p.stdout + p.stderr
    assert "every selected attention backend must run on CUDA" in p.stderr and \
        "  flash: flash-attn does not import" in p.stderr, p.stderr


def test_the_smoke_gate_catches_a_planted_rotary_bug_and_the_table_says_so(tmp_path, monkeypatch):
    """One real planted run, end to end: the plugin plants the bug, the smoke gate fails, the record names it."""
    smoke_only = plants.Plant("rotary, smoke gate only", plants.PLANTS["rotary"].cause, plants.rotary,
                              paths=("gates/test_smoke.py::test_smoke[fused-torch]",), number_changing=True)
    monkeypatch.setitem(plants.PLANTS, "rotary", smoke_only)
    r = plant_table.run_row(plant_table.Row("rotary", "rotary"), timeout=600, log_dir=tmp_path)
    log = next(tmp_path.glob("*.log")).read_text()
    assert r.caught and r.gate == "gates/test_smoke.py::test_smoke[fused-torch]", log[-3000:]
    assert r.named and r.exit == 1 and 0 < r.cpu < r.seconds + 60, log[-3000:]
    assert "not a near tie under 0.02" in log
    # the excerpt runs from where the token was computed to the triage's verdict
    assert re.match(r"provenance: smoke-cpu-\d+ position \d+ was computed at step \d+, a [\w-]+ step, from a "
                    r"decode row .* … verdict: always: a decode row's rotary position \(.*\(in decode rows only",
                    r.excerpt), r.excerpt
    row = plant_table.markdown([r], "header").splitlines()[-1]
    assert row.startswith("| `rotary` | rotary, smoke gate only | yes | `gates/test_smoke.py::test_smoke[fused-torch]` "
                          "|"), row


def test_cause_patterns_tell_a_read_of_another_requests_slot_from_a_read_of_ones_own():
    def poisoned(reader: str, owner: str, note: bool = True) -> str:
        return (f"E   PoisonedLogitsError: step 3 (pure-decode): non-finite logits for ['{reader}']: a kernel read\n"
                f"E     {reader} read slot 70 (page 1): owned by {owner} (position 6), never written\n" +
                ("E   in chunked[torch] on smoke-cpu: backend torch, forward chunked\n" if note else ""))
    stale, past = plants.PLANTS["stale-read"].cause, plants.PLANTS["read-past-length"].cause
    assert re.search(stale, poisoned("b", "a")) and not re.search(stale, poisoned("a", "a"))
    assert re.search(past, poisoned("a", "a")) and not re.search(past, poisoned("b", "a"))
    assert not re.search(past, poisoned("a", "a", note=False)), "a poisoned read must name its backend"
    assert plant_table.excerpt_of(poisoned("b", "a"), stale) == \
        "PoisonedLogitsError: step 3 (pure-decode): non-finite logits for ['b']: a kernel read … b read slot 70 " \
        "(page 1): owned by a (position 6), never written"


def test_the_table_says_which_plants_share_one_cause_pattern(monkeypatch):
    # rotary, cache length and token choice shared one pattern until triage's probe told them apart
    assert plant_table.shared_causes(["rotary", "cache-len", "token-choice", "chunk-position", "typo"]) == ""
    monkeypatch.setitem(plants.PLANTS, "rotary-again", plants.PLANTS["rotary"])
    note = plant_table.shared_causes(["rotary", "rotary-again", "typo"])
    assert note.strip() == "`rotary`, `rotary-again`: one cause pattern, so their messages name the same cause; " \
        "the table does not claim they are told apart from each other."


def test_a_poisoned_read_in_a_gate_run_names_the_configuration_it_ran_under(request, monkeypatch):
    """The engine's error names the step, the slot read, its page and owner, and the reader; the gates' run adds the
    backend (and the rest of the configuration) it ran under."""
    from engine import PoisonedLogitsError
    from gates.runs import Runs
    from gates.options import gate_options
    plants.stale_read(monkeypatch)
    with pytest.raises(PoisonedLogitsError) as e:       # this session's gate options: the defaults, on a CPU
        Runs(gate_options(request.config)).candidate("chunked", "torch", "smoke-cpu")
    assert str(e.value).startswith("step 1 (loaded): non-finite logits for ['smoke-cpu-0001']"), str(e.value)
    assert "smoke-cpu-0001 read slot 128 (page 2): owned by smoke-cpu-0000" in str(e.value)
    assert e.value.__notes__[-1] == ("in chunked[torch] on smoke-cpu: backend torch, forward chunked, page_size 64, "
                                     "chunk_tokens 128, cpu float32")


@pytest.mark.parametrize("rc,gate,caught", [(0, "not caught", False), (4, "(session, exit 4)", True),
                                            ("timeout", "not caught (timed out)", False)])
def test_a_run_without_a_failing_report_is_classified_by_its_exit(rc, gate, caught):
    r = plant_table.classify(plant_table.Row("typo", "typo"), None, rc, "ERROR: --engine 'fussed': unknown engine; "
                             "known: chunked, fused, flash", 0.0, 12.0, 3.0)
    assert (r.gate, r.caught) == (gate, caught)
    assert r.named is (True if caught else None)


def test_a_path_left_out_of_the_kernel_registry_fails_the_coverage_gate_naming_it(tmp_path):
    """The torch backend's decode kernel taken out of kernels.declared_paths: the kernel gate no longer checks it,
    the smoke gate's engines still decode with it, and the run fails (the session's coverage gate), naming it."""
    r = plant_table.run_row(plant_table.Row("registry-gap", "registry-gap"), timeout=600, log_dir=tmp_path)
    log = next(tmp_path.glob("*.log")).read_text()
    assert r.caught and r.gate == "(session, exit 1)" and r.named, log[-3000:]
    assert "stepgate path coverage gate: FAILED" in log and "passed" in log and "failed" not in log.split(
        "short test summary")[-1], log[-3000:]


def test_the_coverage_rules_name_each_path():
    """Taken but unchecked, and declared but never run, each named; a path checked but not taken is fine."""
    from engine.census import merge
    from gates.coverage import problems
    census = {}
    merge(census, [dict(kind="pure-decode", kernels=["a.decode.x+append"], mode="captured", bucket="8x16",
                        ahead=True, prefix_hit=False, steps=5),
                   dict(kind="loaded", kernels=["a.prefill.p", "a.decode.x"], mode="eager", bucket="-", ahead=False,
                        prefix_hit=False, steps=2)])
    checked = {"a.prefill.p": 3, "a.decode.x": 3, "a.decode.y": 1}
    out = problems(census, checked, ["a.prefill.p", "a.decode.x", "a.decode.x+append", "a.decode.y", "a.decode.z"])
    assert out == ["a.decode.x+append: taken in 5 steps by the gates' engines, never checked by the kernel gate "
                   "against fp32 on a rebuilt cache",
                   "a.decode.z: declared by its backend (kernels.declared_paths), never ran: neither an engine nor "
                   "the kernel gate took it"]
    assert problems(census, {**checked, "a.decode.x+append": 1, "a.decode.z": 1}, ["a.decode.z"]) == []


def test_a_bug_in_a_step_launched_ahead_fails_the_cpu_smoke_gate(tmp_path):
    """The `ahead-tokens` plant (a pure decode step launched ahead gathers each row's token from the next row's
    sample) passed every CPU gate while poison mode turned steps launched ahead off; the smoke gate now runs them on
    a CPU (the captured steps' path uncaptured), so the whole gate run stops at its second file's first gate."""
    r = plant_table.run_row(plant_table.Row("ahead-tokens", "ahead-tokens"), timeout=600, log_dir=tmp_path)
    log = next(tmp_path.glob("*.log")).read_text()
    assert r.caught and r.gate.startswith("gates/test_smoke.py::test_smoke_steps_launched_ahead["), log[-3000:]
    assert r.named and "launched ahead" in log, log[-3000:]


def test_the_redo_gate_catches_an_undo_that_drops_a_row():
    """gates/test_redo.py interrupts steps that admit while others run: an undo that gives back one row too many
    loses a request (found by the mutation campaign: `del self.running[~len(admitted):]` passed every other gate)."""
    p = pytest_run("gates/test_redo.py", "-p", "tests.plants", "--plant", "undo-drops-a-row", "-x")
    assert p.returncode == 1, p.stdout + p.stderr
    assert re.search(plants.PLANTS["undo-drops-a-row"].cause, p.stdout), p.stdout[-3000:]


@pytest.mark.parametrize("plant", ["decode-via-prefill", "prefix-default-off"])
def test_the_smoke_gate_fails_a_run_that_serves_other_than_configured(plant):
    """Two bugs whose tokens are the golden's: the smoke gate's dispatch check (a decode served by another call than
    the configured one) and its served record (a default switched off) must fail them, naming what moved."""
    p = pytest_run("gates/test_smoke.py::test_smoke[fused-torch]", "-p", "tests.plants", "--plant", plant)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert re.search(plants.PLANTS[plant].cause, p.stdout), p.stdout[-3000:]
    assert "not a near tie" not in p.stdout      # the tokens agreed: only the new checks saw it


def test_the_smoke_gate_fails_a_default_that_moved():
    """The default chunk budget moved (a mutant of CHUNK_TOKENS survived every gate: each runs its workload's own
    budget): the served defaults' record fails it, naming the field."""
    p = pytest_run("gates/test_smoke.py::test_served_defaults", "-p", "tests.plants", "--plant", "chunk-default-513")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert re.search(plants.PLANTS["chunk-default-513"].cause, p.stdout), p.stdout[-3000:]


def test_the_smoke_gate_fails_when_the_cpu_loses_its_steps_launched_ahead():
    """Without the torch backend's static_steps the gates over steps launched ahead could only skip on a CPU: they
    fail instead, naming why."""
    p = pytest_run("gates/test_smoke.py::test_smoke_steps_launched_ahead[fused-torch]", "-p", "tests.plants",
                   "--plant", "no-static-steps")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert re.search(plants.PLANTS["no-static-steps"].cause, p.stdout), p.stdout[-3000:]


def test_an_engine_that_keeps_its_schedule_log_unasked_fails_the_smoke_file():
    p = pytest_run("gates/test_smoke.py::test_an_engine_keeps_no_schedule_log_unless_asked", "-p", "tests.plants",
                   "--plant", "schedule-log-kept")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert re.search(plants.PLANTS["schedule-log-kept"].cause, p.stdout), p.stdout[-3000:]


CANCELS_GATE = "gates/test_requests.py::test_refusals_and_cancels_leave_the_rest_identical"


@pytest.mark.parametrize("plant,gate", [("vocab-check-lost", f"{CANCELS_GATE}[chunked-torch-served]"),
                                        ("refused-id-kept", f"{CANCELS_GATE}[fused-torch-served]"),
                                        ("ahead-after-cancel", f"{CANCELS_GATE}[fused-torch-ahead]"),
                                        ("pop-keeps-topk", f"{CANCELS_GATE}[fused-torch-served]"),
                                        ("ahead-unpoisoned", f"{CANCELS_GATE}[chunked-torch-ahead]"),
                                        ("fits-check-lost",
                                         "gates/test_requests.py::test_refusals_at_a_capped_pool[fused-torch]")])
def test_the_requests_gate_fails_a_broken_request_side(plant, gate):
    """Six bugs no other gate drives (each passed the rest of `pytest gates/`: docs/plants.md): a token past the
    vocabulary accepted at submit, a refused request's id kept, a step launched ahead taken after one of its rows was
    cancelled, a popped request's top-k records kept, the pages a step frees left unpoisoned under the step launched
    ahead of its end, a request larger than the pool accepted. The request gate fails each, naming the call and what
    moved."""
    p = pytest_run(gate, "-p", "tests.plants", "--plant", plant)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert re.search(plants.PLANTS[plant].cause, p.stdout), p.stdout[-3000:]


def test_the_loaded_step_gate_fails_a_chunk_bug_against_its_stored_golden():
    """The loaded-step gate reads its stored `hf` golden (golden/<model>/loaded-cpu) and makes the hf reference only
    at the first flip: a prompt chunk a position late fails it, the provenance naming the chunk and the loaded step."""
    p = pytest_run("gates/test_tokens.py::test_loaded_step[fused-torch]", "-p", "tests.plants", "--plant",
                   "chunk-position")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert "fused[torch] loaded steps vs hf" in p.stdout and "a loaded step" in p.stdout, p.stdout[-3000:]
    assert re.search(plants.PLANTS["chunk-position"].cause, p.stdout), p.stdout[-3000:]


CANARY = "gates/test_page_safety.py::test_a_read_of_a_poisoned_page_is_caught"


ARRIVING = "gates/test_requests.py::test_requests_arriving_while_the_engine_serves"


@pytest.mark.parametrize("plant,gate", [
    ("trace-one-short", "gates/test_smoke.py::test_an_engine_keeps_the_last_steps_its_trace_limit_asks"),
    ("dead-engine-serves", f"{CANARY}[fused-torch-recording]"),
    ("undone-twice", "gates/test_redo.py::test_an_interrupted_step_is_redone_identically[fused-torch]"),
    ("blocked-when-full", "gates/test_tokens.py::test_against_hf[chunked-torch-mixed-cpu]"),
    ("debt-time-doubled", "gates/test_tokens.py::test_against_hf[chunked-torch-mixed-cpu]"),
    ("loaded-anew", f"{ARRIVING}[fused-torch]"),
    ("tp-workers-by-name", "gates/test_tp.py::test_tp_matches_tp1_step_by_step[fused-torch]"),
    ("refused-tp-keeps-workers", "gates/test_tp.py::test_a_refused_tp_configuration_stops_its_workers[fused-torch]"),
    ("recover-skips-poison", "gates/test_redo.py::test_an_interrupted_step_is_redone_identically[fused-torch]"),
    ("score-max-refused", "gates/test_requests.py::test_refusals_and_cancels_leave_the_rest_identical"
                          "[fused-torch-served]"),
    ("score-pool-budget", "gates/test_requests.py::test_refusals_at_a_capped_pool[fused-torch]"),
    ("run-reads-arrivals", f"{ARRIVING}[fused-torch]"),
    ("auto-id-off-by-one", "gates/test_requests.py::test_refusals_and_cancels_leave_the_rest_identical"
                           "[fused-torch-served]"),
    ("until-ignored", f"{ARRIVING}[fused-torch]"),
    ("served-undo-fails", "gates/test_redo.py::test_a_step_interrupted_after_the_next_is_launched_ahead_is_redone_as_"
                          "served[fused-torch]")])
def test_the_step_checks_of_the_engine_campaign_fail_their_plants(plant, gate):
    """Session 28's engine campaign added gate checks for its survivors: the trace kept under trace_limit, a failed
    engine refusing every later call, the count of undone steps; session 29 for the rest: a step's
    admission_blocked, the engine's loaded model, run()'s closed loop and `until`, the first automatic id, a step
    interrupted after the next one's launch ahead with poison off; session 30 for its second sample's gaps: the
    duration each step's end gives the prefill-share debt, score()'s edges (exactly the max positions, exactly the
    whole pool), the worker ranks' model at tp > 1 and their stop when the configuration is refused, the pages an interrupted poisoning left, poisoned by the next
    step. Each fails its plant, naming what moved."""
    p = pytest_run(gate, "-p", "tests.plants", "--plant", plant)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert re.search(plants.PLANTS[plant].cause, p.stdout), p.stdout[-3000:]
