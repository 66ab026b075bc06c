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
    return out + layer_kernel_problems(engine)


# The layers' Triton kernels (engine.config.LAYER_KERNELS): the configuration field -> the runner's rows and record
# (ModelRunner.mlp_rows / mlp_dispatched, ...), the module's row limit, the kernel and the layers in a message
LAYERS = {"mlp_kernel": ("mlp", "FUSED_ROWS", "the fused kernel", "the fused MLP kernel", "MLP"),
          "linear_kernel": ("linear", "SKINNY_ROWS", "the split-K kernel", "the projections' split-K kernel",
                            "projection")}


def layer_limit(name: str) -> int:
    from engine.config import layer_kernel_module
    return getattr(layer_kernel_module(name), LAYERS[name][1])


def layer_kernel_problems(engine) -> list[str]:
    """layer_dispatch_problems for every layer kernel (the MLP's, the projections')."""
    return [p for name in LAYERS for p in layer_dispatch_problems(engine, name)]


def layer_dispatch_problems(engine, name: str) -> list[str]:
    """A layer's kernel as its forwards took it (ModelRunner.mlp_dispatched: ForwardContext.fuses_mlp records each
    layer's (rows, kernel); in a captured step, at capture; linear_dispatched the same for ForwardContext.linear)
    against the configuration (EngineConfig.mlp_kernel, linear_kernel): with "triton", every layer of at most the
    kernel's rows (kernels.mlp.FUSED_ROWS, kernels.linear.SKINNY_ROWS) takes the Triton kernel and every larger one
    torch's, and some layer was recorded if a forward that small ran; with "torch", none takes the Triton kernel. A
    forward that ignored its context's choice, or a runner built with another threshold, passes the served record and
    the tokens alike."""
    prefix, _, short, _, layer = LAYERS[name]
    took = getattr(engine.runner, f"{prefix}_dispatched", None)
    if took is None:
        return []           # (a tensor-parallel engine's forwards run in its ranks)
    limit = layer_limit(name)
    if getattr(engine.served, name) != "triton":
        fused = sorted(n for n, kernel in took if kernel == "triton")
        return [f"dispatch: {layer}s of {fused[:4]} rows ran {short}, but {name}='torch' is configured"] \
            if fused else []
    wrong = sorted((n, kernel) for n, kernel in took if kernel != ("triton" if n <= limit else "torch"))
    out = [f"dispatch: {name}='triton' is configured ({short} up to {limit} rows), but {layer}s of "
           f"{', '.join(f'{n} rows took {kernel}' for n, kernel in wrong[:4])}"] if wrong else []
    chunked = engine.served.forward == "chunked"
    forwards = [n for r in engine.trace for n in ((r.prompt_positions, r.decode_tokens) if chunked else
                                                    (r.prompt_positions + r.decode_tokens,))]
    small = sum(0 < n <= limit for n in forwards)
    if small and not any(n <= limit for n, _ in took):
        out.append(f"dispatch: {name}='triton' is configured and {small} forward(s) of at most {limit} "
                   f"positions ran, but no {layer} of that size was recorded")
    return out


def census_steps(engine) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in engine.runner.path_census():
        for name in row["kernels"]:
            out[name] = out.get(name, 0) + row["steps"]
    return out


