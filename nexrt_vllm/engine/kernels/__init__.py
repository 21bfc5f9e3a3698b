"""Triton kernels for the batch-1 decode step (GPU path).

Import the submodules lazily (they import triton); the CPU/eager engine never needs them. Every kernel
reproduces the eager op's rounding points (bf16 after each op the eager path rounds) so the graph path
and the eager path agree to within accumulation-order differences.
"""
import importlib
import importlib.util
import os
import sys

MODULES = ("attention", "gdn", "gemv", "moe", "sampling", "spec", "tp")
ALSO = ("batch", "batch_round")  # imported by `load` as well (interpreted with it), not in its result


def load(interpret: bool = False) -> tuple:
    """Import the kernel modules; with `interpret`, as Triton-interpreter functions that run on CPU.

    Triton decides interpreter vs compiled when a function is decorated, so TRITON_INTERPRET is set
    only around that first import and then restored: it must not leak into the rest of the process
    (or into subprocesses, e.g. a vLLM server a test starts). Modules already imported are returned
    as they are, so call this before anything else imports them."""
    fresh = [m for m in MODULES + ALSO if f"{__name__}.{m}" not in sys.modules]
    prev = os.environ.get("TRITON_INTERPRET")
    if interpret and fresh:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = tuple(importlib.import_module(f"{__name__}.{m}") for m in MODULES)
        for m in ALSO:
            importlib.import_module(f"{__name__}.{m}")
        if interpret and importlib.util.find_spec("triton.experimental.gluon") is not None:
            # The interpreter imports this lazily on the first launch and asserts interpret mode then.
            importlib.import_module("triton.experimental.gluon")
    finally:
        if interpret and fresh:
            if prev is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = prev
    return mods
