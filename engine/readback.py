"""A step's sampled rows on their way to the host: the one host readback per step. Each step's copies are queued
right behind it, so a step launched ahead (ModelRunner.launch_ahead) does not delay the readback of the step before
it. Apart from the runner because every runner returns them: the one-device runner and tensor parallel's
(engine/tp/)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepOutput:
    """Host lists, one entry per sampled row: completing prompt chunks first, then decode tokens (plan order)."""
    tokens: list[int]
    nonfinite: list[bool] = field(default_factory=list)      # poison mode only
    topk_ids: list[list[int]] = field(default_factory=list)  # record mode only
    topk_vals: list[list[float]] = field(default_factory=list)

    def result(self) -> "StepOutput":
        """Already on the host (as `Sampled.result()`, for steps that were read back at once)."""
        return self


class Sampled:
    """A step's sampled rows, still on the device: greedy tokens (and in poison mode which rows were not finite, in
    record mode the top-k). Their copies to pinned host memory are queued right behind the step, before anything
    launched after it, and `result()` waits for those copies alone: a step launched ahead (ModelRunner.launch_ahead)
    does not delay this one's readback. Off CUDA the copies are plain reads."""

    def __init__(self, tokens: torch.Tensor, nonfinite: torch.Tensor | None = None, topk=None):
        self.tokens = tokens                 # on the device: a step launched ahead reads its input tokens here
        parts = [tokens] + ([nonfinite] if nonfinite is not None else []) + (list(topk[::-1]) if topk else [])
        self.has = (nonfinite is not None, topk is not None)
        self.done = None
        if tokens.device.type == "cuda":
            # pinned (the host allocator caches the blocks) so that the copy is asynchronous; the event marks it done
            self.parts = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                          for p in parts]
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.parts = parts

    def result(self) -> StepOutput:
        """One host wait: for this step's copies (and so for this step's kernels), not for steps queued after it."""
        if self.done is not None:
            self.done.synchronize()
        parts = iter(self.parts)
        out = StepOutput(next(parts).tolist())
        if self.has[0]:
            out.nonfinite = [bool(x) for x in next(parts).tolist()]
        if self.has[1]:
            out.topk_ids, out.topk_vals = next(parts).tolist(), next(parts).tolist()
        return out