def served_problems(engine) -> list[str]:
    """What the runner was built to run against what the engine says it serves (Engine.served: the configuration
    with every None decided), one line a difference: the backend's kernel choices, captured or uncaptured steps, the
    step graphs of the fused forward, the compiled elementwise pieces. The served record and the dispatch check both
    start from the configuration: a build that ignored it (a kernel choice dropped on its way to the backend, steps
    captured where the configuration asks for uncaptured ones, so a graphs-on-vs-off gate compares captured with
    captured) would pass them. Session 17's runner campaign found these unseen."""
    served, runner = engine.served, engine.runner
    backend = runner.backend
    out = []
    took = {"decode_kernel": backend.decode_kernel, "decode_splits": backend.decode_splits,
            "decode_append": backend.appends_decode_kv, "flex_dynamic": backend.dynamic}
    for name, value in took.items():
        if getattr(served, name) != value:
            out.append(f"served: {name}={getattr(served, name)!r} is configured, the {backend.name} backend was built "
                       f"with {value!r}")
    graphs = runner.graphs
    if graphs is not None and graphs.capture_graphs != served.capture_graphs:
        out.append(f"served: capture_graphs={served.capture_graphs} is configured, the runner's pure decode steps are "
                   f"{'captured' if graphs.capture_graphs else 'uncaptured'}")
    step_graphs = getattr(runner, "step_graphs", None)
    # the fused forward's loaded steps take the captured path (one rank) where the backend's prefill allows it: on
    # CUDA a graph-safe prefill; on a CPU, where nothing is captured, kernels that are right over static buffers
    on_cuda = runner.device.type == "cuda"
    want_steps = graphs is not None and served.forward == "fused" and served.tp == 1 and (
        backend.graph_safe_prefill or (not on_cuda and backend.static_steps))
    if want_steps and step_graphs is None:
        out.append(f"served: the fused forward's loaded steps should take the captured path (the {backend.name} "
                   f"backend's prefill allows it{'' if on_cuda else ' on a CPU'}), but the runner built no step graphs")
    if step_graphs is not None:
        if served.forward != "fused":
            out.append(f"served: the {served.forward} forward runs no step graphs, yet the runner built them")
        elif step_graphs.capture_graphs != served.capture_graphs:
            out.append(f"served: capture_graphs={served.capture_graphs} is configured, the runner's loaded steps are "
                       f"{'captured' if step_graphs.capture_graphs else 'uncaptured'}")
    # the layers' Triton kernels (kernels/mlp.py, kernels/linear.py) run where the runner's forwards say so
    # (ForwardContext.mlp_rows, linear_rows)
    for name, (prefix, _, _, kernel, _) in LAYERS.items():
        rows = getattr(runner, f"{prefix}_rows", None)      # (a tensor-parallel engine's forwards run in its ranks)
        want_rows = layer_limit(name) if getattr(served, name, None) == "triton" else 0
        if rows is not None and rows != want_rows:
            out.append(f"served: {name}={getattr(served, name, None)!r} is configured, the runner's forwards run "
                       f"{kernel} up to {rows} positions (expected {want_rows})")
    # programmatic dependent launch (EngineConfig.pdl): the layers' kernels read the runner's, the decode the backend's
    # (a tensor-parallel engine's runner reports rank 0's)
    for holder, what in ((runner, "the runner's layer kernels"), (backend, f"the {backend.name} backend's decode")):
        pdl = getattr(holder, "pdl", None)
        if pdl is not None and bool(pdl) != bool(served.pdl):
            out.append(f"served: pdl={served.pdl} is configured, {what} launch "
                       f"{'with' if pdl else 'without'} programmatic dependent launch")
    caches = getattr(runner, "kv_caches", None)
    if caches:
        # the pool is sized from free memory by ModelRunner.bytes_per_page (engine/served.py): it must be what a page
        # of the cache as allocated takes, or the pool would be sized for pages of another size
        held = sum(t.numel() * t.element_size() for kv in caches for t in kv) // caches[0][0].shape[0]
        said = type(runner).bytes_per_page(runner.shape, runner.page_size, runner.dtype)
        if said != held:
            out.append(f"served: a page of the KV cache takes {held} bytes as allocated, bytes_per_page says {said} "
                       "(the pool is sized from free memory by it)")
    # what build_runner did (a tensor-parallel engine's runner records none: its ranks build theirs): True or False
    # exactly, so that a record of anything else (None where the compile succeeded) is not taken for agreement
    compiled = getattr(runner, "compiled_elementwise", _UNRECORDED)
    if compiled is not _UNRECORDED and compiled not in (True, False):
        out.append(f"served: compile_elementwise={served.compile_elementwise} is configured, the runner's record of "
                   f"what its build did is {compiled!r}, not True or False")
    elif compiled is not _UNRECORDED and compiled != served.compile_elementwise:
        out.append(f"served: compile_elementwise={served.compile_elementwise} is configured, the pieces run "
                   f"{'compiled' if compiled else 'eagerly'} (a failed torch.compile warns at construction)")
    # and the pieces its forwards are handed (ForwardContext.ops) are what the record says: per runner, so an eager
    # reference and the compiled flash engine gate in one process
    ops = getattr(runner, "ops", None)
    if ops is not None and compiled in (True, False):
        from engine.layer_kernels import EAGER_OPS
        eager = sorted(n for n in EAGER_OPS if ops.get(n) is EAGER_OPS[n])
        wrong = eager if compiled else sorted(set(EAGER_OPS) - set(eager))
        if wrong:
            out.append(f"served: the runner's build {'compiled' if compiled else 'did not compile'} the elementwise "
                       f"pieces, its forwards run {', '.join(wrong)} {'eagerly' if compiled else 'compiled'}")
    return out


_UNRECORDED = object()


