"""A chain of dependent GEMVs as one persistent launch (csrc/gemv_chain.cu) against the step's Triton
launches, in one process on the GPU (issue #19: what a task boundary costs inside one launch).

- `mlp`: the Qwen3.5-2B shape's 24 dense MLP blocks back to back (gate_up [12288, 2048] with the
  RMSNorm prologue, down [2048, 6144] with the SwiGLU prologue and the residual epilogue): 48 GEMVs,
  1.81 GB of distinct weights. Triton: the step's two launches per block (`kernels.gemv.gemv`,
  `gpu.tuning.Tuning` shapes, head prefetch, L2 requests for the next weight, PDL on) — the step's MLP
  launches without the layers between them. Persistent: one launch of 48 tasks; again without the
  dependency waits (wrong numbers, the streaming alone); and one profiled launch (%globaltimer per CTA
  and task: waiting + building the input, the dots, the epilogue up to the counter's release, the
  spread of the CTAs' arrivals, the latency from the last arrival to the next task's input).
- `line`: chains of GEMVs over distinct [B / 4096, 2048] weights (RMSNorm prologue, residual
  epilogue, each waiting on the one before), per B; the line t = a + B / bw through the per-task
  times, both ways (Triton: `launch_floor.gemv_chain`).

Correctness first: the chain's final residual of both ways against a float64 reference with the
same bf16 roundings (max error in the JSON; the run fails if the persistent kernel is off).

    PYTHONPATH=. python3 benchmarks/persistent_chain.py --json $OUT/persistent_chain_h200.json \
        --configs 26x8192x16,26x8192x12
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_bench as D  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "csrc", "gemv_chain.cu")
NVCC_FLAGS = ["-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"]
GROUP, MAX_K = 256, 8192  # csrc/gemv_chain.cu: kGroup, kMaxK
PLAIN, RMSNORM, SWIGLU = 0, 1, 2
STORE, RESIDUAL = 0, 1


def nvcc() -> str:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.exists(cand):
            return cand
    raise RuntimeError("nvcc not found (PATH or $CUDA_HOME/bin): cannot build csrc/gemv_chain.cu")


def compile_cubin(warps: int = 16) -> tuple[bytes, str]:
    """(cubin, ptxas report) of csrc/gemv_chain.cu for sm_90a with `warps` consumer warps."""
    extra = (f"-DGEMV_CHAIN_CONSUMER_WARPS={warps}",)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gemv_chain.cubin")
        p = subprocess.run([nvcc(), *NVCC_FLAGS, *extra, "-Xptxas", "-v", "-o", out, SOURCE],
                           capture_output=True, text=True, timeout=300)
        if p.returncode:
            raise RuntimeError(f"nvcc failed on csrc/gemv_chain.cu:\n{p.stderr[-3000:]}")
        with open(out, "rb") as f:
            return f.read(), p.stderr


class Task(ctypes.Structure):
    """csrc/gemv_chain.cu's `Task`, field for field."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("w", "x", "norm_w", "y")] + \
               [(n, ctypes.c_int32) for n in ("n", "k", "prologue", "epilogue", "wait")] + [("eps", ctypes.c_float)]


