"""Tensor-parallel pieces of the model: which heads, MLP columns and vocabulary rows each rank holds, the sharded
layers, and the exact greedy choice over vocabulary shards.

Column-parallel q/k/v and gate/up need nothing but their rows of the weights: each rank computes its own heads and
its own slice of the MLP. Row-parallel o and down multiply each rank's slice of their input features, so their
outputs are partial sums that an all-reduce adds up. The embedding and the lm head are split by vocabulary rows:
an embedding row lives on one rank (the others add zeros), and each rank's logits cover its own rows only."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from ..model import Linear, ModelShape, Qwen2, Rotary

# ids travel as fp32 beside the logits (one gather per step): exact below 2**24
MAX_VOCAB = 1 << 24


def check_tp(s: ModelShape, tp: int) -> None:
    """Bad splits get a clear error at construction, not a wrong answer later."""
    problems = []
    if s.num_heads % tp:
        problems.append(f"{s.num_heads} attention heads do not split over {tp} ranks")
    if s.num_kv_heads >= tp and s.num_kv_heads % tp:
        problems.append(f"{s.num_kv_heads} key/value heads do not split over {tp} ranks")
    if s.num_kv_heads < tp and tp % s.num_kv_heads:
        problems.append(f"{s.num_kv_heads} key/value heads cannot be replicated evenly over {tp} ranks")
    if s.intermediate_size % tp:
        problems.append(f"MLP width {s.intermediate_size} does not split over {tp} ranks")
    if s.vocab_size % tp:
        problems.append(f"vocabulary {s.vocab_size} does not split over {tp} ranks")
    if s.vocab_size >= MAX_VOCAB:
        problems.append(f"vocabulary {s.vocab_size} is too large for the fp32 token gather")
    if problems:
        raise ConfigError(f"tp={tp} cannot shard this model: " + "; ".join(problems))


def rank_shape(s: ModelShape, tp: int) -> ModelShape:
    """One rank's shape: its heads, key/value heads (split, or one replicated head when there are fewer than
    ranks), MLP width and vocabulary rows. tp=1: the whole model."""
    if tp == 1:
        return s
    check_tp(s, tp)
    return replace(s, num_heads=s.num_heads // tp, num_kv_heads=max(1, s.num_kv_heads // tp),
                   intermediate_size=s.intermediate_size // tp, vocab_size=s.vocab_size // tp)


def q_heads(s: ModelShape, tp: int, rank: int) -> range:
    n = s.num_heads // tp
    return range(rank * n, (rank + 1) * n)


def kv_heads(s: ModelShape, tp: int, rank: int) -> range:
    """The key/value heads that rank's query heads read: its own share, or (fewer heads than ranks) the one head
    its query heads' group shares with the neighbouring ranks."""
    first = rank * s.num_kv_heads // tp
    return range(first, first + max(1, s.num_kv_heads // tp))


def vocab_rows(s: ModelShape, tp: int, rank: int) -> range:
    n = s.vocab_size // tp
    return range(rank * n, (rank + 1) * n)


def _rows(heads: range, d: int) -> slice:
    return slice(heads.start * d, heads.stop * d)


def shard_state(state: dict[str, torch.Tensor], s: ModelShape, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """That rank's slice of every weight of a transformers-named Qwen2 state dict (norms are replicated)."""
    d, width = s.head_dim, s.intermediate_size // tp
    q, kv = _rows(q_heads(s, tp, rank), d), _rows(kv_heads(s, tp, rank), d)
    vocab = slice(vocab_rows(s, tp, rank).start, vocab_rows(s, tp, rank).stop)
    mlp = slice(rank * width, (rank + 1) * width)
    rules = {   # name suffix -> (dimension, slice)
        "q_proj.weight": (0, q), "q_proj.bias": (0, q),
        "k_proj.weight": (0, kv), "k_proj.bias": (0, kv), "v_proj.weight": (0, kv), "v_proj.bias": (0, kv),
        "o_proj.weight": (1, q),
        "gate_proj.weight": (0, mlp), "up_proj.weight": (0, mlp), "down_proj.weight": (1, mlp),
        "embed_tokens.weight": (0, vocab), "lm_head.weight": (0, vocab),
    }
    out = {}
    for name, t in state.items():
        rule = next((r for suffix, r in rules.items() if name.endswith(suffix)), None)
        if rule is None:
            out[name] = t
        else:
            dim, sl = rule
            out[name] = (t[sl] if dim == 0 else t[:, sl]).contiguous()
    return out


class RowParallelLinear(Linear):
    """o and down: this rank's slice of the input features times its columns of the weight gives a partial sum;
    the all-reduce over `group` (anything with an in-place all_reduce) adds the ranks' partials."""
    group = None

    def forward(self, x, ctx=None):
        out = super().forward(x, ctx)
        self.group.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows [first, first + num_embeddings) of the embedding: ids outside them give zeros here and their row on
    the rank that holds it, so the all-reduce is exact."""
    group = None
    first = 0

    def forward(self, ids):
        local = ids - self.first
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        x = x.masked_fill(~inside[:, None], 0)
        self.group.all_reduce(x)
        return x


def local_model(state: dict[str, torch.Tensor], s: ModelShape, tp: int, rank: int, group, device, dtype) -> Qwen2:
    """That rank's model from its shard of the state dict (shard_state): a Qwen2 of the rank's shape whose o, down
    and embedding reduce over `group`; its lm head gives this rank's vocabulary rows of the logits."""
    ls = rank_shape(s, tp)
    with torch.device("meta"):     # no throwaway initialisation: every weight comes from the shard
        m = Qwen2(ls)
        for layer in m.model.layers:   # Qwen2's o and down have no bias
            layer.self_attn.o_proj = RowParallelLinear(ls.num_heads * ls.head_dim, ls.hidden_size, bias=False)
            layer.mlp.down_proj = RowParallelLinear(ls.intermediate_size, ls.hidden_size, bias=False)
        m.model.embed_tokens = VocabParallelEmbedding(ls.vocab_size, ls.hidden_size)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    missing, _ = m.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and ls.tie_word_embeddings)]
    if missing:
        raise ValueError(f"rank {rank}'s shard is missing weights: {missing[:5]}")
    if ls.tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
    # cast as load_model's .to(dtype) casts it at tp 1: the rotary frequencies in the model's dtype
    m.rotary = Rotary(s.head_dim, s.rope_theta).to(device=device, dtype=dtype)
    for layer in m.model.layers:
        layer.self_attn.o_proj.group = layer.mlp.down_proj.group = group
    m.model.embed_tokens.group = group
    m.model.embed_tokens.first = vocab_rows(s, tp, rank).start
    return m.eval().fuse()


# -- the greedy choice over vocabulary shards ---------------------------------------------------------------------
def shard_summary(logits: torch.Tensor, first: int, k: int) -> torch.Tensor:
    """Per row of this rank's logits [rows, V/tp]: [max, its id, non-finite?, top-k values, top-k ids], fp32."""
    best, arg = logits.max(-1)   # first index of the maximum, as torch.argmax
    cols = [best[:, None], (arg + first).float()[:, None], (~torch.isfinite(logits).all(-1)).float()[:, None]]
    if k:
        vals, ids = logits.topk(k, dim=-1)
        cols += [vals, (ids + first).float()]
    return torch.cat(cols, dim=1)


def combine(gathered: torch.Tensor, k: int):
    """Every rank's summaries [tp, rows, 3 + 2k] -> (tokens, non-finite, top-k values, top-k ids) over the whole
    vocabulary. The token is exactly torch.argmax's over all logits: among equal maxima the lowest rank holds the
    lowest id, and within a rank max() returns the first."""
    tp, rows = gathered.shape[:2]
    vals = gathered[..., 0]
    best = vals.max(0).values
    rank_ids = torch.arange(tp, device=gathered.device)[:, None].expand(tp, rows)
    winner = torch.where(vals == best, rank_ids, tp).min(0).values.clamp(max=tp - 1)
    tokens = gathered[..., 1].gather(0, winner[None]).squeeze(0)
    nonfinite = gathered[..., 2].amax(0)
    if not k:
        return tokens, nonfinite, None, None
    cand_v = gathered[..., 3:3 + k].permute(1, 0, 2).reshape(rows, tp * k)
    cand_i = gathered[..., 3 + k:].permute(1, 0, 2).reshape(rows, tp * k)
    top_v, where = cand_v.topk(k, dim=-1)
    return tokens, nonfinite, top_v, cand_i.gather(1, where)


class ChoiceModel(nn.Module):
    """A rank's model whose output is every row's greedy choice over the whole vocabulary, packed [rows, 2 + 2k]
    fp32: token, non-finite (on any rank), top-k values, top-k ids. The gather runs inside the forward, so a captured
    decode step holds it too; every rank computes the same choice from the same gathered summaries."""

    def __init__(self, shard: Qwen2, group, first: int, k: int):
        super().__init__()
        self.shard, self.group, self.first, self.k = shard, group, first, k
        self.shape = shard.shape

    @property
    def out_width(self) -> int:
        """Columns of the packed output (a captured step's static output buffer is this wide)."""
        return 2 + 2 * self.k

    def forward(self, *args, out: torch.Tensor | None = None):
        """As Qwen2.forward, `out` included: a captured step writes its packed choice into the static buffer."""
        logits = self.shard(*args)
        gathered = self.group.all_gather(shard_summary(logits, self.first, self.k))
        tokens, nonfinite, top_v, top_i = combine(gathered, self.k)
        packed = torch.cat([tokens[:, None], nonfinite[:, None]] + ([top_v, top_i] if self.k else []), dim=1)
        return packed if out is None else out.copy_(packed)
