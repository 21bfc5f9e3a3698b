"""GPU correctness checks: each records its claims as checks in its JSON and exits 1 if any failed
(nexrt_vllm.bench.checks); tests/gpu/test_gpu_checks.py runs them under `pytest -m gpu`."""
