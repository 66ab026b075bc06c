"""Programmatic dependent launch of a step's Triton kernels (kernels/pdl_kernels.py says what it does and why):
whether a device can, and the launch arguments a kernel takes for it."""
from __future__ import annotations

import torch

# elements of each weight row a kernel launched with PDL fetches into L2 before it waits for the kernel before it
# (kernels/pdl_kernels.py's prefetch_rows). 0: the prefetch made the layer chain slower on an H100 in session 37
# (scripts/probes/pdl_chain.py: the split-K projections with their whole split prefetched 88.60 us a layer against
# 85.66 without; the MLP kernel's first 256 or 768 elements 82.17 / 82.75 against 81.32, docs/RESULTS.md k29); the
# probe keeps its sweep
LINEAR_PREFETCH = 0
MLP_PREFETCH = 0


def why_unavailable(device) -> str | None:
    """Why the step's Triton kernels cannot be launched with PDL on `device` (None: they can): it needs a CUDA
    device of compute capability 9.0 or later and a Triton that has griddepcontrol (3.4 and later)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "programmatic dependent launch is a CUDA feature (sm_90 and later)"
    try:
        import triton.language.extra.cuda as tl_cuda
    except ImportError:
        return "triton is not installed"
    if not hasattr(tl_cuda, "gdc_wait"):
        return "this Triton has no griddepcontrol (gdc_wait)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.x: programmatic dependent launch needs 9.0 or later"
    return None


def pdl_args(pdl: bool, prefetch: int | None = None) -> dict:
    """A Triton kernel's launch arguments for programmatic dependent launch: its PDL constexpr, its PREFETCH one where
    it has one (elements of each weight row fetched into L2 before it waits), and Triton's launch_pdl; none without
    PDL, so a kernel launched without it compiles and launches as before."""
    if not pdl:
        return {}
    return dict(PDL=True, launch_pdl=True, **({} if prefetch is None else {"PREFETCH": prefetch}))
