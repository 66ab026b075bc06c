"""A two-layer Qwen2 of random weights run one forward at a time, without an engine: the layer kernels' tests
(tests/test_mlp_kernel.py, tests/test_linear_kernel.py) run it through Triton's interpreter, where an engine's
warm-up and graphs would take minutes."""
from __future__ import annotations

import torch


def tiny_forwards(device, rows_and_contexts) -> dict:
    """{(rows, key): fp32 logits} of one prefill forward of `rows` positions for each (rows, key, context keywords)
    in `rows_and_contexts` (the keywords go to ForwardContext: mlp_rows, linear_rows, their records)."""
    import kernels
    from engine.loader import qwen2_config
    from engine.model import ForwardContext, ModelShape, Qwen2
    torch.manual_seed(0)
    shape = ModelShape.of(qwen2_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=300))
    model = Qwen2(shape).to(device).eval().fuse()
    backend = kernels.get_backend("torch", device, 64)
    caches = [(torch.zeros(4, 64, 2, 64, device=device), torch.zeros(4, 64, 2, 64, device=device)) for _ in range(2)]
    out = {}
    for rows, key, kw in rows_and_contexts:
        batch = kernels.AttnBatch([rows], [rows], torch.tensor([[1, 2, 3]], dtype=torch.int32, device=device),
                                  torch.tensor([rows], dtype=torch.int32, device=device),
                                  torch.tensor([0, rows], dtype=torch.int32, device=device), 64)
        backend.prepare(batch, "prefill")
        ctx = ForwardContext(torch.arange(64, 64 + rows, device=device), rows, batch, None, backend, **kw)
        with torch.inference_mode():
            out[rows, key] = model(torch.arange(rows, device=device) % 300, torch.arange(rows, device=device),
                                   caches, ctx, None)
    return out
