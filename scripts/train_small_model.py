"""Train a small Qwen2 test model (the same shape and config as golden/models/qwen2-small) whose greedy decisions
are decisive, yet depend on the attention history.

Why: the committed random-weight model (N(0, 0.5) weights) has logits of magnitude ~95 with near ties, so in fp16
two correct engines (transformers vs ours) disagree on most requests by more than the gates' 0.02 tie rule. A
trained model, with logit-scale control (z-loss, label smoothing), has top-1 minus top-2 gaps of several units and
logits of moderate size, so fp16 engines agree; and because its task needs attention over the whole history, a
kernel that reads the wrong pages or positions changes its tokens.

The teacher rule, defined at every position of any sequence (x_t is the current last token):
  * if x_t occurred earlier (before t), the next token is the token that followed its MOST RECENT earlier
    occurrence (induction / copy);
  * otherwise the next token is S[x_t], S a fixed random permutation of [3, 4000) seeded by --perm-seed (bigram).
Training rows: a uniform random prompt of ids in [3, 4000) (length log-uniform in [4, --max-prompt]) followed by the
rule's continuation up to --seq-len; the loss covers the last prompt position and the continuation.

    python scripts/train_small_model.py --seconds 90 --device cuda --out /tmp/qwen2-small-trained
    python scripts/train_small_model.py --eval-only /tmp/qwen2-small-trained --device cuda
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine import Engine, EngineConfig  # noqa: E402
from engine.loader import load_model, qwen2_config  # noqa: E402
from engine.workload import MIXED_CPU  # noqa: E402
from make_small_model import CONFIG, history_dependence  # noqa: E402

LO, HI = 3, 4000          # prompt token ids (engine/workload.py) and the domain of S
PERM_SEED = 20261130


# -- the teacher rule --------------------------------------------------------------------------------------------
def perm_table(seed: int = PERM_SEED, vocab: int = CONFIG["vocab_size"]) -> list[int]:
    """S as a full-vocabulary table: a seeded permutation on [LO, HI), identity elsewhere (never used)."""
    s = list(range(vocab))
    s[LO:HI] = random.Random(seed).sample(range(LO, HI), HI - LO)
    return s


def rule_continue(prompt: list[int], n: int, S: list[int]) -> list[int]:
    """Reference (pure Python): the rule's next n tokens after `prompt`."""
    seq, fol = list(prompt), {}
    for a, b in zip(seq, seq[1:]):
        fol[a] = b                       # later pairs overwrite: the most recent occurrence wins
    for _ in range(n):
        x = seq[-1]
        y = fol.get(x, S[x])
        fol[x] = y
        seq.append(y)
    return seq[len(prompt):]


@torch.no_grad()
def make_rows(n: int, seq_len: int, max_prompt: int, S: torch.Tensor, gen: torch.Generator):
    """n rows of seq_len + 1 tokens, vectorised over rows (one loop over positions). Returns (seq, prompt lengths,
    copy) where copy[b, t] says the rule copied at position t (x_t occurred before t)."""
    dev = S.device
    seq = torch.randint(LO, HI, (n, seq_len + 1), generator=gen, device=dev)
    u = torch.rand(n, generator=gen, device=dev)
    plen = torch.exp(math.log(4) + u * math.log(max_prompt / 4)).long().clamp_(4, max_prompt)
    follower = torch.full((n, S.numel()), -1, dtype=torch.long, device=dev)   # token after x's latest occurrence
    copy = torch.zeros(n, seq_len, dtype=torch.bool, device=dev)
    rows = torch.arange(n, device=dev)
    for t in range(seq_len):
        x = seq[:, t]
        f = follower[rows, x]
        copy[:, t] = f >= 0
        nxt = torch.where(t + 1 < plen, seq[:, t + 1], torch.where(f >= 0, f, S[x]))
        seq[:, t + 1] = nxt
        follower[rows, x] = nxt
    return seq, plen, copy


def self_check(S: list[int], St: torch.Tensor) -> None:
    assert rule_continue([5, 6, 7, 5], 4, S) == [6, 7, 5, 6]          # copy, then copy around the cycle
    assert rule_continue([5, 6, 5, 7, 5], 1, S) == [7]                # the most recent occurrence wins
    assert rule_continue([5, 6, 7], 2, S) == [S[7], rule_continue([5, 6, 7, S[7]], 1, S)[0]]   # bigram
    gen = torch.Generator(device=St.device).manual_seed(7)
    seq, plen, copy = make_rows(16, 96, 64, St, gen)
    for b in range(16):
        row, L = seq[b].tolist(), int(plen[b])
        assert row[L:] == rule_continue(row[:L], len(row) - L, S), f"row {b}: generator disagrees with the rule"
        assert [row[t] in row[:t] for t in range(L - 1, 96)] == copy[b, L - 1:].tolist(), f"row {b}: copy flags"
    print("self-check: generator matches the reference rule on 16 rows", flush=True)


