"""NexRT reference engine (CPU-correct; the GPU path builds on its per-layer functions).

    from nexrt_vllm.engine import Engine, SamplingParams
    eng = Engine.from_pretrained(path, device="cpu", dtype=None, max_seq_len=4096)

Importing this package imports torch; `import nexrt_vllm` alone does not.
"""
from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.engine import Engine
from nexrt_vllm.engine.errors import (ConfigError, EngineError, InputError, NotBuiltError, SamplingParamsError,
                                      StateError, WeightsError)
from nexrt_vllm.engine.sampling import Sampler, SamplingParams, sampling_probs
from nexrt_vllm.engine.state import AttentionState, DecodeState, GDNState

__all__ = [
    "AttentionState", "ConfigError", "DecodeState", "Engine", "EngineError", "GDNState", "InputError", "ModelConfig",
    "NotBuiltError",
    "Sampler", "SamplingParams", "SamplingParamsError", "StateError", "WeightsError", "sampling_probs",
]
