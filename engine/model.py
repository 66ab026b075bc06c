"""A Qwen2-family decoder as plain modules (gpt-fast style), run over one packed sequence per forward.

Linears, norms and the MLP run once over all packed positions; only attention splits: prompt-chunk positions go to
the backend's prefill kernel, decode positions (one row per request) to its decode kernel, and the two outputs are
concatenated back in packed order (chunks first, decode tokens last)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.base import AttentionBackend, AttnBatch

from .layer_kernels import EAGER_OPS


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool

    @classmethod
    def of(cls, hf_config) -> "ModelShape":
        theta = getattr(hf_config, "rope_theta", None)
        if theta is None:
            theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return cls(hf_config.vocab_size, hf_config.hidden_size, hf_config.intermediate_size,
                   hf_config.num_hidden_layers, hf_config.num_attention_heads, hf_config.num_key_value_heads,
                   head_dim, float(theta), hf_config.rms_norm_eps, hf_config.max_position_embeddings,
                   bool(getattr(hf_config, "tie_word_embeddings", False)))


@dataclass
class ForwardContext:
    """Per-forward tensors, built once by the model runner and read by every layer."""
    slot_mapping: torch.Tensor          # [T] cache slot where each packed position's K/V is written
    num_prefill: int                    # packed positions [0, num_prefill) are prompt-chunk positions
    prefill: AttnBatch | None
    decode: AttnBatch | None
    backend: AttentionBackend
    # a captured loaded step's lead decode rows (engine/step_graphs.py): (their decode batch, a [rows] bool mask of
    # the rows that are decode rows in this replay, their count: int32 [1]). They are the first packed positions;
    # the prefill kernel covers them too, over one key, and the decode kernel's output replaces its output there
    # (AttentionBackend.decode_into)
    lead: tuple[AttnBatch, torch.Tensor, torch.Tensor] | None = None
    # a forward of at most this many positions runs the MLP's gate/up GEMM and SiLU-mul as one Triton kernel
    # (kernels/mlp.py; EngineConfig.mlp_kernel "triton": the runner's mlp_rows); 0: never
    mlp_rows: int = 0
    # where the MLP's kernel choices are recorded ((rows, "triton" or "torch"), as the layers take them; in a captured
    # step, at capture): the runner's mlp_dispatched, which the gates' dispatch check holds against the configuration
    mlp_took: set | None = None
    # the same for the q/k/v, o and down projections and kernels/linear.py's split-K kernel (EngineConfig.linear_kernel
    # "triton": the runner's linear_rows, linear_dispatched)
    linear_rows: int = 0
    linear_took: set | None = None
    # the Triton kernels (the MLP's and the projections' here, the decode's in the backend) launched with
    # programmatic dependent launch (EngineConfig.pdl; kernels/pdl.py): the runner's pdl
    pdl: bool = False
    # the elementwise pieces this forward runs (the runner's `ops`: EAGER_OPS, or compiled_ops() where its
    # configuration compiles them); None: EAGER_OPS
    ops: dict | None = None

    def __post_init__(self):
        if self.ops is None:
            self.ops = EAGER_OPS

    def fuses_mlp(self, rows: int) -> bool:
        """Whether an MLP of `rows` rows runs the fused kernel; the choice recorded."""
        return _chosen(self.mlp_took, rows, self.mlp_rows)

    def linear(self, x, weight, bias=None):
        """x @ weight^T (+ bias): at most linear_rows rows through the split-K kernel, else F.linear (cuBLAS); the
        choice recorded."""
        if _chosen(self.linear_took, x.shape[0], self.linear_rows):
            from kernels.linear import splitk_linear
            from kernels.pdl import LINEAR_PREFETCH
            return splitk_linear(x, weight, bias, pdl=self.pdl, prefetch=LINEAR_PREFETCH)
        return F.linear(x, weight, bias)


def _chosen(took: set | None, rows: int, limit: int) -> bool:
    """Whether a layer of `rows` rows takes its Triton kernel (at most `limit` rows), recorded in `took` as (rows,
    "triton" or "torch")."""
    triton = rows <= limit
    if took is not None:
        took.add((rows, "triton" if triton else "torch"))
    return triton


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None, ops: dict | None = None):
        """rms_norm(x); with a residual, (rms_norm(x + residual), x + residual) in one fused piece. `ops`: the
        forward's pieces (ForwardContext.ops; None: EAGER_OPS)."""
        ops = ops or EAGER_OPS
        if residual is None:
            return ops["rms_norm"](x, self.weight, self.eps)
        return ops["add_rms_norm"](x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype):
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]     # [T, d/2], fp32 as transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Linear(nn.Linear):
    """A projection whose forward's context picks its kernel (ForwardContext.linear): o and down (q/k/v run as one
    fused weight, Attention.fuse). Without a context, F.linear."""

    def forward(self, x, ctx: ForwardContext | None = None):
        return F.linear(x, self.weight, self.bias) if ctx is None else ctx.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=True)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=True)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=True)
        self.o_proj = Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.scale = s.head_dim ** -0.5

    def fuse(self) -> None:
        """One [q; k; v] projection (one GEMM instead of three); the three modules' weights become views of it, so
        the state dict keeps transformers' names and no weight is stored twice. Call after the last .to()."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]).detach()
        nq, nk = self.q_proj.out_features, self.k_proj.out_features
        self.qkv_weight, self.qkv_bias = w, b
        for lin, lo, hi in ((self.q_proj, 0, nq), (self.k_proj, nq, nq + nk), (self.v_proj, nq + nk, len(w))):
            lin.weight = nn.Parameter(w[lo:hi], requires_grad=False)
            lin.bias = nn.Parameter(b[lo:hi], requires_grad=False)

    def forward(self, x, cos, sin, k_cache, v_cache, ctx: ForwardContext):
        T = x.shape[0]
        s = self.s
        qkv = ctx.linear(x, self.qkv_weight, self.qkv_bias).view(T, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        # a pure decode step over a backend that appends K/V in its kernel writes nothing here, and one whose kernel
        # also rotates (rotates_decode) gets the queries and keys unrotated, with cos and sin: no rotary kernel
        append = ctx.prefill is None and ctx.lead is None and ctx.decode is not None and ctx.backend.appends_decode_kv
        rotate_in_kernel = append and ctx.backend.rotates_decode
        if append:
            qk = qkv[:, :s.num_heads + s.num_kv_heads]
            if not rotate_in_kernel:
                qk = ctx.ops["rope"](qk, cos, sin)      # queries and keys rotated at once
            q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]
            v = qkv[:, s.num_heads + s.num_kv_heads:]
        else:
            # this forward's K/V written first: both kernels then read history and new positions from the pages
            flat = (-1, s.num_kv_heads, s.head_dim)
            q = ctx.ops["rope_write"](qkv, cos, sin, k_cache.view(flat), v_cache.view(flat), ctx.slot_mapping)
        n = ctx.num_prefill
        outs = []
        if ctx.prefill is not None:
            outs.append(ctx.backend.prefill(q[:n], k_cache, v_cache, ctx.prefill, self.scale))
        if ctx.decode is not None:
            kw = {"new_kv": (k, v)} if append else {}     # other backends' decode takes no new_kv
            if rotate_in_kernel:
                kw["rope"] = (cos, sin)         # a pure decode step: row i's position is packed position i
            outs.append(ctx.backend.decode(q[n:], k_cache, v_cache, ctx.decode, self.scale, **kw))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        if ctx.lead is not None:
            lead, is_decode, count = ctx.lead
            rows = lead.num_seqs
            # in place: the decode rows' outputs replace the variable-length call's there
            ctx.backend.decode_into(q[:rows], k_cache, v_cache, lead, self.scale, o[:rows], is_decode, count)
        return self.o_proj(o.reshape(T, -1), ctx)


class MLP(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = Linear(s.intermediate_size, s.hidden_size, bias=False)

    def fuse(self) -> None:
        """One [gate; up] projection, as Attention.fuse does for q, k, v."""
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
        n = self.gate_proj.out_features
        self.gate_up_weight = w
        self.gate_proj.weight = nn.Parameter(w[:n], requires_grad=False)
        self.up_proj.weight = nn.Parameter(w[n:], requires_grad=False)

    def forward(self, x, ctx: ForwardContext | None = None):
        """Where the forward's context says so (ForwardContext.fuses_mlp), gate/up and SiLU-mul as one kernel
        (kernels/mlp.py)."""
        if ctx is not None and ctx.fuses_mlp(x.shape[0]):
            from kernels.mlp import gate_up_silu
            from kernels.pdl import MLP_PREFETCH
            return self.down_proj(gate_up_silu(x, self.gate_up_weight, pdl=ctx.pdl, prefetch=MLP_PREFETCH), ctx)
        silu_mul = (ctx.ops if ctx is not None else EAGER_OPS)["silu_mul"]
        return self.down_proj(silu_mul(F.linear(x, self.gate_up_weight)), ctx)


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, ctx):
        """Returns (mlp output, residual stream before it): the next layer's norm adds the two (x + residual) in
        the same kernel that normalises them, so no layer launches a separate residual add. residual=None: the
        first layer, whose input is the embedding itself."""
        if residual is None:
            residual, h = x, self.input_layernorm(x, None, ctx.ops)
        else:
            h, residual = self.input_layernorm(x, residual, ctx.ops)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, ctx)
        h, residual = self.post_attention_layernorm(h, residual, ctx.ops)
        return self.mlp(h, ctx), residual


class Qwen2(nn.Module):
    """Parameter names follow transformers' Qwen2ForCausalLM, so its state dict loads as is."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.shape = s
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.model.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        if s.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(s.head_dim, s.rope_theta)

    @property
    def out_width(self) -> int:
        """Columns of the output: the vocabulary's logits (a captured step's static logits buffer is this wide)."""
        return self.shape.vocab_size

    def fuse(self) -> "Qwen2":
        """Fuse the q/k/v and gate/up projections (after loading and after the last .to())."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def forward(self, tokens, positions, kv_caches, ctx: ForwardContext, logit_rows: torch.Tensor | None,
                out: torch.Tensor | None = None):
        """tokens, positions: [T]; returns fp32 logits [len(logit_rows), vocab] (all rows if None), written into
        `out` when given (a captured step's static logits: no graph keeps a logits tensor of its own alive)."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer, (kc, vc) in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kc, vc, ctx)
        if logit_rows is not None:
            x, residual = x[logit_rows], residual[logit_rows]
        logits = self.lm_head(self.model.norm(x, residual, ctx.ops)[0])
        return logits.float() if out is None else out.copy_(logits)
