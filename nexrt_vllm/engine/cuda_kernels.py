"""CUDA C++ decode kernels from `csrc/`: compiled with nvcc at first use, launched through the driver API.

No torch C++ extension: a kernel is one `.cu` file compiled to an sm_90a cubin (a few seconds, then
cached by source hash under $NEXRT_CACHE_DIR or ~/.cache/nexrt_vllm), loaded with
`cuModuleLoadData` and launched with `cuLaunchKernel` on torch's current stream, so a launch inside
`torch.cuda.graph` capture becomes a node of the step's graph like the Triton launches.

`moe_decode_plan` (pure, testable on CPU) decides whether a model's MoE shape fits the persistent
MoE kernel on a device and how it is laid out; `MoeDecode` builds and launches it. A shape, device
or machine it cannot serve raises `CudaKernelUnsupported` with the reason (the decoder uses the
kernel only when `Tuning.moe_impl == "cuda"`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources

from .errors import EngineError

ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ["-cubin", "-O3", "-std=c++17", *ARCH_FLAGS]

# Mirrors of csrc/moe_decode.cu's constants (its shared-memory layout is computed here).
THREADS, CTHREADS, MAX_TILES, MAX_TOPK, MAX_STAGES, STATIC_SMEM, ROW_PAD = 288, 256, 160, 16, 16, 512, 64
STAGE_BYTES = 16384 + 4 * ROW_PAD


class CudaKernelUnsupported(EngineError):
    """This kernel cannot run this shape / on this device / without nvcc; the message says why."""


def nvcc_path() -> str | None:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.exists(cand):
            return cand
    return None


def source(name: str) -> str:
    """csrc/<name>.cu: the installed `nexrt_vllm.csrc` package data, or the checkout's csrc/ (PYTHONPATH runs)."""
    try:
        return (resources.files("nexrt_vllm.csrc") / f"{name}.cu").read_text()
    except ModuleNotFoundError:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with open(os.path.join(root, "csrc", f"{name}.cu")) as f:
            return f.read()


def compile_cubin(name: str, extra_flags: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """(cubin bytes, ptxas report) of csrc/<name>.cu for sm_90a; cached by source + flags + nvcc."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise CudaKernelUnsupported("nvcc not found (PATH or $CUDA_HOME/bin): cannot build csrc/ kernels")
    src = source(name)
    flags = [*NVCC_FLAGS, *extra_flags, "-Xptxas", "-v"]
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([src, *flags, ver]).encode()).hexdigest()[:24]
    cache = os.path.join(os.environ.get("NEXRT_CACHE_DIR") or os.path.expanduser("~/.cache/nexrt_vllm"), "cubin")
    path = os.path.join(cache, f"{name}-{key}.cubin")
    if os.path.exists(path) and os.path.exists(path + ".log"):
        with open(path, "rb") as f, open(path + ".log") as g:
            return f.read(), g.read()
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cu = os.path.join(tmp, f"{name}.cu")
        with open(cu, "w") as f:
            f.write(src)
        out = os.path.join(tmp, f"{name}.cubin")
        p = subprocess.run([nvcc, *flags, "-o", out, cu], capture_output=True, text=True, timeout=300)
        if p.returncode:
            raise CudaKernelUnsupported(f"nvcc failed on csrc/{name}.cu:\n{p.stderr[-3000:]}")
        with open(out, "rb") as f:
            cubin = f.read()
    tmp_path = f"{path}.{os.getpid()}"
    with open(tmp_path, "wb") as f:
        f.write(cubin)
    with open(tmp_path + ".log", "w") as f:
        f.write(p.stderr)
    os.replace(tmp_path + ".log", path + ".log")
    os.replace(tmp_path, path)  # atomic: concurrent builders agree on the bytes
    return cubin, p.stderr


class _Driver:
    """The few CUDA driver entry points used here (libcuda via ctypes); errors raise EngineError."""

    _lib = None

    def __init__(self):
        if _Driver._lib is None:
            _Driver._lib = ctypes.CDLL("libcuda.so.1")
        self.lib = _Driver._lib

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise EngineError(f"{what} failed: CUDA driver error {rc} ({(msg.value or b'?').decode()})")

    def current_context(self) -> None:
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise EngineError("no current CUDA context (touch the device through torch first)")

    def load(self, cubin: bytes, func: str) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        self.current_context()
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, func.encode()), f"cuModuleGetFunction({func})")
        return mod, fn

    def set_max_dynamic_smem(self, fn, nbytes: int) -> None:
        # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
        self.check(self.lib.cuFuncSetAttribute(fn, 8, ctypes.c_int(nbytes)), "cuFuncSetAttribute")

    def launch(self, fn, grid: int, block: int, smem: int, stream: int, args: ctypes.Structure) -> None:
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
        self.check(self.lib.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, smem, ctypes.c_void_p(stream), params, None),
                   "cuLaunchKernel")


class _MoeArgs(ctypes.Structure):
    """csrc/moe_decode.cu's `MoeArgs`, field for field (C layout on x86-64 and in the kernel ABI)."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("res", "ln_w", "w_router", "gate_up", "down", "s_gate_up", "s_down",
                                                 "logits", "act", "ids", "wts", "bar", "prof")] + \
               [(n, ctypes.c_int32) for n in ("H", "E", "top_k", "I", "Is", "IMAX", "R", "stages", "norm_topk")] + \
               [("eps", ctypes.c_float)]


