"""kernels/triton_decode.py, the decode kernel split by work: against a dense fp32 reference over the pages each
row owns, on CPU through Triton's interpreter (on CUDA natively, with --device cuda). Rows at item and page
boundaries, one-key rows, shuffled pages, GQA groups, the append (the new key attended and written to its slot),
NaN in every slot a row does not own (never read), and a planted off-by-one in the cache length caught."""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton decode kernel needs triton (pip install triton)")

from kernels import triton_decode as td  # noqa: E402

from tests.interpreter import interpreting, kernel_test_mark, run_kernel_tests_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 256
# Off CUDA the kernels run in Triton's interpreter, in a child process (tests/interpreter.py)
INTERPRETING = interpreting(triton)
RUNS_HERE = DEVICE == "cuda" or INTERPRETING
kernel_test = kernel_test_mark(triton)


@pytest.mark.skipif(RUNS_HERE, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    """This module's kernel tests, in a child process whose triton interprets (on CPU, numpy for the GPU); not the
    sm_90 compile, which needs the kernels compiled."""
    run_kernel_tests_interpreted(__file__)


def paged_case(lengths, heads=12, kv_heads=2, d=128, seed=0, pages_extra=3):
    """Caches whose unowned slots (free pages, page tails past a row's length) hold NaN, rows' pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lengths]
    n_pages = sum(need) + pages_extra
    order = list(range(n_pages))
    random.Random(seed).shuffle(order)
    width = max(need)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    k = torch.full((n_pages, PAGE, kv_heads, d), float("nan"), dtype=torch.float16)
    v = torch.full_like(k, float("nan"))
    keys, values = [], []
    for r, n in enumerate(lengths):
        own = [order.pop() for _ in range(need[r])]
        table[r, :len(own)] = torch.tensor(own, dtype=torch.int32)
        kr = torch.randn(n, kv_heads, d, generator=g).half()
        vr = torch.randn(n, kv_heads, d, generator=g).half()
        for j in range(n):
            k[own[j // PAGE], j % PAGE] = kr[j]
            v[own[j // PAGE], j % PAGE] = vr[j]
        keys.append(kr)
        values.append(vr)
    q = torch.randn(len(lengths), heads, d, generator=g).half()
    return q, k, v, table, keys, values


def dense(q, keys, values, scale):
    """fp32 softmax attention of each row over its keys; query head h reads key/value head h // group."""
    out = []
    for r, (kr, vr) in enumerate(zip(keys, values)):
        group = q.shape[1] // kr.shape[1]
        kk = kr.float().repeat_interleave(group, 1)          # [n, heads, d]
        vv = vr.float().repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[r].float(), kk) * scale
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv))
    return torch.stack(out)


def run(q, k, v, table, cached, scale, new_kv=None, chunk=256, programs=None):
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    kd, vd = dev(k), dev(v)
    nk = None
    if new_kv:          # keep the views' strides: each one's tensor moved, then viewed again
        nk = tuple(dev(t._base if t._base is not None else t).as_strided(t.shape, t.stride(), t.storage_offset())
                   for t in new_kv)
    out = td.paged_decode(dev(q), kd, vd, dev(table), dev(torch.tensor(cached, dtype=torch.int32)), scale, nk,
                          chunk=chunk, programs=programs)
    return out.float().cpu(), kd.cpu(), vd.cpu()


LENGTHS = {
    "one key and item edges": [1, 255, 256, 257, 511, 512, 513],
    "skewed like the mixed draw": [4114, 200, 37, 1030, 9],
}


@kernel_test
@pytest.mark.parametrize("chunk", [256, 512])
@pytest.mark.parametrize("name", list(LENGTHS))
def test_matches_a_dense_reference_and_reads_no_slot_it_does_not_own(name, chunk):
    lengths = LENGTHS[name]
    q, k, v, table, keys, values = paged_case(lengths)
    scale = 128 ** -0.5
    out, _, _ = run(q, k, v, table, lengths, scale, chunk=chunk)
    assert torch.isfinite(out).all(), "a NaN slot (free page or page tail) was read"
    torch.testing.assert_close(out, dense(q, keys, values, scale), atol=2e-3, rtol=2e-3)