# -- training ----------------------------------------------------------------------------------------------------
def batch_stats(model, seq, plen, copy, device, ls=0.0, zloss=0.0):
    """Loss (CE + z-loss) over the last prompt position and the continuation; accuracy by copy/bigram."""
    inp, tgt = seq[:, :-1], seq[:, 1:]
    pos = torch.arange(inp.shape[1], device=seq.device)
    mask = pos[None, :] >= (plen[:, None] - 1)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda"):
        h = model.model(input_ids=inp, use_cache=False).last_hidden_state[mask]
        logits = model.lm_head(h).float()
    lse = logits.logsumexp(-1)
    ce = F.cross_entropy(logits, tgt[mask], label_smoothing=ls)
    loss = ce + zloss * (lse ** 2).mean()
    return loss, ce, logits, tgt[mask], copy[mask], lse


def describe(ce, logits, tgt, cp, lse) -> str:
    with torch.no_grad():
        ok = logits.argmax(-1) == tgt
        top2 = logits.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        return (f"ce {ce.item():.4f} acc {ok.float().mean().item():.4f} "
                f"(copy {ok[cp].float().mean().item():.4f} / bigram {ok[~cp].float().mean().item():.4f}, "
                f"copy share {cp.float().mean().item():.2f}) lse {lse.mean().item():+.2f} "
                f"gap median {gap.median().item():.2f} max|logit| {logits.abs().max().item():.1f}")


