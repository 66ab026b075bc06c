"""The peer: transformers' own continuous batching (`init_continuous_batching`) on the same weights and closed
workloads as ours, with per-request `max_new_tokens` and EOS disabled so that budgets are honoured."""
from __future__ import annotations

import inspect
import time

import torch

from engine.dtypes import torch_dtype

from .runs import Setup
from .stats import progress


def _accepts(fn, name) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Peer:
    """transformers' own continuous batching on the same weights: a manager per workload (its warm-ups and reps
    share it), requests added with their own max_new_tokens, EOS disabled, greedy."""

    def __init__(self, setup: Setup, options):
        from engine.loader import hf_model
        self.s = setup
        self.o = options
        self.model = hf_model(setup.model_arg, torch_dtype(setup.dtype), setup.device)
        if options.peer_attn and options.peer_attn != "eager":
            self.model.set_attn_implementation(options.peer_attn)
        import transformers
        self.version = transformers.__version__

    def manager(self, specs):
        from transformers import GenerationConfig
        budget = max(s.budget for s in specs)
        gen = GenerationConfig(max_new_tokens=budget, do_sample=False, eos_token_id=-1, pad_token_id=0)
        # size its cache like ours: a full batch of the largest requests, and its per-step tokens like ours
        page = 256
        biggest = sorted((len(s.prompt) + s.budget for s in specs), reverse=True)[:self.s.max_batch]
        num_blocks = sum(-(-n // page) for n in biggest) + 2
        cb = dict(num_blocks=num_blocks, max_batch_tokens=self.s.chunk_tokens + self.s.max_batch,
                  max_requests_per_batch=self.s.max_batch, page_size=page, block_size=page)
        init = self.model.init_continuous_batching
        kw = {"generation_config": gen}
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            ContinuousBatchingConfig = None
        if ContinuousBatchingConfig is not None and _accepts(init, "continuous_batching_config"):
            params = inspect.signature(ContinuousBatchingConfig.__init__).parameters
            kw["continuous_batching_config"] = ContinuousBatchingConfig(
                **{k: v for k, v in cb.items() if k in params and not (k == "block_size" and "page_size" in params)})
        else:   # older 5.x: the cache's sizes live on the generation config
            for k, v in cb.items():
                setattr(gen, k, v)
        mgr = init(**kw)
        mgr.start()
        # the implementation it serves with (transformers may switch sdpa to paged|sdpa or to flash-attn; it
        # restores the original at stop)
        self.impl = getattr(self.model.config, "_attn_implementation", None)
        return mgr

    def serve(self, mgr, specs, tag, quiet, desc):
        add_kw = {}
        if _accepts(mgr.add_request, "eos_token_id"):
            add_kw["eos_token_id"] = -1
        ids = {}
        bar = progress(len(specs), desc, disable=quiet)
        t0 = time.perf_counter()
        for s in specs:
            rid = f"{s.request_id}{tag}"
            ids[rid] = s
            mgr.add_request(input_ids=list(s.prompt), request_id=rid, max_new_tokens=s.budget, **add_kw)
        out = {}
        deadline = t0 + self.o.peer_timeout
        while len(out) < len(specs):
            r = mgr.get_result(timeout=1)
            if r is None:
                if time.perf_counter() > deadline or not mgr.is_running():
                    raise RuntimeError(f"peer: {len(specs) - len(out)} requests never finished "
                                       f"(manager running: {mgr.is_running()})")
                continue
            if r.request_id in ids and r.is_finished():
                out[r.request_id] = r
                bar.update(1)
        t = time.perf_counter() - t0
        bar.close()
        errors = [r.error for r in out.values() if getattr(r, "error", None)]
        if errors:
            raise RuntimeError(f"peer: {len(errors)} requests failed: {errors[0]}")
        tokens = {ids[k].request_id: list(r.generated_tokens) for k, r in out.items()}
        return t, tokens

    def closed(self, specs, name, warmups, reps, ours: dict[str, list[int]]) -> tuple[list[float], dict, list[dict]]:
        """Warm-ups and reps of one closed workload: (the reps' times to the last request, what the peer is and how
        its tokens compare with `ours`, one row per run: the caller numbers them and adds its columns)."""
        mgr = self.manager(specs)
        times, tokens, rows = [], {}, []
        try:
            for i in range(warmups + reps):
                warm = i < warmups
                # a warm-up only has to reach every kernel and allocation once: a short one does (the peer on 200
                # requests takes minutes per run on an H200)
                run_specs = specs[:self.o.peer_warmup_requests] if warm and self.o.peer_warmup_requests else specs
                t, tokens = self.serve(mgr, run_specs, f"-p{i}", self.o.no_progress,
                                       f"peer {name} {'warm-up' if warm else 'rep'} {i + 1}")
                ok = sum(len(tokens[s.request_id]) == s.budget for s in run_specs)
                rows.append(dict(batch=len(run_specs), rep=i, warmup=warm, time_to_last_s=t, requests=len(run_specs),
                                 tokens=sum(len(v) for v in tokens.values()), budgets_honoured=ok,
                                 peer="transformers-cb", peer_version=self.version))
                if not warm:
                    times.append(t)
        finally:
            mgr.stop(block=True)
            if hasattr(mgr, "destroy"):
                try:
                    mgr.destroy()
                except Exception:   # noqa: BLE001 (cleanup only)
                    pass
        same = sum(ours.get(s.request_id) == tokens.get(s.request_id) for s in specs)
        return times, dict(attn_implementation=self.impl, transformers=self.version,
                           budgets_honoured=f"{sum(len(tokens.get(s.request_id, [])) == s.budget for s in specs)}"
                                            f"/{len(specs)}", same_tokens=same), rows

    def close(self):
        del self.model
        if torch.device(self.s.device).type == "cuda":
            torch.cuda.empty_cache()
