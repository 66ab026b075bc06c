"""The pure decode step's layer chain on the 1.5B shape, for the probes that time it in one CUDA graph
(scripts/probes/pdl_chain.py, read_floor.py): each layer's own weights and K/V cache, the rows' block table, work
items and rotary embedding, and one layer as the engine runs it (add + RMSNorm compiled, q/k/v, the Triton decode
with its append and rotary, o, add + RMSNorm, the fused gate/up + SiLU-mul, down). A helper, not a command."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Qwen2.5-1.5B
HIDDEN, INTER, HEADS, KV_HEADS, D, VOCAB = 1536, 8960, 12, 2, 128, 151936
EPS = 1e-6
PAGE = 256
COPY_RATES = {"H200": 4.2e12, "H100": 3.35e12}     # bytes/s: the measured copy rates (issue 37, docs/RESULTS.md)


def copy_rate(device_name: str) -> float:
    """The copy rate issue 37 measured on this card (the H200's for another)."""
    return next((r for card, r in COPY_RATES.items() if card in device_name), COPY_RATES["H200"])


def add_norm(o, residual, weight):
    s = o + residual
    x = s.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)).to(s.dtype), s


@dataclass
class Chain:
    """What a chain of `layers` pure decode layers at `rows` rows reads: `weights` (a dict a layer), `caches` ((K, V)
    a layer), and the step's table, cached lengths, work items, rotary cos / sin and input (x0, residual r0)."""
    rows: int
    weights: list
    caches: list
    table: torch.Tensor
    cached: torch.Tensor
    items: tuple
    cos: torch.Tensor
    sin: torch.Tensor
    x0: torch.Tensor
    r0: torch.Tensor
    keys: int

    @property
    def kv_bytes(self) -> int:
        """K and V bytes a layer: the rows' cached keys' (what the decode must read)."""
        return self.keys * KV_HEADS * D * 2 * 2

    @property
    def w_bytes(self) -> int:
        """Weight bytes a layer (norm weights and the q/k/v bias included)."""
        return sum(t.numel() * t.element_size() for t in self.weights[0].values())

    def layer(self, x, res, ly, cache, norm, lin=F.linear, pdl=False, mlp_prefetch=0, hooks=None):
        """One layer as the engine runs it at these rows: -> (the layer's output before its residual add, residual).
        `norm`: the add + RMSNorm (compiled by the caller); `lin`: the projections' GEMM. `hooks`: {point: f()} run
        at "start", "attended" (after the decode), "mlp" (before the gate/up) and "down" (before the down
        projection), for probes that launch work beside the layer's (scripts/probes/side_prefetch.py)."""
        from kernels.triton_decode import paged_decode
        hook = (hooks or {}).get
        m = self.rows
        hook("start", _none)()
        h, res = norm(x, res, ly["n1"])
        qkv = lin(h, ly["qkv"], ly["bqkv"]).view(m, HEADS + 2 * KV_HEADS, D)
        q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
        att = paged_decode(q, cache[0], cache[1], self.table, self.cached, D ** -0.5, new_kv=(k, v),
                           items=self.items, rope=(self.cos, self.sin), pdl=pdl)
        hook("attended", _none)()
        h, res = norm(lin(att.reshape(m, HEADS * D), ly["o"]), res, ly["n2"])
        hook("mlp", _none)()
        act = self.mlp(h, ly["gu"], pdl, mlp_prefetch)
        hook("down", _none)()
        return lin(act, ly["down"]), res

    def mlp(self, h, w, pdl=False, prefetch=0):
        """The gate/up GEMM and SiLU-mul as the engine runs them at these rows: the fused kernel up to
        kernels.mlp.FUSED_ROWS rows, cuBLAS and the compiled SiLU-mul above."""
        from kernels.mlp import FUSED_ROWS, gate_up_silu
        if self.rows <= FUSED_ROWS:
            return gate_up_silu(h, w, pdl=pdl, prefetch=prefetch)
        from engine.layer_kernels import compiled_ops
        return compiled_ops()["silu_mul"](F.linear(h, w))     # the flash engine's compiled piece, as it serves it


def chain_args(ap) -> None:
    """The options of every probe that builds the chain: rows, layers in the graph, replays, the rows' prompts."""
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--prompts", default="16,64,256,1024,4096", help="the rows' prompt lengths, drawn uniformly "
                    "(the mixed workload's), each with 0-64 tokens decoded")


def _none():
    return None


def build(rows: int, layers: int, prompts: list[int], dev: torch.device, dt=torch.float16) -> Chain:
    """Seeded random weights and caches; the rows' lengths a seeded draw of `prompts` (each with 0-64 tokens
    decoded), their pages contiguous from page 1."""
    from kernels.triton_decode import CHUNK, max_items, work_items
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=0.02):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g) * scale

    weights = [dict(qkv=rnd((HEADS + 2 * KV_HEADS) * D, HIDDEN), bqkv=rnd((HEADS + 2 * KV_HEADS) * D),
                    o=rnd(HIDDEN, HEADS * D), gu=rnd(2 * INTER, HIDDEN), down=rnd(HIDDEN, INTER),
                    n1=torch.rand(HIDDEN, device=dev, dtype=dt, generator=g) + 0.5,
                    n2=torch.rand(HIDDEN, device=dev, dtype=dt, generator=g) + 0.5) for _ in range(layers)]
    cpu = torch.Generator().manual_seed(1)
    p = torch.tensor(prompts)
    lens = p[torch.randint(len(p), (rows,), generator=cpu)] + torch.randint(0, 65, (rows,), generator=cpu)
    pages_of = [-(-(int(n) + 1) // PAGE) for n in lens]
    table = torch.zeros(rows, max(pages_of), dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(pages_of):
        table[i, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    table = table.to(dev)
    cached = lens.to(torch.int32).to(dev)
    caches = [(rnd(nxt, PAGE, KV_HEADS, D, scale=1.0), rnd(nxt, PAGE, KV_HEADS, D, scale=1.0)) for _ in range(layers)]
    items = work_items(cached, max_items(rows, table.shape[1] * PAGE, nxt * PAGE, CHUNK), CHUNK, table, PAGE)
    pos = lens.to(dev).float()[:, None]
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
    emb = torch.cat([pos * inv, pos * inv], -1)
    return Chain(rows, weights, caches, table, cached, items, emb.cos().to(dt), emb.sin().to(dt),
                 rnd(rows, HIDDEN, scale=1.0), rnd(rows, HIDDEN, scale=1.0), int(lens.sum()))
