"""The GPU decode path: fused Triton launches captured as CUDA graphs.

Imports triton (lazily, from the decoder); the CPU engine never needs this package.
"""
