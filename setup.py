"""nexrt-vllm: the fast-decode tier for vLLM.

`connector/` and `router/` are separate deployables with folders of their own at the top; the package sees
them through the links `nexrt_vllm/connector` and `nexrt_vllm/router`, so `nexrt_vllm.connector` (what vLLM
loads as `kv_connector_module_path`) and `nexrt_vllm.router` resolve the same from a source checkout, an
editable install and a normal `pip install .` (setuptools follows the links and copies the files).
`csrc/` is the home of CUDA C++ kernel sources (none today, csrc/README.md); nothing of it installs.
"""
from setuptools import find_packages, setup


pkgs = find_packages(include=["nexrt_vllm", "nexrt_vllm.*"])

setup(
    name="nexrt-vllm",
    version="0.1.0",
    description="Fast batch-1 decode tier for vLLM (connector, decode node, router, benchmarks)",
    python_requires=">=3.10",
    packages=pkgs,
    install_requires=[
        "msgpack>=1.0",
        "pyzmq>=25",
        "aiohttp>=3.9",
        "numpy",
        "safetensors",
        "tqdm",
        "tokenizers",
        "prometheus-client",
        "orjson>=3.8",  # the router's JSON (router/fastjson.py; it falls back to the standard library)
    ],
    extras_require={
        "engine": ["torch>=2.4", "safetensors", "tqdm"],
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        "bench": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "nexrt-decode=nexrt_vllm.node.server:main",
            "nexrt-router=nexrt_vllm.router.server:main",
            "nexrt-vllm=nexrt_vllm.demo.cli:main",
        ]
    },
)
