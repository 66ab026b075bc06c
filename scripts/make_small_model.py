"""Make the small Qwen2 test model in golden/models/qwen2-small/ (deterministic), and print the two figures that
say it is a useful test subject: how decisive its logits are (near ties on the mixed workload, fp32 and fp16) and
how much its greedy output depends on history (a perturbed early page changes the continuation).

    python scripts/make_small_model.py            # write the model, then probe it
    python scripts/make_small_model.py --probe    # probe the committed model only
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import Engine, EngineConfig  # noqa: E402
from engine.loader import SMALL_MODEL_DIR, qwen2_config  # noqa: E402
from engine.workload import MIXED_CPU  # noqa: E402

SEED = 20261129
LM_HEAD_SCALE = 2.0
CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rope_theta=10000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.5,
              bos_token_id=1, eos_token_id=2)


def make(out: Path) -> None:
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(SEED)
    cfg = qwen2_config(**CONFIG)
    model = Qwen2ForCausalLM(cfg)   # transformers' init draws N(0, initializer_range) for every linear/embedding
    with torch.no_grad():
        # std 0.5 keeps outputs varied and history-dependent (at the default 0.02 a random model repeats one
        # token); a 2x wider lm_head spreads the logits so that top-2 near ties stay under 1% of positions
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model = model.half()   # stored in fp16 to stay a few MB; fp32 runs upcast the same values
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    # keep the directory to config.json + model.safetensors
    for f in out.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()


def near_tie_rate(dtype: str, thr: float = 0.02) -> tuple[float, int, int, int]:
    e = Engine(EngineConfig(dtype=dtype, record_topk=2, chunk_tokens=128))
    res = e.run(MIXED_CPU.requests())
    gaps = [vals[0] - vals[1] for rid in res for _, vals in e.topk[rid]]
    distinct = len({t for r in res.values() for t in r.tokens})
    emitted = sum(len(r.tokens) for r in res.values())
    return sum(g < thr for g in gaps) / len(gaps), len(gaps), distinct, emitted


def history_dependence(specs=None, loaded=None, device="cpu", scale: float = 1.0) -> tuple[int, int]:
    """Per request: generate alone, then again with its first page's K/V perturbed right after its prompt; count
    requests whose continuation (after token 1) changes. Defaults: MIXED_CPU's requests, the committed small model."""
    specs = MIXED_CPU.requests() if specs is None else specs
    changed = 0
    for s in specs:
        outs = []
        for perturb in (False, True):
            e = Engine(EngineConfig(chunk_tokens=128, max_batch=1, num_pages=64, device=device,
                                    compile_warmup=False), loaded=loaded)
            e.submit(s.prompt, s.budget, s.request_id)
            r = e.requests[s.request_id]
            while e.scheduler.has_work:
                e.step()
                if perturb and len(r.output) == 1 and r.num_cached == r.prompt_len:
                    e.runner.perturb_page(e.pool.owned[s.request_id][0], scale)
            outs.append(r.output)
        changed += outs[0][1:] != outs[1][1:]
    return changed, len(specs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", action="store_true", help="only probe the committed model")
    ap.add_argument("--out", default=str(SMALL_MODEL_DIR))
    args = ap.parse_args()
    if not args.probe:
        make(Path(args.out))
        print(f"wrote {args.out}: {json.dumps(CONFIG)}")
    for dtype in ("float32", "float16"):
        rate, n, distinct, emitted = near_tie_rate(dtype)
        print(f"{dtype}: near ties (top-2 gap < 0.02) {rate:.2%} of {n} emitted positions; "
              f"{distinct} distinct tokens in {emitted} emitted")
    changed, total = history_dependence()
    print(f"history: perturbing the first page's K/V after the prompt changed the continuation in "
          f"{changed} of {total} requests ({changed / total:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
