"""What the flex backend compiles: the padding ladder, dynamic lengths (one graph per kind, no compile in a measured
step after the warm-up), and the compile cache folder (STEPGATE_COMPILE_CACHE) a later process reuses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import why_unavailable
from kernels.compile_cache import ENV, use_compile_cache
from kernels.flex_backend import BLOCK, MIN_BLOCKS, FlexBackend, dynamic_shapes, kv_bucket, ladder, q_bucket

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def needs_flex():
    reason = why_unavailable("flex", "cpu", 64)
    if reason:
        pytest.skip(f"flex: {reason}")


def frames() -> int:
    """Graphs dynamo has compiled in this process (counters["frames"] skips fullgraph compiles)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def breaks() -> int:
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


# -- the ladder ----------------------------------------------------------------------------------------------------
def test_ladder_starts_at_two_blocks_and_wastes_at_most_a_third():
    assert q_bucket(1) == kv_bucket(1) == MIN_BLOCKS * BLOCK == 256
    assert ladder(8192) == [256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    for n in range(1, 9000, 7):
        b = kv_bucket(n)
        assert b >= n and b % BLOCK == 0 and b // BLOCK >= MIN_BLOCKS
        assert n <= MIN_BLOCKS * BLOCK or (b - n) / b < 1 / 3 + 1e-9, (n, b)
        assert q_bucket(n) >= n and q_bucket(n) % BLOCK == 0


def test_dynamic_switch_is_a_config_field():
    """Dynamic lengths by default on CUDA only; EngineConfig.flex_dynamic forces either, and the resolved
    configuration records what ran."""
    from engine import EngineConfig
    from engine.errors import ConfigError
    assert dynamic_shapes("cuda") and not dynamic_shapes("cpu")
    assert EngineConfig(backend="flex").resolved().flex_dynamic is False
    assert EngineConfig(backend="flex", flex_dynamic=True).resolved().flex_dynamic is True
    assert FlexBackend(dynamic=True)._dynamic_given is True
    with pytest.raises(ConfigError, match="flex_dynamic='yes'"):
        EngineConfig(backend="flex", flex_dynamic="yes")


def test_dynamic_lengths_share_one_graph_per_kind(monkeypatch):
    """The CUDA default (dynamic lengths), traced on CPU with the aot_eager compiler (Inductor's C++ flex template
    miscompiles it): every rung of the ladder, decode and prefill, a fresh prompt's equal lengths first, runs on one
    graph per kind, breaks none, and stays exact under the kernel gate."""
    needs_flex()
    import kernels.flex_backend as fb
    from gates.kernel_check import check_kernel
    monkeypatch.setattr(fb, "COMPILER", "aot_eager")
    torch._dynamo.reset()
    for kind, cases in (("decode", [([5, 100], None), ([5, 900, 17], None), ([3000, 4], None)]),
                        ("prefill", [([128], [128]), ([600, 900, 40], [300, 400, 40]), ([1, 2000], [1, 100])])):
        g0 = frames()
        for kv_lens, q_lens in cases:
            check_kernel(FlexBackend(dynamic=True), kind, num_heads=4, kv_heads=2, head_dim=64, page_size=64, kv_lens=kv_lens,
                         q_lens=q_lens)
        assert frames() - g0 == 1, f"{kind}: {frames() - g0} graphs for three padded lengths"
    assert breaks() == 0
    torch._dynamo.reset()


def test_a_second_engines_warm_up_is_not_run_again_until_dynamo_resets(monkeypatch):
    """The warm-up of a ladder this process has run, with Dynamo still holding its graphs, is not run again (the
    gates build about ten fused-flex engines of one model a process): a second backend's returns 0 calls and knows
    the shapes the first one ran; another ladder (a longer history) runs; after torch._dynamo.reset() the same
    ladder runs again, since its graphs are gone."""
    needs_flex()
    import kernels.flex_backend as fb
    monkeypatch.setattr(fb, "COMPILER", "aot_eager")
    monkeypatch.setattr(fb, "_WARMED", {})
    torch._dynamo.reset()
    try:
        args = dict(num_heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, device="cpu", max_prefill_tokens=64,
                    max_rows=2, kinds=("decode",))
        first = FlexBackend(dynamic=True)
        n = first.warmup(max_kv=300, **args)
        assert n > 0 and first.compiled_shapes
        second = FlexBackend(dynamic=True)
        assert second.warmup(max_kv=300, **args) == 0, "a ladder this process ran was warmed up again"
        assert second.compiled_shapes == first.compiled_shapes
        assert FlexBackend(dynamic=True).warmup(max_kv=600, **args) > n, "a longer ladder was taken for warmed"
        torch._dynamo.reset()
        third = FlexBackend(dynamic=True)
        assert third.warmup(max_kv=300, **args) == n, "after Dynamo's reset the warm-up was skipped"
        monkeypatch.setattr(fb, "_compiled_entries", lambda: None)     # a torch that cannot say: never skip
        assert FlexBackend(dynamic=True).warmup(max_kv=300, **args) == n
    finally:
        torch._dynamo.reset()


# -- no compile in a measured step ---------------------------------------------------------------------------------
def flex_engine(warm_kinds=("decode", "prefill")):
    """The small model's fused-flex engine serving requests of at most 256 positions (so that its ladder has few
    rungs: each compiles on its own on CPU), warmed up for `warm_kinds`, and six such requests."""
    from engine import Engine, lineage_config
    from engine.loader import load_model
    from engine.workload import MIXED_CPU, RequestSpec
    loaded = load_model("small", torch.float32, "cpu")
    cfg = lineage_config("fused", backend="flex", poison=True, chunk_tokens=MIXED_CPU.chunk_tokens, max_model_len=256,
                         compile_warmup=False, progress=False)
    eng = Engine(cfg, loaded=loaded)
    s = eng.shape
    eng.runner.backend.warmup(s.num_heads, s.num_kv_heads, s.head_dim, torch.float32, "cpu", max_kv=256,
                              max_prefill_tokens=cfg.chunk_tokens, max_rows=cfg.max_batch, page_size=cfg.page_size,
                              kinds=warm_kinds)
    specs = [RequestSpec(f"short-{i}", r.prompt[:120], 8)
             for i, r in enumerate(MIXED_CPU.requests(s.vocab_size)[:6])]
    return eng, specs


def compiles_in_steps(eng, specs) -> dict:
    """Run the requests; what dynamo compiled during the steps (frames, graph breaks) and the shapes new to them."""
    shapes, f0, b0 = set(eng.runner.backend.compiled_shapes), frames(), breaks()
    eng.run(specs)
    return dict(frames=frames() - f0, breaks=breaks() - b0, new_shapes=eng.runner.backend.compiled_shapes - shapes)


@pytest.mark.slow      # cold, three C++ flex compiles (a minute or more on 2 cores)
def test_warm_engine_compiles_nothing_in_its_steps():
    """After the warm-up, a fused-flex run compiles nothing, breaks no graph and runs no shape the warm-up did not."""
    needs_flex()
    g0 = frames()
    eng, specs = flex_engine()
    warmed = len(eng.runner.backend.compiled_shapes)
    assert frames() - g0 <= warmed, f"the warm-up compiled {frames() - g0} graphs for {warmed} shapes"
    got = compiles_in_steps(eng, specs)
    assert got == dict(frames=0, breaks=0, new_shapes=set()), f"measured steps compiled: {got}"
    assert any(s.kind in ("loaded", "chunk-only") for s in eng.trace) and any(s.decode_tokens for s in eng.trace)


@pytest.mark.slow
def test_planted_missing_warmup_is_seen():
    """Planted: the warm-up skips prefill, so the first step compiles; the check above must see it."""
    needs_flex()
    torch._dynamo.reset()        # forget the graphs other tests compiled in this process
    eng, specs = flex_engine(warm_kinds=("decode",))
    got = compiles_in_steps(eng, specs)
    assert got["frames"] >= 1 and got["new_shapes"], got


# -- the compile cache folder --------------------------------------------------------------------------------------
CHILD = """
import json, torch
from torch._dynamo.utils import counters
from gates.kernel_check import check_kernel
check_kernel("flex", "decode", num_heads=4, kv_heads=2, head_dim=64, page_size=64, kv_lens=[1, 65, 300])
print(json.dumps(dict(counters["inductor"])))
"""


def compile_in_child(env: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_use_compile_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-before"))     # restored after the test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    assert use_compile_cache() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "before")
    monkeypatch.setenv(ENV, str(tmp_path / "ci" / "cache"))
    assert use_compile_cache() == str(tmp_path / "ci" / "cache")
    assert (tmp_path / "ci" / "cache").is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ci/cache")
    # the Triton decode's kernels are cached by Triton itself: in the kept folder too
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "ci" / "cache" / "triton-jit")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="STEPGATE_COMPILE_CACHE"):
        use_compile_cache(tmp_path / "file")


@pytest.mark.slow      # one cold C++ flex compile and one warm load, in two processes
def test_compile_cache_folder_is_filled_and_reused(tmp_path):
    """A flex compile with STEPGATE_COMPILE_CACHE set fills that folder; a second process reads it back and
    compiles nothing."""
    needs_flex()
    cache = tmp_path / "compile-cache"
    env = {ENV: str(cache), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")}
    cold = compile_in_child(env)
    written = [p for p in (cache / "fxgraph").rglob("*") if p.is_file()] if (cache / "fxgraph").is_dir() else []
    assert cold.get("fxgraph_cache_miss", 0) >= 1 and written, (cold, sorted(os.listdir(cache)))
    assert not (tmp_path / "elsewhere" / "fxgraph").exists(), "compiled into TORCHINDUCTOR_CACHE_DIR, not the kept one"
    warm = compile_in_child(env)
    assert warm.get("fxgraph_cache_hit", 0) >= 1 and warm.get("fxgraph_cache_miss", 0) == 0, warm
