"""Tensor parallel: `tp` ranks, one process (and one device) each. `runner.TPRunner` is rank 0's runner (the engine
sees only it); `shard` holds what every rank runs (its shard of the model, the plan it receives, its pages);
`worker` is a worker rank's process; `layers` the sharded model (column- and row-parallel linears, the
vocabulary-parallel embedding and head, the gathered token choice)."""