@kernel_test
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_fewer_programs_than_items_attend_every_item_once(programs):
    """The persistent grid: each program loops over the items p, p + P, ... With fewer programs than the step's
    items (24 here, the 4,114-position row's 17 among them), every item is attended once and the append is done
    once: the same output and the same caches as a program an item."""
    lengths = [4114, 200, 37, 1030, 9]
    full = [n + 1 for n in lengths]
    q, k, v, table, keys, values = paged_case(full, seed=4)
    new_k = torch.stack([kr[-1] for kr in keys])
    new_v = torch.stack([vr[-1] for vr in values])
    one_each = run(q, k.clone(), v.clone(), table, lengths, 0.1, new_kv=(new_k, new_v))
    looped = run(q, k.clone(), v.clone(), table, lengths, 0.1, new_kv=(new_k, new_v), programs=programs)
    torch.testing.assert_close(looped[0], dense(q, keys, values, 0.1), atol=2e-3, rtol=2e-3)
    assert torch.equal(looped[0], one_each[0]), "an item was attended twice, or not at all"
    same = lambda a, b: torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))  # noqa: E731
    assert same(looped[1], one_each[1]) and same(looped[2], one_each[2])


@kernel_test
@pytest.mark.parametrize("heads,kv_heads,d", [(12, 2, 128), (4, 4, 64), (8, 1, 64), (32, 1, 64)])
def test_every_gqa_group_and_head_dim(heads, kv_heads, d):
    lengths = [3, 300, 700]
    q, k, v, table, keys, values = paged_case(lengths, heads, kv_heads, d, seed=1)
    out, _, _ = run(q, k, v, table, lengths, d ** -0.5)
    torch.testing.assert_close(out, dense(q, keys, values, d ** -0.5), atol=2e-3, rtol=2e-3)


@kernel_test
def test_the_append_attends_the_new_key_and_writes_it_to_its_slot():
    """The step's own key and value (new_kv) are attended by each row's last item and written at position
    `cached`; nothing else in the caches changes. A row with no cached key attends only its new one."""
    lengths = [0, 255, 256, 600]
    full = [n + 1 for n in lengths]
    q, k, v, table, keys, values = paged_case(full, seed=2)
    # as the model passes them: k a view of the rotated [q; k], v of the projected [q; k; v] (own row strides)
    rows = len(full)
    new_k = torch.cat([torch.zeros(rows, 12, 128).half(), torch.stack([kr[-1] for kr in keys])], 1)[:, 12:]
    new_v = torch.cat([torch.zeros(rows, 14, 128).half(), torch.stack([vr[-1] for vr in values])], 1)[:, 14:]
    assert new_k.stride(0) != new_v.stride(0)
    before_k, before_v = k.clone(), v.clone()
    for r, n in enumerate(lengths):             # the new position's slot: not yet written (NaN, as a free slot)
        page = table[r, n // PAGE]
        k[page, n % PAGE] = float("nan")
        v[page, n % PAGE] = float("nan")
    out, k_after, v_after = run(q, k, v, table, lengths, 0.1, new_kv=(new_k, new_v))
    torch.testing.assert_close(out, dense(q, keys, values, 0.1), atol=2e-3, rtol=2e-3)
    same = lambda a, b: torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))  # noqa: E731
    assert same(k_after, before_k) and same(v_after, before_v), "the append wrote elsewhere, or not at all"


