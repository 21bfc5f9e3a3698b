"""Triton kernels for the batch-1 decode step (GPU path).

Import the submodules lazily (they import triton); the CPU/eager engine never needs them. Every kernel
reproduces the eager op's rounding points (bf16 after each op the eager path rounds) so the graph path
and the eager path agree to within accumulation-order differences.
"""
