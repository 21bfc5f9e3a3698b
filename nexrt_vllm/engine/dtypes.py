"""The one dtype table (names as configs and hand-off layouts spell them <-> torch dtypes): what the
engine, the node's page conversion and the connector share.

`MODEL_DTYPES` are the dtypes the engine computes in; `TORCH_DTYPES` also has the element types a
hand-off page may carry (the same names as `handoff.layout.DTYPE_SIZES`, which stays torch-free;
so does the contiguity helper, `handoff.layout.contiguous_strides`).
"""
from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8, "uint8": torch.uint8}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
MODEL_DTYPES = ("float32", "bfloat16", "float16")