@kernel_test
def test_the_append_with_rope_rotates_the_queries_and_the_new_key_as_the_model_does():
    """rope=(cos, sin): q and the new key come unrotated (as the QKV projection leaves them) and the kernel rotates
    both as the model's rope does (fp32, rounded once): the output is attention with rotated queries over the
    history and the rotated new key, and the key written to the cache is the rotated one (to an fp16 ulp)."""
    from engine.layer_kernels import rope
    from engine.model import Rotary
    lengths = [0, 255, 256, 600]
    full = [n + 1 for n in lengths]
    q, k, v, table, keys, values = paged_case(full, seed=4)
    cos, sin = Rotary(128, 1e6)(torch.tensor(lengths), torch.float16)         # each row's new position
    rot = lambda x: rope(x.float(), cos.float(), sin.float()).half()  # noqa: E731 (the compiled rope's rounding)
    raw_k = torch.stack([kr[-1] for kr in keys])                       # the new keys, unrotated
    new_v = torch.stack([vr[-1] for vr in values])
    want_k = rot(raw_k)
    for r, n in enumerate(lengths):             # the new position's slot: not yet written
        page = table[r, n // PAGE]
        k[page, n % PAGE] = float("nan")
        v[page, n % PAGE] = float("nan")
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    kd, vd = dev(k), dev(v)
    out = td.paged_decode(dev(q), kd, vd, dev(table), dev(torch.tensor(lengths, dtype=torch.int32)), 0.1,
                          (dev(raw_k), dev(new_v)), rope=(dev(cos), dev(sin))).float().cpu()
    keys_rotated = [torch.cat([kr[:-1], want_k[r:r + 1]]) for r, kr in enumerate(keys)]
    torch.testing.assert_close(out, dense(rot(q), keys_rotated, values, 0.1), atol=2e-3, rtol=2e-3)
    for r, n in enumerate(lengths):
        page = int(table[r, n // PAGE])
        torch.testing.assert_close(kd[page, n % PAGE].cpu(), want_k[r], atol=2e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="only with new_kv"):
        td.paged_decode(dev(q), kd, vd, dev(table), dev(torch.tensor(full, dtype=torch.int32)), 0.1,
                        rope=(dev(cos), dev(sin)))


@kernel_test
def test_work_items_cover_each_rows_keys_once_and_the_rest_of_the_grid_is_idle():
    cached = torch.tensor([0, 1, 256, 257, 4114], dtype=torch.int32, device=DEVICE)
    table = (torch.arange(5 * 17, dtype=torch.int32) + 100).view(5, 17).to(DEVICE)
    grid = td.max_items(5, 17 * PAGE, 100 * PAGE, 256)
    row, start, end, page, last, firsts, counts = (t.cpu() for t in td.work_items(cached, grid, 256, table, PAGE))
    assert counts.tolist() == [1, 1, 1, 2, 17] and firsts.tolist() == [0, 1, 2, 3, 5]
    assert row[:22].tolist() == [0, 1, 2, 3, 3] + [4] * 17 and (row[22:] == 5).all(), "idle items: row = rows"
    assert start[3:5].tolist() == [0, 256] and start[5:22].tolist() == [256 * i for i in range(17)]
    assert end[:5].tolist() == [0, 1, 256, 256, 257] and end[21] == 4114, "an item ends at its row's keys"
    assert page[:5].tolist() == [100, 117, 134, 151, 152] and page[21] == 100 + 4 * 17 + 16, "the item's own page"
    assert last[:22].nonzero().flatten().tolist() == [0, 1, 2, 4, 21]
    assert grid == 5 * 17, "every row at the table's width"
    assert td.max_items(5, 17 * PAGE, 20 * PAGE, 256) == 5 + 20, "one item a row plus the pool in items"


def items_by_loop(cached: list[int], grid: int, chunk: int, table: list[list[int]], page_size: int):
    """work_items' meaning, a row at a time: (row, start, end, page, last) of each of the step's items, and the
    rows' first items and counts."""
    items, firsts, counts = [], [], []
    for r, n in enumerate(cached):
        firsts.append(len(items))
        counts.append(max(1, -(-n // chunk)))
        items += [(r, chunk * j, min(chunk * (j + 1), n), table[r][chunk * j // page_size],
                   int(j == counts[-1] - 1)) for j in range(counts[-1])]
    return items[:grid], firsts, counts


@kernel_test
def test_work_items_match_a_loop_over_the_rows():
    """work_items against items_by_loop on random lengths (zero, page edges, long rows; more rows than a row block
    of make_items) and grids as wide as the table (more items than the step has) or exactly the step's: every item
    of the step the same, the grid's idle items of no row (row = rows) and no row's last."""
    g = random.Random(0)
    for _ in range(12):
        rows = g.choice([1, g.randint(2, 40), g.randint(120, 300)])
        cached = [g.choice([0, 1, 255, 256, 257, 512, g.randint(0, 5000)]) for _ in range(rows)]
        chunk = g.choice([64, 256])
        width = max(-(-n // PAGE) for n in cached) or 1
        table = [[g.randint(1, 10 ** 6) for _ in range(width)] for _ in range(rows)]
        want, firsts, counts = items_by_loop(cached, 10 ** 6, chunk, table, PAGE)
        for grid in (len(want), len(want) + g.randint(1, 300)):
            got = td.work_items(torch.tensor(cached, dtype=torch.int32, device=DEVICE), grid, chunk,
                                torch.tensor(table, dtype=torch.int32, device=DEVICE), PAGE)
            assert all(t.dtype == torch.int32 and t.shape[0] == (grid if i < 5 else rows) for i, t in enumerate(got))
            row, start, end, page, last, f, n = (t.cpu() for t in got)
            assert f.tolist() == firsts and n.tolist() == counts
            k = len(want)
            assert list(zip(*(t[:k].tolist() for t in (row, start, end, page, last)))) == want
            assert (row[k:] == rows).all() and not last[k:].any()


@kernel_test
def test_a_planted_off_by_one_in_the_cache_length_is_caught():
    """Lengths one short (the last key dropped): the reference comparison fails."""
    lengths = [300, 513]
    q, k, v, table, keys, values = paged_case(lengths, seed=3)
    out, _, _ = run(q, k, v, table, [n - 1 for n in lengths], 128 ** -0.5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out, dense(q, keys, values, 128 ** -0.5), atol=2e-3, rtol=2e-3)


@kernel_test
def test_it_writes_only_the_decode_rows_into_a_given_output():
    """out and out_rows (a captured loaded step's decode call, kernels/base.py: decode_into): rows below the device
    count get the decode output, written into `out`; the rows past it keep out's values (they are the chunk's rows,
    the variable-length call's output). A count of 0 writes nothing."""
    lengths = [40, 300, 700, 1]
    q, k, v, table, keys, values = paged_case(lengths, seed=5)
    want = dense(q, keys, values, 0.1)
    for count in (3, 0, 4):
        out = torch.full(q.shape, 7.0, dtype=q.dtype, device=DEVICE)
        got = td.paged_decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), table.to(DEVICE),
                              torch.tensor(lengths, dtype=torch.int32, device=DEVICE), 0.1, out=out,
                              out_rows=torch.tensor([count], dtype=torch.int32, device=DEVICE))
        assert got is out
        got = got.float().cpu()
        torch.testing.assert_close(got[:count], want[:count], atol=2e-3, rtol=2e-3)
        assert (got[count:] == 7.0).all(), f"a row at or past the count {count} was written"


def test_bad_shapes_are_refused_with_the_reason():
    q = torch.zeros(1, 3, 96, dtype=torch.float16)
    cache = torch.zeros(1, PAGE, 2, 96, dtype=torch.float16)
    with pytest.raises(ValueError, match="heads 3 over 2 key/value heads, head dim 96"):
        td.paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
    q, cache = torch.zeros(2, 4, 64, dtype=torch.float16), torch.zeros(1, PAGE, 2, 64, dtype=torch.float16)
    args = (q, cache, cache, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="out .3, 4, 64. must be q's shape"):
        td.paged_decode(*args, out=torch.zeros(3, 4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="out_rows limits the rows written into a given out"):
        td.paged_decode(*args, out_rows=torch.ones(1, dtype=torch.int32))


def flash_with_triton_decode(monkeypatch):
    """The flash backend with decode_kernel='triton', made without flash-attn (its decode path does not use it): its
    decode as the model calls it."""
    from kernels import flash_backend as fb
    monkeypatch.setattr(fb, "_import_flash", lambda: (None, "no flash-attn here"))
    with pytest.raises(fb.Unavailable):
        fb.FlashBackend(decode_kernel="triton")     # the kernel choice is read before flash-attn is looked for
    backend = object.__new__(fb.FlashBackend)
    backend.triton_chunk, backend.decode_splits, backend.decode_kernel = 256, None, "triton"
    backend.dispatched = set()
    return backend


@kernel_test
@pytest.mark.parametrize("append", [False, True])
def test_the_flash_backend_decodes_through_it_when_asked(monkeypatch, append):
    """prepare's lengths count the new key (append: it is not in the cache yet); the items are made by the first
    layer and kept for the rest of the step."""
    from kernels.base import AttnBatch
    backend = flash_with_triton_decode(monkeypatch)
    lengths = [5, 260, 700]
    q, k, v, table, keys, values = paged_case(lengths, seed=4)
    new_kv = None
    if append:      # the last key of each row is the step's own
        new_kv = (torch.stack([kr[-1] for kr in keys]), torch.stack([vr[-1] for vr in values]))
        for r, n in enumerate(lengths):
            k[table[r, (n - 1) // PAGE], (n - 1) % PAGE] = float("nan")
            v[table[r, (n - 1) // PAGE], (n - 1) % PAGE] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    batch = AttnBatch([1] * 3, lengths, table.to(DEVICE), seqlens, torch.arange(4, dtype=torch.int32), PAGE)
    batch.prepared["decode"] = ("decode", table.to(DEVICE), seqlens, seqlens - 1)
    kd, vd = k.to(DEVICE), v.to(DEVICE)
    nk = tuple(t.to(DEVICE) for t in new_kv) if new_kv else None
    want = dense(q, keys, values, 0.1)
    out = backend.decode(q.to(DEVICE), kd, vd, batch, 0.1, new_kv=nk)
    items = batch.prepared[("triton-items", append)]
    again = backend.decode(q.to(DEVICE), kd, vd, batch, 0.1, new_kv=nk)         # the step's next layer
    assert batch.prepared[("triton-items", append)] is items, "a later layer made the items again"
    assert backend.dispatched == {("decode", "triton", append)}     # what gates/dispatch.py compares with the census
    for o in (out, again):
        torch.testing.assert_close(o.float().cpu(), want, atol=2e-3, rtol=2e-3)
    if append:      # the new keys are in the cache now: a decode without the append reads them there
        cached = backend.decode(q.to(DEVICE), kd, vd, batch, 0.1)
        torch.testing.assert_close(cached.float().cpu(), want, atol=2e-3, rtol=2e-3)
    else:           # a captured loaded step's decode call: its first two rows into the given output, in place
        into = torch.full(q.shape, 7.0, dtype=q.dtype, device=DEVICE)
        count = torch.tensor([2], dtype=torch.int32, device=DEVICE)
        backend.decode_into(q.to(DEVICE), kd, vd, batch, 0.1, into, torch.arange(3, device=DEVICE) < count, count)
        torch.testing.assert_close(into[:2].float().cpu(), want[:2], atol=2e-3, rtol=2e-3)
        assert (into[2:] == 7.0).all()
        assert backend.dispatched == {("decode", "triton", False)}


def test_an_unknown_decode_kernel_is_refused(monkeypatch):
    from engine import EngineConfig
    from engine.errors import ConfigError
    from kernels import flash_backend as fb
    with pytest.raises(ValueError, match="decode_kernel='tritn': the flash backend decodes with 'triton' or 'flash'"):
        fb.FlashBackend(decode_kernel="tritn")
    with pytest.raises(ConfigError, match="decode_kernel='tritn'"):
        EngineConfig(backend="flash", page_size=256, decode_kernel="tritn")


def test_its_compiled_kernels_go_to_the_kept_compile_cache(tmp_path, monkeypatch):
    """With STEPGATE_COMPILE_CACHE (CI keeps that folder between runs) Triton caches these kernels there, not in
    ~/.triton/cache: a warm CI run does not compile them again."""
    monkeypatch.setenv("STEPGATE_COMPILE_CACHE", str(tmp_path / "kept"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "before"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before-inductor"))
    td._kernels()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "kept" / "triton-jit")
    assert triton.knobs.cache.dir == str(tmp_path / "kept" / "triton-jit")


@pytest.mark.parametrize("kernel, chunk", [(None, 256), ("triton", 256), ("flash", None)])
def test_triton_is_the_default_decode_kernel(monkeypatch, kernel, chunk):
    """EngineConfig.decode_kernel None: the flash backend decodes with Triton; 'flash' takes flash-attn's split-KV;
    the resolved configuration names the kernel either way."""
    from engine import EngineConfig
    from kernels import flash_backend as fb
    monkeypatch.setattr(fb, "_import_flash", lambda: (fb, None))     # any module: only its presence is asked
    monkeypatch.setattr(fb.FlashBackend, "_bind_flash", lambda self: None)
    assert fb.FlashBackend(decode_kernel=kernel).triton_chunk == chunk
    cfg = EngineConfig(backend="flash", page_size=256, decode_kernel=kernel)
    assert cfg.resolved().describe()["decode_kernel"] == (kernel or "triton")


def test_a_triton_that_does_not_import_makes_flash_unavailable_and_says_how_to_opt_out(monkeypatch):
    """A broken triton must not leave the flash configuration ungated behind a green run: the backend reports it
    cannot run (on CUDA the gates then refuse to start), naming the way back to flash-attn's decode."""
    from kernels import flash_backend as fb
    monkeypatch.setattr(fb, "_import_flash", lambda: (fb, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)          # import triton raises ImportError
    fb._triton_reason.cache_clear()
    try:
        reason = fb.FlashBackend.why_unavailable(torch.device("cuda"), 256)
        assert reason and "triton does not import" in reason and "decode_kernel='flash'" in reason
        assert fb.FlashBackend.why_unavailable(torch.device("cuda"), 256, "flash") is None
    finally:
        fb._triton_reason.cache_clear()


@pytest.mark.skipif(INTERPRETING, reason="the interpreter's kernels are not compiled")
@pytest.mark.parametrize("append,one_page,pdl", [(True, True, False), (False, True, False), (True, False, False),
                                                (True, True, True)])
def test_the_gpu_path_compiles_for_sm90_without_a_gpu(append, one_page, pdl):
    """The kernels as the GPU runs them (the pipelined key loop, not the interpreter's static one), compiled through
    Triton's CUDA backend to PTX for the H200's sm_90: a GPU-only type or syntax error fails here, on CPU. With PDL
    (kernels/pdl_kernels.py) each kernel lets the next start and waits for the one before."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_decode_kernels as k
    ptrs = dict(q_ptr="*fp16", k_ptr="*fp16", v_ptr="*fp16", bt_ptr="*i32", item_row_ptr="*i32",
                item_start_ptr="*i32", item_end_ptr="*i32", item_page_ptr="*i32", item_last_ptr="*i32",
                first_ptr="*i32", count_ptr="*i32", new_k_ptr="*fp16", new_v_ptr="*fp16", o_ptr="*fp32",
                lse_ptr="*fp32", cos_ptr="*fp16", sin_ptr="*fp16", scale="fp32")
    ints = ["num_rows", "bt_stride", "page_size", "q_stride_row", "q_stride_head", "kv_stride_page",
            "kv_stride_slot", "kv_stride_head", "new_k_stride_row", "new_k_stride_head", "new_v_stride_row",
            "new_v_stride_head", "o_stride_item", "o_stride_head", "lse_stride_item", "rope_stride_row"]
    consts = dict(GROUP=6, GROUP_PAD=16, D=128, CHUNK=256, BLOCK_N=64, APPEND=append, STATIC_LOOP=False,
                  ONE_PAGE=one_page, ROPE=append, ITERS=1, PDL=pdl)
    target = GPUTarget("cuda", 90, 32)
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr")}
    # with the launch the engine uses (td.LAUNCH, td.COMBINE_LAUNCH): a warp count the kernel cannot be laid out
    # for fails here
    attend = triton.compile(ASTSource(fn=k.attend_items, signature=sig, constexprs=consts), target=target,
                            options=dict(td.LAUNCH))
    ptx = attend.asm["ptx"]
    assert ".target sm_90" in ptx and "mma" in ptx, "no tensor-core dot in the PTX"
    assert attend.metadata.num_warps == td.LAUNCH.get("num_warps", 4)
    assert pdl_instructions(ptx) == (["griddepcontrol.launch_dependents", "griddepcontrol.wait"] if pdl else [])
    sig_c = dict(o_ptr="*fp32", lse_ptr="*fp32", first_ptr="*i32", count_ptr="*i32", out_ptr="*fp16",
                 out_rows_ptr="*i32",
                 **dict.fromkeys(["o_stride_item", "o_stride_head", "lse_stride_item", "out_stride_row",
                                  "out_stride_head"], "i32"), D="constexpr", MAX_COUNT="constexpr",
                 STATIC_LOOP="constexpr", LIMIT_ROWS="constexpr", PDL="constexpr")
    for limit in (False, True):         # a pure decode step's combine; a captured loaded step's (decode_into)
        consts_c = dict(D=128, MAX_COUNT=td.ITEM_BLOCK, STATIC_LOOP=False, LIMIT_ROWS=limit, PDL=pdl)
        combine_k = triton.compile(ASTSource(fn=k.combine_items, signature=sig_c, constexprs=consts_c),
                                   target=target, options=dict(td.COMBINE_LAUNCH))
        assert ".target sm_90" in combine_k.asm["ptx"]
        assert len(pdl_instructions(combine_k.asm["ptx"])) == (2 if pdl else 0)
        assert combine_k.metadata.num_warps == td.COMBINE_LAUNCH.get("num_warps", 4)


@pytest.mark.skipif(INTERPRETING, reason="the interpreter's kernels are not compiled")
def test_make_items_compiles_for_sm90_without_a_gpu():
    """make_items (work_items' one launch) through Triton's CUDA backend to sm_90 PTX, with the row count and the
    table's stride not specialised on (a captured step's shapes would each compile it again)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_decode_kernels as k
    sig = {**dict.fromkeys(["cached_ptr", "bt_ptr", "row_ptr", "start_ptr", "end_ptr", "page_ptr", "last_ptr",
                            "first_ptr", "count_ptr"], "*i32"),
           **dict.fromkeys(["rows", "bt_stride", "page_size", "n_items"], "i32"),
           **dict.fromkeys(["CHUNK", "BLOCK", "ROW_BLOCK", "ROW_BLOCKS"], "constexpr")}
    consts = dict(CHUNK=td.CHUNK, BLOCK=td.ITEMS_BLOCK, ROW_BLOCK=td.ITEMS_ROW_BLOCK, ROW_BLOCKS=2)
    compiled = triton.compile(ASTSource(fn=k.make_items, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32))
    assert ".target sm_90" in compiled.asm["ptx"]
    assert {"rows", "bt_stride"} <= set(k.make_items.do_not_specialize)


def pdl_instructions(ptx: str) -> list[str]:
    """The PTX's griddepcontrol instructions, in order."""
    return [line.split(";")[0].strip() for line in ptx.splitlines() if "griddepcontrol." in line]


def test_table_widths_share_compiled_kernels():
    """Each captured decode step has its own table width: nothing the kernels are compiled for may follow it one to
    one (a compile per width cost the GPU gate run about half a minute). The row count and table stride are not
    specialised on; combine's trip count is rounded to a power of two and still covers every item."""
    from kernels import triton_decode_kernels as k
    if not INTERPRETING:       # the interpreter wraps the kernels without Triton's compile options
        assert {"num_rows", "bt_stride"} <= set(k.attend_items.do_not_specialize)
    widths = range(256, 32768 + 1, 256)                 # every table width of the 1.5B shape, in slots
    bounds = [td.combine_bound(w, 256) for w in widths]
    assert len(set(bounds)) == 8 and all(b >= -(-w // 256) for b, w in zip(bounds, widths))
    assert td.combine_bound(1, 256) == 1 and td.combine_bound(4114, 256) == 32