@dataclass(frozen=True)
class MoePlan:
    grid: int  # CTAs = multiprocessors (all resident: the kernel has grid-wide barriers)
    rows_per_cta: int  # R: hidden rows of the down projections each CTA owns
    stages: int  # ring stages per CTA (STAGE_BYTES each)
    smem: int  # dynamic shared memory per CTA, bytes
    tiles: int  # most ring tiles of one CTA


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def moe_decode_plan(H: int, E: int, top_k: int, I: int, Is: int, num_sms: int, smem_optin: int) -> MoePlan:
    """Layout of the persistent MoE kernel for this shape on a device with `num_sms` SMs and
    `smem_optin` bytes of opt-in shared memory per block; CudaKernelUnsupported if it does not fit."""
    why = []
    if H % 64 or I % 16 or Is % 16 or E % 4:
        why.append(f"needs hidden % 64, intermediate sizes % 16 and experts % 4 == 0 (H={H}, I={I}, Is={Is}, E={E})")
    if 2 * (2 * H + ROW_PAD) > STAGE_BYTES:
        why.append(f"hidden {H} > 4096: one gate/up row pair must fit a stage")
    if not 1 <= top_k <= min(MAX_TOPK, E) or E > 2 * CTHREADS:
        why.append(f"needs 1 <= top_k <= {MAX_TOPK}, top_k <= experts <= {2 * CTHREADS} (E={E}, top_k={top_k})")
    G = num_sms
    R = _cdiv(H, G)
    if R > CTHREADS:
        why.append(f"{R} down rows per CTA > {CTHREADS}")
    ppt = max(1, min(STAGE_BYTES // (2 * (2 * H + ROW_PAD)), 2))  # csrc: gate/up pairs per tile (<= 4 rows)
    rpr = max(1, min(4, STAGE_BYTES // (2 * H + ROW_PAD)))
    tiles = _cdiv(_cdiv(E + 1, G), rpr)
    down_tiles = 0
    for n in [I] * top_k + [Is]:
        down = _cdiv(R, max(1, min(16, STAGE_BYTES // (2 * max(n, 1)))))
        tiles += _cdiv(_cdiv(n, G), ppt) + down
        down_tiles += down
    if tiles > MAX_TILES:
        why.append(f"{tiles} ring tiles per CTA > {MAX_TILES}")
    imax = max(I, Is)
    fixed = (H * 2 + (top_k + 1) * imax * 2 + 16 * MAX_STAGES + MAX_TILES * 16 + 4 * MAX_TOPK * 4 + E * 4
             + R * (top_k + 1) * 4)
    stages = min(MAX_STAGES, (smem_optin - STATIC_SMEM - fixed) // STAGE_BYTES)
    if down_tiles > stages:  # csrc: the down tiles all wait in the ring for the second barrier
        why.append(f"{down_tiles} down tiles per CTA do not fit {max(stages, 0)} ring stages")
    if stages < 2:
        why.append(f"shared memory: {fixed} B of buffers leave {max(stages, 0)} ring stages (need >= 2) of "
                   f"{smem_optin} B")
    if why:
        raise CudaKernelUnsupported("persistent MoE kernel: " + "; ".join(why))
    return MoePlan(grid=G, rows_per_cta=R, stages=stages, smem=stages * STAGE_BYTES + fixed, tiles=tiles)


class MoeDecode:
    """The persistent MoE block kernel (csrc/moe_decode.cu) for one model shape on one device."""

    def __init__(self, device, H: int, E: int, top_k: int, I: int, Is: int, defines: tuple[str, ...] = ()):
        """`defines`: extra -D flags (the profiling variants of csrc/moe_decode.cu; results then garbage)."""
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            raise CudaKernelUnsupported("CUDA kernels need a CUDA device")
        props = torch.cuda.get_device_properties(dev)
        if (props.major, props.minor) != (9, 0):
            raise CudaKernelUnsupported(f"built for sm_90a; device is sm_{props.major}{props.minor}")
        drv = _Driver()
        attr = ctypes.c_int()
        # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
        drv.check(drv.lib.cuDeviceGetAttribute(ctypes.byref(attr), 97, dev.index or 0), "cuDeviceGetAttribute")
        self.plan = moe_decode_plan(H, E, top_k, I, Is, props.multi_processor_count, attr.value)
        self.shape = dict(H=H, E=E, top_k=top_k, I=I, Is=Is)
        self.cubin, self.ptxas_log = compile_cubin("moe_decode", tuple(f"-D{d}" for d in defines))
        torch.cuda.synchronize(dev)  # the runtime makes torch's context current on this thread
        self._drv = drv
        self._mod, self._fn = drv.load(self.cubin, "moe_decode_kernel")
        drv.set_max_dynamic_smem(self._fn, self.plan.smem)
        self.bar = torch.zeros(2, dtype=torch.int64, device=dev)  # monotonic barrier counters

    def launch(self, res, ln_w, w_router, gate_up, down, s_gate_up, s_down, logits, act, ids, wts, *, eps: float,
               norm_topk: bool, prof=None) -> None:
        """One MoE block; `prof` (int64 [grid, 10] or None) receives per-CTA %globaltimer stamps at the
        kernel's phase boundaries (csrc/moe_decode.cu `stamp`)."""
        import torch

        s = self.shape
        tensors = dict(res=res, ln_w=ln_w, w_router=w_router, gate_up=gate_up, down=down, s_gate_up=s_gate_up,
                       s_down=s_down, logits=logits, act=act, ids=ids, wts=wts)
        for name, t in tensors.items():
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise EngineError(f"moe_decode: {name} must be contiguous and 16-byte aligned")
        if gate_up.shape != (s["E"], 2 * s["I"], s["H"]) or s_down.shape != (s["H"], s["Is"]):
            raise EngineError(f"moe_decode: weights {tuple(gate_up.shape)} / {tuple(s_down.shape)} do not match {s}")
        imax = max(s["I"], s["Is"])
        args = _MoeArgs(**{k: t.data_ptr() for k, t in tensors.items()}, bar=self.bar.data_ptr(),
                        prof=prof.data_ptr() if prof is not None else None, H=s["H"], E=s["E"],
                        top_k=s["top_k"], I=s["I"], Is=s["Is"], IMAX=imax, R=self.plan.rows_per_cta,
                        stages=self.plan.stages, norm_topk=int(norm_topk), eps=eps)
        self._drv.launch(self._fn, self.plan.grid, THREADS, self.plan.smem, torch.cuda.current_stream().cuda_stream,
                         args)
