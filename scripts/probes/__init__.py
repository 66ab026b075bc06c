"""One-off probes and device-call helpers kept for the record: each answered a question a benchmark raised (the SDPA
backend's choice, flash-attn's split count, the elementwise compile, the host's share of a step, compile cost, a
profile of one decode step or of each step a workload takes, the loaded-step table of a call). Each runs as
`python -m scripts.probes.NAME` from the repository root; the product benchmarks are in bench/."""
