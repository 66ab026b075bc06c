"""Reference engines. Each can (a) generate a workload greedily with top-k logits recorded at every emitted
position, and (b) score a given token sequence in one forward (teacher forcing): the logits at every position.

`hf` is transformers' own model, eager and greedy: ground truth, not our engine. The lineage configurations
(`chunked`, `fused`, `flash`) are our engine with a given forward mode, backend and page size."""
from __future__ import annotations

import torch

from engine import Engine, EngineConfig, lineage_config
from engine.dtypes import torch_dtype
from engine.loader import hf_model, load_model
from engine.schedule_log import ScheduleLog
from engine.workload import RequestSpec

from .failure import GateFailure
from .records import GenRecord

TOPK = 8
KV_BYTES: int | None = None     # set by the gate options: the KV budget of every engine built here (None: the
                                # engine's own), so that xdist workers sharing one GPU fit their pools together


class Reference:
    name: str

    def generate(self, specs: list[RequestSpec]) -> dict[str, GenRecord]:
        raise NotImplementedError

    def score(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """fp32 logits [len(tokens), vocab]: row i is what the model predicts for tokens[i] given prompt +
        tokens[:i], from one forward over prompt + tokens[:-1]."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": self.name}


class HFReference(Reference):
    name = "hf"

    def __init__(self, model=None, device="cpu", dtype="float32"):
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype)
        self.model = hf_model(model, self.dtype, self.device)
        self.model.generation_config.eos_token_id = None   # greedy ignores EOS: budgets are honoured
        self.model.generation_config.pad_token_id = 0

    @torch.inference_mode()
    def generate(self, specs, progress=None) -> dict[str, GenRecord]:
        out = {}
        for s in specs:
            ids = torch.tensor([s.prompt], device=self.device)
            g = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.budget,
                                    min_new_tokens=s.budget, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
            tokens = g.sequences[0, len(s.prompt):].tolist()
            logits = torch.stack([x[0] for x in g.logits]).float()      # raw logits, before any processor
            vals, idx = logits.topk(TOPK, dim=-1)
            out[s.request_id] = GenRecord(s.request_id, list(s.prompt), tokens, idx.tolist(), vals.tolist())
            if progress:
                progress(1)
        return out

    @torch.inference_mode()
    def score(self, prompt, tokens):
        seq = torch.tensor([list(prompt) + list(tokens[:-1])], device=self.device)
        logits = self.model(seq).logits[0].float()
        return logits[len(prompt) - 1:].cpu()

    @torch.inference_mode()
    def probe(self, prefix: list[int], decode_from: int, shift: int = 0, blind_to_self: bool = False) -> torch.Tensor:
        """The logits after `prefix` (fp32, on the host) with its tokens from index `decode_from` on (those a decode
        row fed) changed as a decode-row bug would change them: placed `shift` positions off, or each blind to its
        own key (a cache length one short). For triage: which change reproduces a failing candidate's logits."""
        n = len(prefix)
        pos = torch.arange(n, device=self.device)
        pos[decode_from:] += shift
        sees = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        if blind_to_self:
            rows = torch.arange(decode_from, n, device=self.device)
            sees[rows, rows] = False
        # an additive 4-D mask is used as given (transformers' eager attention); 0 where a query sees a key
        mask = torch.zeros(n, n, device=self.device, dtype=self.dtype).masked_fill(~sees, torch.finfo(self.dtype).min)
        ids = torch.tensor([list(prefix)], device=self.device)
        return self.model(ids, attention_mask=mask[None, None], position_ids=pos[None]).logits[0, -1].float().cpu()

    def describe(self):
        return {"name": self.name, "implementation": "transformers Qwen2ForCausalLM, eager attention, generate()",
                "dtype": str(self.dtype), "device": str(self.device)}


class LazyReference:
    """A reference's score and probe that make it at their first call: a gate that passes never loads its model."""

    def __init__(self, make):
        self.make = make

    def score(self, prompt, tokens):
        return self.make().score(prompt, tokens)

    def probe(self, *args, **kwargs):
        return self.make().probe(*args, **kwargs)


class EngineReference(Reference):
    """One of our engine configurations. Records the step at which each token was emitted."""

    def __init__(self, name: str, model=None, device="cpu", dtype="float32", loaded=None, **overrides):
        self.name = name
        self.config = self.config_for(name, device, dtype, **overrides)
        self.model = model
        self.loaded = loaded or load_model(model, torch_dtype(dtype), device)

    @staticmethod
    def config_for(name: str, device="cpu", dtype="float32", **overrides) -> EngineConfig:
        """The configuration such a reference runs (the gate prewarm reads it without loading the model)."""
        kw = dict(device=device, dtype=dtype, record_topk=TOPK)
        if KV_BYTES is not None:
            kw["kv_cache_bytes"] = KV_BYTES
        kw.update(overrides)
        return lineage_config(name, **kw) if name in ("chunked", "fused", "flash") else EngineConfig(**kw)

    def engine(self, **parts) -> Engine:
        """A new engine of this configuration; `parts`: Engine's bookkeeping classes (pool_cls, scheduler_cls)."""
        # the whole schedule log kept: every gate run is checked against it (gates/schedule_check.py)
        e = Engine(self.config, loaded=self.loaded, schedule_log=ScheduleLog(), **parts)
        # the gates' engines share one model's weights: an engine that loads its own copy (of the default model, say)
        # would pass every token check while a server's engines each took the memory of another copy
        if e.model is not self.loaded[0]:
            raise GateFailure(f"{self.name}: the engine given loaded=(model, config, name) serves another model "
                              f"object, loaded anew")
        source = getattr(e.runner, "source", None)     # tp > 1: the workers' shards, sent by rank 0
        if source is not None:
            raise GateFailure(f"{self.name}: the engine given loaded=(model, config, name) at tp {e.config.tp} has its "
                              f"worker ranks load {str(source)!r} themselves: they serve another model than rank 0's")
        return e

    def generate(self, specs, progress=None) -> dict[str, GenRecord]:
        e = self.engine()
        e.run(specs, progress=(lambda rec: progress(0)) if progress else None)
        self.last_engine = e
        return records_of(e)

    def score(self, prompt, tokens):
        e = self.engine() if not hasattr(self, "_scorer") else self._scorer
        self._scorer = e
        logits = e.score(list(prompt) + list(tokens[:-1]))
        return logits[len(prompt) - 1:]

    def describe(self):
        """The configuration as served (every None decided: the kernels, captured steps, overlap), from the engine
        that generated, else as this machine would decide it."""
        e = getattr(self, "last_engine", None)
        served = e.served if e is not None else self.config.resolved()
        return {"name": self.name, "config": served.describe()}


def records_of(e: Engine) -> dict[str, GenRecord]:
    """What an engine's run leaves for comparison: per request its prompt, tokens, top-k logits and steps."""
    out = {}
    for rid, r in e.results().items():
        tk = e.topk.get(rid, [])
        out[rid] = GenRecord(rid, r.prompt, r.tokens, [t[0] for t in tk], [t[1] for t in tk], r.token_steps)
    return out


def make_reference(name: str, model=None, device="cpu", dtype="float32", loaded=None, **overrides) -> Reference:
    if name == "hf":
        return HFReference(model, device, dtype)
    return EngineReference(name, model, device, dtype, loaded=loaded, **overrides)
