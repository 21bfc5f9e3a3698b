"""Benchmarks of nexrt-vllm, run from the repository root as `python benchmarks/X.py` or
`python -m benchmarks.X` (not installed; what they share is `nexrt_vllm.bench`).

Top level: what a user runs. `checks/`: the GPU correctness checks (each exits 1 on a failed
check). `tools/`: developer tools (launch-shape tuners)."""
