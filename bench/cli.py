"""The command-line pieces every engine benchmark shares: which model, where, in what dtype, which engine
configuration; and the refusal of a configuration that cannot run here."""
from __future__ import annotations

import argparse
import sys

import torch

from engine.config import LINEAGE

GRAPHS = {"auto": None, "on": True, "off": False}     # --cuda-graphs -> EngineConfig.cuda_graphs
# The engine configuration a benchmark measures unless told: the one served on that device type (flash-attn's paged
# decode on CUDA; a broken flash-attn install then fails with its reason rather than measure the eager torch engine)
SERVED = {"cuda": "flash", "cpu": "fused"}
DEVICE_HELP = "cpu, cuda or cuda:N (default: cpu)"
ENGINE_HELP = (f"engine configuration (default: the one served on the device: "
               f"{', '.join(f'{e} on {d.upper()}' for d, e in SERVED.items())})")


def cli(prog: str, doc: str) -> argparse.ArgumentParser:
    """A parser with the arguments every engine benchmark shares; `doc` (the module's) is its description."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    ap.add_argument("--model", default="small", help="small, small-trained, qwen2.5-1.5b-random, or a checkpoint directory")
    ap.add_argument("--device", default="cpu", help=DEVICE_HELP)
    ap.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: fp32 cpu, fp16 cuda)")
    ap.add_argument("--engine", default=None, choices=sorted(LINEAGE), help=ENGINE_HELP)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's). On a shared CPU, 1 avoids OpenMP threads "
                         "waiting on a descheduled sibling, which can make a step 50x slower")
    ap.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                    help="replay captured steps (pure decode; loaded and chunk-only where the forward is fused): "
                         "auto = where the backend allows (flash on CUDA); off = eager, to compare")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="launch each foreseeable pure decode step before the step before it is read back "
                         "(EngineConfig.overlap): auto = where pure decode steps are captured; off = to compare")
    ap.add_argument("--decode-kernel", default=None,
                    help="the backend's decode kernel (EngineConfig.decode_kernel): flash: triton (default) or flash "
                         "(flash-attn's split-KV); flex: rows (default) or packed")
    ap.add_argument("--decode-append", choices=("auto", "on", "off"), default="auto",
                    help="the decode kernel writes a pure decode step's keys and values itself "
                         "(EngineConfig.decode_append): auto = where the backend can; off = index_put writes, to compare")
    return ap


def kernel_options(a) -> dict:
    """The EngineConfig fields the shared kernel arguments give."""
    return dict(decode_kernel=getattr(a, "decode_kernel", None),
                decode_append=GRAPHS[getattr(a, "decode_append", "auto")])


def served_engine(device: str) -> str:
    """The engine configuration served on `device` (SERVED)."""
    return SERVED.get(torch.device(device).type, "fused")


def parse(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """ap.parse_args, with --engine resolved from --device when not given."""
    a = ap.parse_args(argv)
    if a.engine is None:
        try:
            a.engine = served_engine(a.device)
        except RuntimeError as e:      # torch's refusal of a device string it cannot parse
            ap.error(f"--device {a.device}: {e}")
    return a


def device_and_dtype(device: str, dtype: str | None, threads: int | None = None) -> tuple[torch.device, str]:
    """Apply `threads`; the device, and the dtype (fp16 on CUDA, fp32 on CPU unless `dtype` says)."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    return dev, dtype or ("float16" if dev.type == "cuda" else "float32")


def cannot_run(prog: str, engine: str, device: str) -> bool:
    """True (and the reason on stderr) when engine configuration `engine` cannot run on `device`."""
    from kernels import why_unavailable
    base = LINEAGE[engine]
    reason = why_unavailable(base["backend"], device, base["page_size"])
    if reason:
        print(f"{prog}: engine {engine!r} cannot run here: {reason}", file=sys.stderr, flush=True)
    return reason is not None
