"""Shared pytest fixtures: tiny random checkpoints written once per session."""
import os

import pytest

# Tests run on 2 shared cores: single-threaded torch is much faster there.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# NIXL/UCX: stay on loopback in tests (else it also listens on eth0).
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _threads():
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass


_threads()


def _preload_interpreted_kernels():
    """Import the Triton kernels in interpreter mode before any test module imports vLLM.

    Once vLLM is imported, kernels first imported afterwards under TRITON_INTERPRET fail at their
    first nested call ("Cannot call @triton.jit'd outside of the scope of a kernel"), so the
    CPU kernel tests would depend on test order. Triton must not be imported before this either
    (it caches its interpreter switch on first read). On a CUDA machine the tests use compiled kernels."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        from nexrt_vllm.engine import kernels
        kernels.load(interpret=True)


_preload_interpreted_kernels()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU, skipped without one (run them: pytest -m gpu)")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip on a machine without a CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def trained_ckpt(ckpt_factory):
    """The connector tests' trained tiny Qwen3-Next (connector_harness.TRAINED), bf16: greedy tokens
    confident and decided by the context, so bf16 vLLM and the node agree token for token."""
    from nexrt_vllm.testing.connector_harness import TRAINED
    return ckpt_factory("qwen3_next", "bfloat16", **TRAINED)


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """Returns make(arch, dtype="bfloat16", **overrides) -> path, cached per argument set; a trained
    checkpoint comes from the repository's store when it holds that recipe (testing/stored.py)."""
    import shutil

    from nexrt_vllm.testing import make_checkpoint, stored

    cache = {}

    def make(arch="qwen3_next", dtype="bfloat16", **overrides):
        key = (arch, dtype, tuple(sorted(overrides.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ckpt_{arch}_{dtype}")
            kept = stored.lookup(arch, dtype, overrides)
            if kept:
                shutil.copytree(kept, str(d), dirs_exist_ok=True)
                cache[key] = str(d)
            elif overrides.get("mtp"):
                # the same checkpoint as make_checkpoint(mtp=True) writes, from the cached one without
                # the head: a trained model is trained once per session
                from nexrt_vllm.testing.mtp_head import add_mtp_head
                rest = {k: v for k, v in overrides.items() if k != "mtp"}
                shutil.copytree(make(arch, dtype, **rest), str(d), dirs_exist_ok=True)
                add_mtp_head(str(d), train=rest.get("train") == "periodic", seed=rest.get("seed", 0),
                             init_std=rest.get("init_std", 0.06))
                cache[key] = str(d)
            else:
                cache[key] = make_checkpoint(str(d), arch=arch, dtype=dtype, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def qwen3_next_ckpt(ckpt_factory):
    return ckpt_factory("qwen3_next", "bfloat16")


@pytest.fixture(scope="session")
def qwen3_5_ckpt(ckpt_factory):
    return ckpt_factory("qwen3_5", "bfloat16")


@pytest.fixture(scope="session")
def qwen3_5_moe_ckpt(ckpt_factory):
    return ckpt_factory("qwen3_5_moe", "bfloat16")
