"""The library of the benchmarks and GPU checks (`benchmarks/`): what more than one of them uses.

- `shapes`: the real model shapes they run (Qwen3.5-2B, Qwen3.5-35B-A3B);
- `step`: engines at those shapes (random, FP8 or grafted weights) and the fused step measured: the
  bytes each launch moves, graph replay timing, per-group device time;
- `graft`: a trained tiny checkpoint carried into a real shape, for greedy parity there;
- `spec_round`: the captured MTP round at a real shape (bytes, time, parity);
- `inferencex`: the InferenceX-compatible serving client (prompts, streaming, metrics, agg files);
- `pareto`: InferenceX's throughput-per-GPU vs interactivity chart;
- `checks`: the exit rule of the correctness checks (a failed recorded check exits 1);
- `null_connector`: a vLLM KV connector that does nothing (the control of connector_overhead).

Importing this package (and `shapes`, `checks`, `inferencex`, `pareto`) loads no torch.
"""
