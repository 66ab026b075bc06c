"""The dispatch check: each kernel path the path census names (engine/census.py: from the backend's configuration,
the paths a run serves) was dispatched to by a call, and no call dispatched to a kernel other than the one its
backend is configured to run. A backend records each call's branch as it takes it (AttentionBackend.took; inside
a captured step, at capture), so a branch that runs another kernel than the configuration names (flash-attn's split-KV
where the Triton decode is configured, a fallback prefill) fails every gate run: the tokens of two right kernels agree
within the tie rule, so no token gate would see it. (A mutation campaign found both unseen.)"""
from __future__ import annotations

from kernels.base import KernelPath


def dispatch_problems(engine) -> list[str]:
    """What the engine's backend dispatched to against what its census names, one line a difference."""
    backend = engine.runner.backend
    ran = {KernelPath(backend.name, op, kernel, append).name for op, kernel, append in backend.dispatched}
    configured = {"prefill": backend.prefill_kernel, "decode": backend.decode_kernel}
    out = [f"dispatch: {name} is configured (the census names it for {steps} step(s)) but no call dispatched to it; "
           f"its calls ran {sorted(ran) or 'nothing'}"
           for name, steps in sorted(census_steps(engine).items()) if name not in ran]
    out += [f"dispatch: a {op} call ran {KernelPath(backend.name, op, kernel, append).name}, but the {backend.name} "
            f"backend is configured to run {backend.name}.{op}.{configured[op]}"
            for op, kernel, append in sorted(backend.dispatched) if kernel != configured[op]]
    return out


def census_steps(engine) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in engine.runner.path_census():
        for name in row["kernels"]:
            out[name] = out.get(name, 0) + row["steps"]
    return out


__all__ = ["dispatch_problems"]
