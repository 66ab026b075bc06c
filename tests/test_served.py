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


# -- the runner against Engine.served, the census against the trace (gates/dispatch.py; session 17) ------------------
def small_engine(loaded, **kw):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.workload import get_workload
    from engine.schedule_log import ScheduleLog
    e = Engine(EngineConfig(device="cpu", dtype="float32", chunk_tokens=64, **kw), loaded=loaded,
               schedule_log=ScheduleLog())
    e.run(get_workload("smoke-cpu").requests()[:3])
    return e


def test_served_problems_name_each_difference_between_the_runner_and_what_is_served(loaded):
    from gates.dispatch import served_problems
    e = small_engine(loaded, backend="flex", decode_kernel="packed")
    assert served_problems(e) == []
    e.runner.backend.decode_kernel = "rows"         # a choice dropped on its way to the backend
    e.runner.compiled_elementwise = True            # pieces compiled where the configuration says eager
    assert served_problems(e) == [
        "served: decode_kernel='packed' is configured, the flex backend was built with 'rows'",
        "served: compile_elementwise=False is configured, the pieces run compiled (a failed torch.compile warns at "
        "construction)",
        "served: the runner's build compiled the elementwise pieces, its forwards run add_rms_norm, rms_norm, rope, "
        "rope_write, silu_mul eagerly"]
    e.runner.backend.decode_kernel = "packed"
    e.runner.compiled_elementwise = False
    from engine.layer_kernels import EAGER_OPS
    e.runner.ops = {**EAGER_OPS, "silu_mul": lambda x: x}     # a piece handed to the forwards that is not eager's
    assert served_problems(e) == [
        "served: the runner's build did not compile the elementwise pieces, its forwards run silu_mul compiled"]
    e.runner.ops = EAGER_OPS
    e.runner.compiled_elementwise = None            # a compile that worked recorded as None (its `why`)
    assert served_problems(e) == [
        "served: compile_elementwise=False is configured, the runner's record of what its build did is None, not True "
        "or False"]


def test_served_problems_name_captured_steps_and_step_graphs_against_the_configuration(loaded):
    from gates.dispatch import served_problems
    e = small_engine(loaded, backend="torch", forward="fused", cuda_graphs=True, overlap=False)
    assert e.runner.graphs is not None and e.runner.step_graphs is not None and served_problems(e) == []
    e.runner.graphs.capture_graphs = True           # captured where the configuration (a CPU) says uncaptured
    step_graphs, e.runner.step_graphs = e.runner.step_graphs, None
    assert served_problems(e) == [
        "served: capture_graphs=False is configured, the runner's pure decode steps are captured",
        "served: the fused forward's loaded steps should take the captured path (the torch backend's prefill allows "
        "it on a CPU), but the runner built no step graphs"]
    e.runner.step_graphs = step_graphs
    e.served = e.served.with_(forward="chunked")
    assert "served: the chunked forward runs no step graphs, yet the runner built them" in served_problems(e)


def test_census_problems_hold_the_census_against_the_trace(loaded):
    from collections import Counter
    from gates.dispatch import census_problems
    e = small_engine(loaded, backend="torch", prefix_cache=True)
    assert census_problems(e) == []
    census = Counter(e.runner.census)
    path = next(iter(census))
    e.runner.census[path] += 1                      # a step counted twice
    assert census_problems(e)[0].startswith("census: ")
    e.runner.census.clear()
    e.runner.census.update({p._replace(ahead=True, prefix_hit=True): n for p, n in census.items()})
    problems = census_problems(e)
    assert any("counted as launched ahead" in p for p in problems), problems
    assert any("counted as admitting a cached prefix" in p for p in problems), problems


def test_poison_problems_name_a_free_page_that_holds_anything_but_nan(loaded):
    from gates.dispatch import poison_problems
    e = small_engine(loaded, backend="torch", poison=True)
    assert poison_problems(e) == []
    page = next(p for p in e.pool.free if p not in e._unpoisoned)
    e.runner.kv_caches[1][1][page, -1, 0, 0] = float("inf")     # one slot of a freed page not poison (layer 1)
    want = [f"poison: free page(s) [{page}] hold values other than NaN in layer 1: freed or never-written pages must "
            "hold NaN in poison mode, or a kernel that reads one goes unseen"]
    assert poison_problems(e) == want
    e.runner.kv_caches[1][1][page] = 0.0            # the whole page left unpoisoned
    assert poison_problems(e) == want
    assert poison_problems(small_engine(loaded, backend="torch", poison=False)) == []



def test_autograd_problems_name_a_cache_with_autograd_history(loaded):
    """A step whose forward ran outside inference mode (a step launched ahead, uncaptured) leaves autograd history in
    the KV cache it wrote: memory that grows with each step (session 19's H200 campaign; on a CPU, out of memory)."""
    import torch
    from gates.dispatch import autograd_problems
    e = small_engine(loaded, backend="torch", forward="fused", cuda_graphs=True, overlap=True)
    assert e.steps_ahead > 0 and autograd_problems(e) == []
    k, v = e.runner.kv_caches[1]
    w = torch.ones(1, requires_grad=True)
    v[1, 0] = (w * 2.0).expand_as(v[1, 0])          # a write recorded by autograd (the planted step's)
    assert autograd_problems(e) == [
        "autograd: layer 1's value cache records autograd history (CopySlices): a forward ran outside inference "
        "mode, and each later step's graph chains onto the tensors it wrote (memory grows with every step)"]

def test_served_problems_hold_bytes_per_page_against_the_cache_as_allocated(loaded, monkeypatch):
    from engine.runner import ModelRunner
    from gates.dispatch import served_problems
    e = small_engine(loaded, backend="torch")
    true = ModelRunner.bytes_per_page(e.runner.shape, e.runner.page_size, e.runner.dtype)
    monkeypatch.setattr(ModelRunner, "bytes_per_page", staticmethod(lambda *a: true // 2))
    assert served_problems(e) == [f"served: a page of the KV cache takes {true} bytes as allocated, bytes_per_page "
                                  f"says {true // 2} (the pool is sized from free memory by it)"]
