"""nexrt-vllm: the fast-decode tier for vLLM.

`connector/` and `router/` are separate deployables but install as `nexrt_vllm.connector` and
`nexrt_vllm.router` (package_dir), so vLLM can load `kv_connector_module_path=nexrt_vllm.connector`.
The CUDA extension in `csrc/` is built only when both a CUDA toolchain and a CUDA torch exist.
"""
import os
import shutil

from setuptools import find_packages, setup


def _cuda_ext():
    # Build csrc/ only with nvcc + CUDA torch; otherwise say so once and install the pure-Python
    # (Triton/eager) paths, which are complete on their own.
    if os.environ.get("NEXRT_NO_CUDA_EXT") or not shutil.which("nvcc"):
        print("nexrt-vllm: no CUDA toolchain found; skipping csrc/ extension (eager/Triton paths only)")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except Exception:  # noqa: BLE001 - any import failure means no CUDA build
        print("nexrt-vllm: torch not importable at build time; skipping csrc/ extension")
        return [], {}
    if torch.version.cuda is None:
        print("nexrt-vllm: CPU-only torch; skipping csrc/ extension")
        return [], {}
    srcs = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith((".cu", ".cpp")))
    if not srcs:
        return [], {}
    ext = CUDAExtension(
        "nexrt_vllm._C",
        srcs,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-gencode=arch=compute_90a,code=sm_90a",
                                                     "--use_fast_math"]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_ext()

pkgs = [p for p in find_packages(include=["nexrt_vllm", "nexrt_vllm.*"])]
pkgs += ["nexrt_vllm.connector", "nexrt_vllm.router"]

setup(
    name="nexrt-vllm",
    version="0.1.0",
    description="Fast batch-1 decode tier for vLLM (connector, decode node, router, benchmarks)",
    python_requires=">=3.10",
    packages=pkgs,
    package_dir={"nexrt_vllm.connector": "connector", "nexrt_vllm.router": "router"},
    install_requires=[
        "msgpack>=1.0",
        "pyzmq>=25",
        "aiohttp>=3.9",
        "numpy",
        "safetensors",
        "tqdm",
        "tokenizers",
        "prometheus-client",
    ],
    extras_require={
        "engine": ["torch>=2.4", "safetensors", "tqdm"],
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        "bench": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "nexrt-decode=nexrt_vllm.worker.server:main",
            "nexrt-router=nexrt_vllm.router.server:main",
            "nexrt-vllm=nexrt_vllm.cli:main",
        ]
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
