"""The kernel tests' plumbing (tests/engine/test_kernels_*.py): run a kernel wrapper on the device
the tests target, NEXRT_KERNEL_DEVICE (cpu: the Triton interpreter, CI; cuda: the compiled kernels,
benchmarks/checks/gpu_check.py on the H200), and compare with torch."""
from __future__ import annotations

import os

import torch

DEV = os.environ.get("NEXRT_KERNEL_DEVICE", "cpu")


def to_dev(t):
    """A tensor or an FP8Weight on DEV (an FP8Weight is read-only for the kernels: not copied back)."""
    from nexrt_vllm.engine.fp8 import FP8Weight
    if isinstance(t, torch.Tensor):
        return t.to(DEV)
    if isinstance(t, FP8Weight):
        return FP8Weight(t.q.to(DEV), t.scale.to(DEV), t.srow.to(DEV), t.block,
                         None if t.tail is None else t.tail.to(DEV))
    return t


def call(fn, *args, **kw):
    """Run a kernel wrapper on DEV: tensor arguments go there, and come back in place afterwards
    (outputs and in-place state included); FP8Weights go there read-only. Aliasing views are not
    supported (tests pass none)."""
    moved = {}

    def mv(t):
        if DEV == "cpu":
            return t
        if not isinstance(t, torch.Tensor):
            return to_dev(t)
        moved.setdefault(id(t), (t, t.to(DEV)))
        return moved[id(t)][1]

    out = fn(*[mv(a) for a in args], **{k: mv(v) for k, v in kw.items()})
    for t, d in moved.values():
        t.copy_(d.cpu())
    return out


def rel(a, b):
    """Relative L2 error of a against b, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rms1p(x, w, eps=1e-6):
    """Zero-centred RMSNorm as the eager model computes it."""
    xf = x.float()
    return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * (1.0 + w.float())).to(x.dtype)
