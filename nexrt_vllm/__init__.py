"""nexrt-vllm: fast batch-1 decode tier for vLLM.

Kept light on purpose: importing `nexrt_vllm` (and `nexrt_vllm.router`) must not import torch.
"""

__version__ = "0.1.0"