def census_problems(engine) -> list[str]:
    """The path census counts each forward a step ran once: its total is the traced steps that did work plus the
    steps launched ahead and dropped (their forward ran, then the real step), and its launched-ahead steps are those
    traced as launched ahead plus the dropped ones. A census that counts nothing, or files every step under another
    path, would still name the right paths (the served record and the dispatch check read names only)."""
    if engine.config.trace_limit is not None:
        return []           # a bounded trace keeps the last steps only: nothing to hold the census against
    rows = engine.runner.path_census()
    work = [r for r in engine.trace if r.prompt_positions or r.decode_tokens]
    dropped = getattr(engine, "ahead_discarded", 0)
    # a step undone by an exception (gates/test_redo.py) may or may not have launched its forward, and the step
    # launched ahead on it: up to two forwards each, counted, then redone
    undone = getattr(engine, "steps_undone", 0)
    counted, ahead = sum(r["steps"] for r in rows), sum(r["steps"] for r in rows if r["ahead"])
    out = []
    traced_ahead = sum(r.ahead for r in work)
    if not len(work) + dropped <= counted <= len(work) + dropped + 2 * undone:
        out.append(f"census: {counted} step(s) counted; {len(work)} traced steps did work, {dropped} launched ahead "
                   f"were dropped" + (f", {undone} were undone and redone" if undone else ""))
    if not traced_ahead + dropped <= ahead <= traced_ahead + dropped + undone:
        out.append(f"census: {ahead} step(s) counted as launched ahead; {traced_ahead} traced and {dropped} dropped"
                   + (f", {undone} undone" if undone else ""))
    # the steps that admitted a request with a prefix found cached (the census's prefix-hit column)
    hit_steps = {r.admit_step for r in engine.requests.values() if r.cached_prefix and r.admit_step is not None}
    hits = sum(r["steps"] for r in rows if r["prefix_hit"])
    if not undone and hits != len(hit_steps):
        out.append(f"census: {hits} step(s) counted as admitting a cached prefix; {len(hit_steps)} steps admitted "
                   f"a request whose prompt began with cached pages")
    return out


def poison_problems(engine) -> list[str]:
    """In poison mode every page on the free list holds NaN in every layer's keys and values (never written since
    the pool was made, or poisoned when freed), but the last step's freed pages, poisoned before the next step. A
    poison mode that fills or poisons nothing would let every page safety verdict pass: a read of a freed page must
    turn the logits into NaN (session 17's runner campaign: the NaN fill and poison_pages disabled passed the
    gates)."""
    caches = getattr(engine.runner, "kv_caches", None)
    if not engine.config.poison or not caches:
        return []               # (a tensor-parallel engine's caches live in its ranks)
    import torch
    late = set(getattr(engine, "_unpoisoned", []))
    pages = [p for p in engine.pool.free if p not in late]
    if not pages:
        return []
    idx = torch.tensor(pages, device=caches[0][0].device)
    for layer, (k, v) in enumerate(caches):
        for name, t in (("keys", k), ("values", v)):
            # a page is poisoned when it is NaN throughout (an inf is not poison either); reduced over the whole
            # layer, then picked by page: half the time of gathering the free pages first (a new copy of the layer)
            unpoisoned = ~t.flatten(1).isnan().all(1)[idx]
            if unpoisoned.any():
                bad = [p for p, f in zip(pages, unpoisoned.tolist()) if f]
                return [f"poison: free page(s) {bad[:5]} hold {name} other than NaN in layer {layer}: freed or "
                        f"never-written pages must hold NaN in poison mode, or a kernel that reads one goes unseen"]
    return []


def autograd_problems(engine) -> list[str]:
    """The runner's device state (its KV cache, the captured steps' static logits) carries no autograd history: every
    forward runs in inference mode. One run outside it (a step launched ahead without ModelRunner.launch_ahead's
    inference mode: session 19's H200 campaign) records its graph into the cache it writes, and every later step's
    graph chains onto it: the same tokens, but memory that grows with each step (on a CPU the graphs gate's overlap
    run took 24 GB where it takes 3, until the machine killed it; on CUDA a replay records nothing)."""
    runner = engine.runner
    state = [(f"layer {i}'s {name} cache", t) for i, kv in enumerate(getattr(runner, "kv_caches", None) or [])
             for name, t in zip(("key", "value"), kv)]
    logits = getattr(runner, "graph_logits", None)
    if logits is not None:
        state.append(("the captured steps' static logits", logits))
    for what, t in state:
        if t.requires_grad or t.grad_fn is not None:
            fn = type(t.grad_fn).__name__ if t.grad_fn is not None else "a leaf that requires grad"
            return [f"autograd: {what} records autograd history ({fn}): a forward ran outside inference mode, and each "
                    f"later step's graph chains onto the tensors it wrote (memory grows with every step)"]
    return []


__all__ = ["autograd_problems", "census_problems", "dispatch_problems", "poison_problems", "served_problems"]
