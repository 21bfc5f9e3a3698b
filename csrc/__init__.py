"""CUDA C++ sources of the decode kernels (installed as `nexrt_vllm.csrc`); built at first use by
`nexrt_vllm.engine.cuda_kernels` (nvcc -> sm_90a cubin, cached), not by setup.py."""