class Args(ctypes.Structure):
    """csrc/gemv_chain.cu's `Args`, field for field."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("tasks", "counters", "epoch", "prof")] + \
               [(n, ctypes.c_int32) for n in ("num_tasks", "stages", "stage_bytes", "max_k", "max_rows")]


class Chain:
    """One persistent launch over `tasks`: dicts w, x, y, prologue, epilogue, wait, norm_w (None), eps."""

    _lib = None

    def __init__(self, tasks: list[dict], cubin: bytes, *, stages: int = 26, stage_bytes: int = 8192, warps: int = 16,
                 profile: bool = False):
        if Chain._lib is None:
            Chain._lib = ctypes.CDLL("libcuda.so.1")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        if stage_bytes % (2 * GROUP):
            raise ValueError(f"stage_bytes {stage_bytes}: not a multiple of {2 * GROUP}")
        if stages < warps:  # a warp waits on a stage's next phase only while the ring holds its previous one
            raise ValueError(f"{stages} ring stages for {warps} consumer warps: needs stages >= warps")
        recs = []
        max_k = max_rows = 0
        for t in tasks:
            w = t["w"]
            n, k = w.shape
            if k % GROUP or k > MAX_K or not w.is_contiguous() or w.dtype != torch.bfloat16:
                raise ValueError(f"task weight {tuple(w.shape)} {w.dtype}: needs contiguous bf16, K % {GROUP} == 0, "
                                 f"K <= {MAX_K}")
            nw = t.get("norm_w")
            recs.append(Task(w.data_ptr(), t["x"].data_ptr(), nw.data_ptr() if nw is not None else 0,
                             t["y"].data_ptr(), n, k, t["prologue"], t["epilogue"], t["wait"], t.get("eps", 1e-6)))
            max_k, max_rows = max(max_k, k), max(max_rows, -(-n // self.sms))
        max_rows = -(-max_rows // 4) * 4
        self.threads = 32 * warps + 32
        arr = (Task * len(recs))(*recs)
        self.tasks = torch.frombuffer(bytearray(bytes(arr)), dtype=torch.uint8).cuda()
        self.counters = torch.zeros(len(recs) + 1, dtype=torch.int32, device="cuda")
        self.epoch = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.prof = torch.zeros(self.sms, len(recs), 4, dtype=torch.int64, device="cuda") if profile else None
        self.args = Args(self.tasks.data_ptr(), self.counters.data_ptr(), self.epoch.data_ptr(),
                         self.prof.data_ptr() if profile else 0, len(recs), stages, stage_bytes, max_k, max_rows)
        head = 16 * stages + 4 * (32 + max_rows) + 2 * max_k
        self.smem = -(-(128 + head) // 128) * 128 + stages * stage_bytes
        self.fn, self.mod = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self._lib.cuModuleLoadData(ctypes.byref(self.mod), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        self._check(self._lib.cuModuleGetFunction(ctypes.byref(self.fn), self.mod, b"gemv_chain_kernel"),
                    "cuModuleGetFunction")
        self._check(self._lib.cuFuncSetAttribute(self.fn, 8, ctypes.c_int(self.smem)), "cuFuncSetAttribute")

    def _check(self, rc: int, what: str) -> None:
        if rc:
            msg = ctypes.c_char_p()
            self._lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA driver error {rc} ({(msg.value or b'?').decode()})")

    def __call__(self) -> None:
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(self.args), ctypes.c_void_p))
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.cuLaunchKernel(self.fn, self.sms, 1, 1, self.threads, 1, 1, self.smem,
                                             ctypes.c_void_p(stream), params, None), "cuLaunchKernel")


def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float64)


def reference(tasks: list[dict], state: dict[int, torch.Tensor]) -> None:
    """The chain in float64 with the kernels' bf16 roundings; `state` maps data_ptr -> float64 buffer."""
    def buf(t):
        return state.setdefault(t.data_ptr(), t.to(torch.float64).clone())
    for t in tasks:
        w, x, y = t["w"].to(torch.float64), buf(t["x"]), buf(t["y"])
        k = w.shape[1]
        if t["prologue"] == SWIGLU:
            g, u = x[:k], x[k:2 * k]
            xv = _bf(_bf(g * torch.sigmoid(g)) * u)
        elif t["prologue"] == RMSNORM:
            xv = _bf(x[:k] * torch.rsqrt((x[:k] ** 2).mean() + t.get("eps", 1e-6)) * (1 + t["norm_w"].double()))
        else:
            xv = x[:k]
        out = _bf(w @ xv)
        y[:len(out)] = _bf(y[:len(out)] + out) if t["epilogue"] == RESIDUAL else out


