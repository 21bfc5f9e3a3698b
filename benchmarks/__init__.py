"""Benchmarks of nexrt-vllm (not an installed package: run from the repo root, `python -m benchmarks.X`)."""
