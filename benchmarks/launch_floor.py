"""What a launch boundary of the decode step costs on the GPU (issue #19's per-launch term).

Chains of launches, each captured in one CUDA graph and replayed (median of `--reps`), PDL on and off:
- `floor`: N launches of a kernel that only waits on its predecessor (PDL) and stores one value,
  with 1 program and with one program per SM: the launch + dependency cost alone;
- `gemv`: N launches of the step's GEMV (`kernels.gemv.gemv`, RMSNorm prologue, residual epilogue,
  the `gpu.tuning.Tuning` launch shapes and head prefetch) over distinct bf16 weights [B / 4096, 2048] of
  B bytes each, for several B, with enough launches that the chain's weights (>= 256 MB) cannot stay
  in L2 between replays. The line t = a + B / bw through the per-launch times gives the fixed cost a
  of a GEMV launch and its streaming rate bw; the copy bandwidth is measured in the same run.

    PYTHONPATH=. python3 benchmarks/launch_floor.py --json $OUT/launch_floor_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_bench as D  # noqa: E402

from nexrt_vllm.engine.gpu.tuning import Tuning  # noqa: E402
from nexrt_vllm.engine.kernels import common, gemv  # noqa: E402
from nexrt_vllm.engine.kernels.common import pdl_begin  # noqa: E402

K = 2048  # the real shapes' hidden size: every GEMV of the step but the 2048-row ones reads K = 2048


@triton.jit
def _floor_kernel(p, PDL: tl.constexpr):
    pdl_begin(PDL)
    tl.store(p + tl.program_id(0), 1)


def time_chain(launch, n_launch: int, reps: int) -> float:
    """Median device time (s) per launch of `launch` (which enqueues the whole chain), graph-captured."""
    launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    D.time_replays(g, 3)
    t = statistics.median(D.time_replays(g, reps))
    del g
    return t / n_launch


def fit_line(nbytes: list[int], us: list[float]) -> dict:
    """Least squares t = a + B / bw through (bytes, µs) points: fixed_us a and stream_TBps bw."""
    mx, my = statistics.fmean(nbytes), statistics.fmean(us)
    c = sum((x - mx) * (y - my) for x, y in zip(nbytes, us)) / sum((x - mx) ** 2 for x in nbytes)
    return {"fixed_us": my - c * mx, "stream_TBps": 1e-6 / c}


def floor(n: int, programs: int, pdl: bool, reps: int) -> float:
    buf = torch.zeros(programs, dtype=torch.int32, device="cuda")

    def chain():
        with common.launch_options(pdl):
            for _ in range(n):
                _floor_kernel[(programs,)](buf, **common.LAUNCH)
    return time_chain(chain, n, reps)


def chain_operands(nbytes: int, min_total: int = 256 << 20, device: str = "cuda") -> tuple:
    """A chain's operands: distinct [nbytes / (2 K), K] bf16 weights (24-512 of them, at least
    min_total bytes in all, so the chain streams from HBM), the input x, the RMSNorm weight, the output y."""
    rows = nbytes // (2 * K)
    n = max(24, min(512, -(-min_total // nbytes)))
    ws = [torch.randn(rows, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    x = torch.randn(K, device=device, dtype=torch.bfloat16)
    nw = torch.zeros(K, device=device, dtype=torch.bfloat16)
    y = torch.zeros(rows, device=device, dtype=torch.bfloat16)
    return ws, x, nw, y


def gemv_chain(nbytes: int, pdl: bool, reps: int, min_total: int = 256 << 20) -> tuple[float, int]:
    ws, x, nw, y = chain_operands(nbytes, min_total)
    n = len(ws)
    t = Tuning()
    shape = {**t.shape(y.numel()), "prefetch": t.prefetch, "vec": t.vec}

    def chain():
        with common.launch_options(pdl):
            for w in ws:
                gemv.gemv(x, w, y, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_RESIDUAL, norm_w=nw, **shape)
    per = time_chain(chain, n, reps)
    del ws
    torch.cuda.empty_cache()
    return per, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--sizes-mb", default="0.5,1,2,4,8,16,32,64")
    ap.add_argument("--floor-launches", type=int, default=273)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "copy_bw_Bps": D.copy_bandwidth(),
           "sms": sms, "floor_us": {}, "gemv": {}}
    for pdl in (False, True):
        tag = "pdl" if pdl else "no_pdl"
        out["floor_us"][tag] = {f"{p}_programs": floor(a.floor_launches, p, pdl, a.reps) * 1e6 for p in (1, sms)}
        pts = []
        for mb in (float(s) for s in a.sizes_mb.split(",")):
            nbytes = int(mb * (1 << 20))
            per, n = gemv_chain(nbytes, pdl, a.reps)
            pts.append({"bytes": nbytes, "launches": n, "us_per_launch": per * 1e6,
                        "TBps": nbytes / per / 1e12})
            D.log(f"[{tag}] {mb} MB: {per * 1e6:.2f} us per launch ({nbytes / per / 1e12:.2f} TB/s)")
        out["gemv"][tag] = {"points": pts, **fit_line([p["bytes"] for p in pts], [p["us_per_launch"] for p in pts])}
        D.log(f"[{tag}] floor {out['floor_us'][tag]}; GEMV fit {out['gemv'][tag]['fixed_us']:.2f} us + "
              f"B / {out['gemv'][tag]['stream_TBps']:.2f} TB/s")
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
