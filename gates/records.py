"""What a generation run leaves for comparison: per request the prompt, the emitted tokens, the top-k logits at
every emitted position, and (for engine configurations) the step at which each token was emitted. No tensors."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GenRecord:
    request_id: str
    prompt: list[int]
    tokens: list[int]
    topk_ids: list[list[int]]       # per emitted position, descending by logit
    topk_vals: list[list[float]]    # raw logits, fp32
    steps: list[int] | None = None  # engine configurations only

    def logit(self, pos: int, token: int) -> float | None:
        """Raw logit of `token` at emitted position `pos`, or None if it is outside the recorded top-k."""
        ids = self.topk_ids[pos]
        return self.topk_vals[pos][ids.index(token)] if token in ids else None

    def floor(self, pos: int) -> float:
        """Every token outside the top-k has a logit at most this."""
        return self.topk_vals[pos][-1]

    def to_json(self) -> dict:
        d = asdict(self)
        d["topk_vals"] = [[round(v, 6) for v in row] for row in self.topk_vals]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "GenRecord":
        return cls(d["request_id"], d["prompt"], d["tokens"], d["topk_ids"], d["topk_vals"], d.get("steps"))