def mlp_tasks(layers: int = 24, hidden: int = 2048, inter: int = 6144, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(hidden, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    gu = torch.zeros(2 * inter, device="cuda", dtype=torch.bfloat16)
    act = torch.zeros(inter, device="cuda", dtype=torch.bfloat16)
    blocks = []
    for _ in range(layers):
        blocks.append(dict(
            norm=(torch.randn(hidden, device="cuda", generator=gen) * 0.1).to(torch.bfloat16),
            gate_up=(torch.randn(2 * inter, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16),
            down=(torch.randn(hidden, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)))
    tasks = []
    for b in blocks:
        tasks.append(dict(w=b["gate_up"], x=h, y=gu, norm_w=b["norm"], prologue=RMSNORM, epilogue=STORE,
                          wait=len(tasks) - 1))
        tasks.append(dict(w=b["down"], x=gu, y=h, prologue=SWIGLU, epilogue=RESIDUAL, wait=len(tasks) - 1))
    return h, gu, act, blocks, tasks


def triton_mlp(h, act, blocks):
    from nexrt_vllm.engine.gpu.tuning import Tuning
    from nexrt_vllm.engine.kernels import common, gemv
    t = Tuning()
    ws = [w for b in blocks for w in ((b["gate_up"], True), (b["down"], False))]
    l2 = [gemv.l2_target(ws[i + 1][0], t.l2_prefetch, halves=ws[i + 1][1]) if i + 1 < len(ws) else None
          for i in range(len(ws))]

    def shape(n):
        return {**t.shape(n), "prefetch": t.prefetch, "vec": t.vec}

    def run():
        with common.launch_options(True):
            for i, b in enumerate(blocks):
                gemv.gemv(h, b["gate_up"], act, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_SWIGLU, norm_w=b["norm"],
                          l2=l2[2 * i], **shape(act.numel()))
                gemv.gemv(act, b["down"], h, epi=gemv.EPI_RESIDUAL, l2=l2[2 * i + 1], **shape(h.numel()))
    return run


def bench_mlp(cubin: bytes, reps: int, stages: int, stage_bytes: int, warps: int) -> dict:
    import launch_floor as LF
    h, gu, act, blocks, tasks = mlp_tasks()
    h0 = h.clone()
    state = {}
    reference(tasks, state)
    ref = state[h.data_ptr()].clone()
    chain = Chain(tasks, cubin, stages=stages, stage_bytes=stage_bytes, warps=warps)
    chain()
    torch.cuda.synchronize()
    err_p = (h.double() - ref).abs().max().item()
    h.copy_(h0)
    tri = triton_mlp(h, act, blocks)
    tri()
    torch.cuda.synchronize()
    err_t = (h.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    nbytes = sum(t["w"].numel() * 2 for t in tasks)
    free = Chain([{**t, "wait": -1} for t in tasks], cubin, stages=stages, stage_bytes=stage_bytes, warps=warps)
    t_tri = LF.time_chain(tri, 1, reps)
    t_per = LF.time_chain(chain, 1, reps)
    t_free = LF.time_chain(free, 1, reps)
    t_tri2 = LF.time_chain(tri, 1, reps)
    out = {"tasks": len(tasks), "weight_bytes": nbytes, "ref_max_abs": scale,
           "max_abs_err": {"persistent": err_p, "triton": err_t},
           "us": {"triton": t_tri * 1e6, "persistent": t_per * 1e6, "persistent_no_waits": t_free * 1e6,
                  "triton_again": t_tri2 * 1e6},
           "TBps": {"triton": nbytes / t_tri / 1e12, "persistent": nbytes / t_per / 1e12,
                    "persistent_no_waits": nbytes / t_free / 1e12},
           "phases": phases(tasks, cubin, stages, stage_bytes, warps)}
    if not err_p <= max(4 * err_t, 0.02 * scale):
        raise AssertionError(f"persistent MLP chain off: max error {err_p} (Triton {err_t}, |ref| {scale})")
    return out


def phases(tasks, cubin, stages, stage_bytes, warps) -> dict:
    """Where a task's time goes inside the persistent launch (one profiled launch, %globaltimer per CTA):
    medians over the tasks of each kind (even: gate_up, odd: down) of the CTAs' median phase times,
    the spread of the CTAs' arrivals, and the dependency latency (last arrival -> median input start)."""
    prof_chain = Chain(tasks, cubin, stages=stages, stage_bytes=stage_bytes, warps=warps, profile=True)
    for _ in range(3):
        prof_chain()
    torch.cuda.synchronize()
    p = prof_chain.prof.double() / 1e3  # us, [cta, task, 4]
    wait_in = (p[:, :, 1] - p[:, :, 0]).median(0).values
    dots = (p[:, :, 2] - p[:, :, 1]).median(0).values
    epi = (p[:, :, 3] - p[:, :, 2]).median(0).values
    spread = p[:, :, 3].max(0).values - p[:, :, 3].min(0).values
    dep = p[:, 1:, 1].median(0).values - p[:, :-1, 3].max(0).values
    out = {"kernel_us": (p[:, -1, 3].max() - p[:, 0, 0].min()).item()}
    for name, sl in (("gate_up", slice(0, None, 2)), ("down", slice(1, None, 2))):
        out[name] = {"wait_and_input_us": wait_in[sl].median().item(), "dots_us": dots[sl].median().item(),
                     "epilogue_us": epi[sl].median().item(), "arrival_spread_us": spread[sl].median().item()}
    out["dependency_latency_us"] = dep.median().item()
    return out


def bench_line(cubin: bytes, sizes_mb: list[float], reps: int, stages: int, stage_bytes: int, warps: int) -> dict:
    import launch_floor as LF
    pts = []
    for mb in sizes_mb:
        nbytes = int(mb * (1 << 20))
        ws, x, nw, y = LF.chain_operands(nbytes)
        n = len(ws)
        tasks = [dict(w=w, x=x, y=y, norm_w=nw, prologue=RMSNORM, epilogue=RESIDUAL, wait=i - 1)
                 for i, w in enumerate(ws)]
        chain = Chain(tasks, cubin, stages=stages, stage_bytes=stage_bytes, warps=warps)
        t_per = LF.time_chain(chain, n, reps)
        del chain, ws, tasks
        torch.cuda.empty_cache()
        t_tri, _ = LF.gemv_chain(nbytes, True, reps)
        pts.append({"bytes": nbytes, "tasks": n, "us_persistent": t_per * 1e6, "us_triton": t_tri * 1e6})
        D.log(f"[line] {mb} MB: persistent {t_per * 1e6:.2f} us, Triton {t_tri * 1e6:.2f} us per GEMV")
    fit = {key.split("_")[1]: LF.fit_line([p["bytes"] for p in pts], [p[key] for p in pts])
           for key in ("us_persistent", "us_triton")}
    return {"points": pts, "fit": fit}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sizes-mb", default="0.5,1,2,4,8,16,32,64")
    ap.add_argument("--configs", default="26x8192x16",
                    help="ring stages x stage bytes x consumer warps, comma separated; the first also runs `line`")
    ap.add_argument("--cubin", help="a prebuilt csrc/gemv_chain.cu cubin (16 consumer warps) where nvcc is missing")
    a = ap.parse_args(argv)
    cubins = {}

    def cubin(warps):
        if warps not in cubins:
            if a.cubin and warps == 16:
                with open(a.cubin, "rb") as f:
                    cubins[warps] = (f.read(), f"prebuilt {a.cubin}")
            else:
                cubins[warps] = compile_cubin(warps)
        return cubins[warps][0]
    configs = [(c, *(int(v) for v in c.split("x"))) for c in a.configs.split(",")]
    out = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "copy_bw_Bps": D.copy_bandwidth(), "mlp": {}, "line": {}}
    for key, stages, sb, warps in configs:
        out["mlp"][key] = bench_mlp(cubin(warps), a.reps, stages, sb, warps)
        D.log(f"[mlp {key}] {json.dumps(out['mlp'][key]['us'])} {json.dumps(out['mlp'][key]['phases'])}")
    out["ptxas"] = {w: r.strip().splitlines()[-3:] for w, (_, r) in cubins.items()}
    if a.sizes_mb:
        key, stages, sb, warps = configs[0]
        out["line"][key] = bench_line(cubin(warps), [float(s) for s in a.sizes_mb.split(",")], a.reps, stages, sb,
                                      warps)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