def train(args) -> Path:
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    S = perm_table(args.perm_seed)
    St = torch.tensor(S, device=dev)
    self_check(S, St)
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM(qwen2_config(**{**CONFIG, "initializer_range": args.init_std})).to(dev).train()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, attention "
          f"{model.config._attn_implementation}, device {dev}", flush=True)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0}],
                            lr=args.lr, betas=(0.9, 0.95), **({"fused": True} if dev.type == "cuda" else {}))
    max_prompt = min(args.max_prompt, args.seq_len - 16)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
    pool, used, gen_s = None, 0, 0.0
    warmup = min(args.warmup, max(1, args.steps // 10)) if args.steps else args.warmup
    t0 = last = time.perf_counter()
    step = 0
    while True:
        elapsed = time.perf_counter() - t0
        progress = max(step / args.steps if args.steps else 0.0, elapsed / args.seconds if args.seconds else 0.0)
        if progress >= 1.0:
            break
        if pool is None or used + args.batch > pool[0].shape[0]:
            tg = time.perf_counter()
            pool, used = make_rows(args.batch * args.pool_batches, args.seq_len, max_prompt, St, gen), 0
            if dev.type == "cuda":
                torch.cuda.synchronize()
            gen_s += time.perf_counter() - tg
            if step == 0:
                print(f"data: {args.batch * args.pool_batches} rows x {args.seq_len + 1} tokens in "
                      f"{time.perf_counter() - tg:.2f} s (prompts log-uniform in [4, {max_prompt}])", flush=True)
        seq, plen, copy = (x[used:used + args.batch] for x in pool)
        used += args.batch
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1))))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, ce, logits, tgt, cp, lse = batch_stats(model, seq, plen, copy, dev, args.label_smoothing, args.zloss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1 or (args.steps and step == args.steps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            n = args.log_every if step > 1 else 1
            print(f"step {step:5d} t {now - t0:6.1f}s {1000 * (now - last) / n:7.1f} ms/step lr {lr:.2e} "
                  f"{describe(ce, logits, tgt, cp, lse)}", flush=True)
            last = now
    total = time.perf_counter() - t0
    print(f"trained {step} steps in {total:.1f} s ({1000 * total / step:.1f} ms/step, data generation "
          f"{gen_s:.1f} s), {step * args.batch * args.seq_len / 1e6:.1f}M tokens", flush=True)
    model.eval()
    with torch.no_grad():   # held-out rows, teacher forced
        ho = make_rows(args.batch, args.seq_len, max_prompt, St, torch.Generator(device=dev).manual_seed(999))
        _, ce, logits, tgt, cp, lse = batch_stats(model, *ho, dev)
        print(f"held-out: {describe(ce, logits, tgt, cp, lse)}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(str(out), safe_serialization=True)
    for f in out.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    print(f"wrote {out} (fp16)", flush=True)
    return out


# -- evaluation on the repo's own engine -------------------------------------------------------------------------
def teacher_accuracy(specs, res, S) -> tuple[float, float, float]:
    """Per emitted token, against the rule applied to the generated history. NB a model that repeats one token is
    rule-consistent once the token repeats (x followed by x copies x): read the bigram split and exact matches."""
    hits = {True: [0, 0], False: [0, 0]}     # copy?: [correct, total]
    for s in specs:
        fol = {a: b for a, b in zip(s.prompt, s.prompt[1:])}
        x = s.prompt[-1]
        for y in res[s.request_id].tokens:
            want, is_copy = fol.get(x, S[x] if x < len(S) else -1), x in fol
            hits[is_copy][0] += y == want
            hits[is_copy][1] += 1
            fol[x], x = y, y
    c, b = hits[True], hits[False]
    return (c[0] + b[0]) / max(1, c[1] + b[1]), c[0] / max(1, c[1]), b[0] / max(1, b[1])


def evaluate(model_dir, device="cpu", n_requests: int | None = None, perm_seed: int = PERM_SEED,
             thr: float = 0.02) -> dict:
    t0 = time.perf_counter()
    S = perm_table(perm_seed)
    specs = MIXED_CPU.requests()[:n_requests]
    summary, results = {"model": str(model_dir), "device": device, "requests": len(specs)}, {}
    for dtype in ("float32", "float16"):
        e = Engine(EngineConfig(dtype=dtype, record_topk=2, chunk_tokens=128, device=device, compile_warmup=False,
                                max_model_len=2048), model=str(model_dir))
        res = results[dtype] = e.run(specs)
        gaps = sorted(v[0] - v[1] for s in specs for _, v in e.topk[s.request_id])
        acc, acc_copy, acc_bigram = teacher_accuracy(specs, res, S)
        exact = sum(res[s.request_id].tokens == rule_continue(s.prompt, s.budget, S) for s in specs)
        distinct = len({t for r in res.values() for t in r.tokens})
        d = summary[dtype] = dict(teacher_acc=acc, teacher_acc_copy=acc_copy, teacher_acc_bigram=acc_bigram,
                                  exact_requests=exact, distinct_tokens=distinct,
                                  near_tie_rate=sum(g < thr for g in gaps) / len(gaps), emitted=len(gaps),
                                  gap_median=statistics.median(gaps), gap_p5=gaps[int(0.05 * (len(gaps) - 1))],
                                  max_abs_top1=max(abs(v[0]) for s in specs for _, v in e.topk[s.request_id]))
        if dtype == "float32":   # every logit (the whole vocabulary) at every emitted position, teacher forced
            mx = 0.0
            for s in specs:
                toks = res[s.request_id].tokens
                lg = e.score(s.prompt + toks[:-1])[len(s.prompt) - 1:]
                mx = max(mx, lg.abs().max().item())
            d["max_abs_logit"] = mx
        print(f"{dtype}: teacher-rule accuracy {acc:.2%} (copy {acc_copy:.2%}, bigram {acc_bigram:.2%}); "
              f"{exact}/{len(specs)} requests exactly the rule's continuation; {distinct} distinct tokens; near ties "
              f"(gap < {thr}) {d['near_tie_rate']:.2%} of {len(gaps)}; top-2 gap median {d['gap_median']:.3f}, "
              f"p5 {d['gap_p5']:.3f}; max |top-1| {d['max_abs_top1']:.2f}"
              + (f"; max |logit| (all vocab) {d['max_abs_logit']:.2f}" if "max_abs_logit" in d else ""), flush=True)
    a, b = results["float32"], results["float16"]
    differ = [s.request_id for s in specs if a[s.request_id].tokens != b[s.request_id].tokens]
    tok_diff = sum(x != y for s in specs for x, y in zip(a[s.request_id].tokens, b[s.request_id].tokens))
    summary["fp16_vs_fp32_requests_differ"], summary["fp16_vs_fp32_tokens_differ"] = len(differ), tok_diff
    print(f"fp16 vs fp32: {len(differ)} of {len(specs)} requests differ ({tok_diff} token positions) {differ[:8]}",
          flush=True)
    changed, total = history_dependence(specs, load_model(str(model_dir), torch.float32, device), device)
    summary["history_changed"] = changed
    print(f"history: perturbing the first page's K/V after the prompt changed the continuation in {changed} of "
          f"{total} requests ({changed / total:.0%})", flush=True)
    summary["eval_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"eval took {summary['eval_seconds']} s\nEVAL-SUMMARY {json.dumps(summary)}", flush=True)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="model directory to write (required unless --eval-only)")
    ap.add_argument("--eval-only", metavar="DIR", help="only evaluate the model in DIR")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no step limit)")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop when this much training time is spent")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1152, help="tokens per row (covers MIXED_CPU's 1024 + 64)")
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--pool-batches", type=int, default=32, help="batches generated per refill of the data pool")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--zloss", type=float, default=1e-4)
    ap.add_argument("--label-smoothing", type=float, default=0.01, help="caps the top-1 margin (~13 at 0.01)")
    ap.add_argument("--init-std", type=float, default=0.02, help="initializer_range for training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--perm-seed", type=int, default=PERM_SEED, help="seed of S (eval must use the same)")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-requests", type=int, default=None, help="evaluate on the first N of MIXED_CPU's 48")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval_only:
        evaluate(args.eval_only, args.device, args.eval_requests, args.perm_seed)
        return 0
    if not args.out:
        ap.error("--out DIR is required (a new directory; golden/models/qwen2-small only if you mean it)")
    if not args.steps and not args.seconds:
        args.seconds = 90.0
    print(f"args: {json.dumps(vars(args))}", flush=True)
    out = train(args)
    if not args.no_eval:
        evaluate(out, args.device, args.eval_requests, args.perm_seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
