"""engine/dtypes.py: the one dtype table agrees with the wire's torch-free size table, and
handoff.layout.contiguous_strides with torch's own strides."""
import torch

from nexrt_vllm.engine.dtypes import DTYPE_NAMES, MODEL_DTYPES, TORCH_DTYPES
from nexrt_vllm.handoff import layout as L


def test_table_matches_the_wire_sizes():
    assert set(TORCH_DTYPES) == set(L.DTYPE_SIZES)
    for name, dt in TORCH_DTYPES.items():
        assert torch.empty(0, dtype=dt).element_size() == L.DTYPE_SIZES[name], name
        assert DTYPE_NAMES[dt] == name
    assert set(MODEL_DTYPES) <= set(TORCH_DTYPES)


def test_contiguous_strides_are_torch_strides():
    for shape in [(7,), (2, 16, 512), (40, 1, 3, 5), ()]:
        assert L.contiguous_strides(shape) == torch.empty(shape).stride(), shape
