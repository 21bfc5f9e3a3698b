"""The GPU decode path: fused Triton launches captured as CUDA graphs (imports triton; the CPU engine never needs it)."""
