"""The served record (gates/served.py) and the dispatch check (gates/dispatch.py), on stand-in engines: what each
says when the record is missing, when it moved, and after a regeneration; a kernel dispatched other than configured."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from gates import served
from gates.dispatch import dispatch_problems
from kernels.torch_backend import TorchBackend


@dataclass
class Stand:
    key: str
    rows: list = field(default_factory=list)

    @property
    def served(self):
        return SimpleNamespace(key=lambda: self.key)

    @property
    def runner(self):
        return SimpleNamespace(path_census=lambda: self.rows, backend=self._backend)

    _backend: object = None


ROW = dict(kind="pure-decode", kernels=["torch.decode.gather"], mode="eager", bucket="-", ahead=False,
           prefix_hit=False, steps=3)


def opts(tmp_path, regen=False):
    return SimpleNamespace(golden_dir=tmp_path, model="small", device="cpu", dtype="float32", tp=1, regen=regen,
                           is_cuda=False, overrides=lambda backend: {})


def test_a_missing_record_names_the_command_that_makes_it(tmp_path):
    (p,) = served.problems(opts(tmp_path), "fused-torch", "torch", Stand("k1", [ROW]))
    assert "no served record" in p and "pytest gates/test_smoke.py::test_smoke --regen-golden" in p


def test_regenerated_then_checked_then_moved(tmp_path, capsys):
    assert served.problems(opts(tmp_path, regen=True), "fused-torch", "torch", Stand("k1", [ROW])) == []
    assert served.problems(opts(tmp_path), "fused-torch", "torch", Stand("k1", [ROW])) == []
    eager_ahead = dict(ROW, ahead=True)
    moved = served.problems(opts(tmp_path), "fused-torch", "torch", Stand("k2", [eager_ahead]))
    assert moved[0] == "configuration: recorded k1, serves k2"
    assert "step path no longer taken: pure-decode: torch.decode.gather, eager" in moved
    assert "step path taken, not recorded: pure-decode: torch.decode.gather, eager, launched ahead" in moved
    assert "regenerate" in moved[-1]
    # another candidate's record is kept beside it; the regeneration prints what moved
    served.problems(opts(tmp_path, regen=True), "chunked-torch", "torch", Stand("c1", [ROW]))
    served.problems(opts(tmp_path, regen=True), "fused-torch", "torch", Stand("k2", [ROW]))
    assert "fused-torch: configuration: recorded k1, serves k2" in capsys.readouterr().out
    assert served.problems(opts(tmp_path), "chunked-torch", "torch", Stand("c1", [ROW])) == []


def test_dispatch_names_a_configured_kernel_no_call_ran_and_a_kernel_not_configured():
    be = TorchBackend()
    engine = Stand("k", [ROW], _backend=be)
    assert dispatch_problems(engine) == [
        "dispatch: torch.decode.gather is configured (the census names it for 3 step(s)) but no call dispatched "
        "to it; its calls ran nothing"]
    be.took("decode", "gather")
    assert dispatch_problems(engine) == []
    be.took("decode", "other")
    assert dispatch_problems(engine) == ["dispatch: a decode call ran torch.decode.other, but the torch backend is "
                                         "configured to run torch.decode.gather"]
