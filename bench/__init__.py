"""Benchmarks of the engine: serving (closed and open runs, the transformers peer), the disturbance, the chunk
sweep, and the kernel, profile and split-probe benchmarks. Each module with a `main` runs as `python -m bench.NAME`."""
