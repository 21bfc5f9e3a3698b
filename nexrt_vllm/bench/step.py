"""The fused decode step at the real shapes, measured: engines of those shapes (random, FP8 or grafted
weights), the bytes each launch of the step must move, graph replay timing and per-group device time.
Used by decode_bench.py, outputs_bench.py, the MTP round (spec_round.py), the GPU checks and the
launch-shape tuners."""
from __future__ import annotations

import os
import statistics

import torch

from nexrt_vllm.bench.shapes import GRAFT_ARCH, SHAPES
from nexrt_vllm.engine.fp8 import FP8Weight
from nexrt_vllm.engine.state import AttentionState


def log(*a):
    print(*a, flush=True)


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (median)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def tuning_from(kvs: str):
    """`gpu.tuning.tuning_overrides` for a benchmark's --tuning: a bad field exits with its message."""
    from nexrt_vllm.engine.gpu.tuning import tuning_overrides
    try:
        return tuning_overrides(kvs)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def time_replays(g, n: int) -> list[float]:
    """Per-replay device time (s) of `n` back-to-back replays, from events between them."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        g.replay()
        ev[i + 1].record()
    ev[-1].synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(n)]


def time_from(graph, pos: torch.Tensor, ctx: int, reps: int) -> float:
    """Median device time (s) of `reps` replays of `graph` from position ctx (`pos`: the positions each
    replay advances), after 5 warm-up replays from there."""
    pos.fill_(ctx)
    time_replays(graph, 5)
    pos.fill_(ctx)
    return statistics.median(time_replays(graph, reps))


def capture_launches(fns, options) -> torch.cuda.CUDAGraph:
    """One graph of the launches `fns` back to back, each run under the launch options `options()` (a
    decoder's `launch_options`), captured as a runner captures its step (gpu/runner.py
    `capture_graph`); the warm-up run's state changes stay."""
    from nexrt_vllm.engine.gpu.runner import capture_graph

    def run() -> None:
        with options():
            for fn in fns:
                fn()
    return capture_graph(run)


def fill_context(eng, ctx: int, gen: torch.Generator) -> None:
    """Make the state hold `ctx` tokens of plausible magnitude (timing only: values do not matter)."""
    st = eng.state
    for layer in st.layers:
        if isinstance(layer, AttentionState):
            layer.k[:, :ctx].normal_(generator=gen)
            layer.v[:, :ctx].normal_(generator=gen)
        else:
            layer.conv.normal_(generator=gen)
            layer.rec.normal_(generator=gen).mul_(0.05)
    st.set_seq_len(ctx)


def nbytes(t) -> int:
    """Bytes a launch reads to stream weight / state `t` once: an FP8 weight's e4m3 values, block
    scales, scale-row map and bf16 tail (fp8.FP8Weight.nbytes); a tensor's elements."""
    if isinstance(t, FP8Weight):
        return t.nbytes()
    return t.numel() * t.element_size()


def experts_nbytes(w, k: int, n_experts: int) -> int:
    """Bytes of k of the n_experts stacked experts of `w` (the selected ones), and an FP8 weight's
    scale-row map (shared by the experts) once."""
    if isinstance(w, FP8Weight):
        return k * (w.q.numel() + 4 * w.scale.numel()) // n_experts + 4 * w.srow.numel()
    return k * nbytes(w) // n_experts


def _kv_row(c, layer) -> int:
    return c.num_kv_heads * c.head_dim * layer.mixer.state.k.element_size()


# Each group of graph.FusedDecoder.plan(): the part of its layer it computes (None: not a layer's) and
# the bytes one launch must move at context n, from the decoder d and the layer's record L: each
# weight / state byte read once, state written once, K/V rows 0..n read, only the selected experts.
GROUPS = {
    "embed": (None, lambda d, L, n: d.cfg.hidden_size * d.embed.element_size()),
    "gdn_in_proj+conv": ("mixer", lambda d, L, n: nbytes(L.mixer.w_in) + nbytes(L.mixer.conv_w)
                         + 2 * nbytes(L.mixer.state.conv)),
    "gdn_step": ("mixer", lambda d, L, n: 2 * nbytes(L.mixer.state.rec)),
    "gdn_out_proj": ("mixer", lambda d, L, n: nbytes(L.mixer.w_out)),
    "attn_qkv_proj": ("mixer", lambda d, L, n: nbytes(L.mixer.w_qkv)),
    "attn_qknorm_rope_kvwrite": ("mixer", lambda d, L, n: 2 * _kv_row(d.cfg, L)),
    "attn_splitk+combine": ("mixer", lambda d, L, n: 2 * _kv_row(d.cfg, L) * (n + 1)),
    "attn_o_proj": ("mixer", lambda d, L, n: nbytes(L.mixer.w_o)),
    "moe_router": ("ffn", lambda d, L, n: nbytes(L.ffn.w_router)),
    "moe_experts": ("ffn", lambda d, L, n: experts_nbytes(L.ffn.gate_up, d.cfg.num_experts_per_tok,
                                                          d.cfg.num_experts)
                    + experts_nbytes(L.ffn.down, d.cfg.num_experts_per_tok, d.cfg.num_experts)
                    + nbytes(L.ffn.s_gate_up) + nbytes(L.ffn.s_down)),
    "mlp_gate_up+swiglu": ("ffn", lambda d, L, n: nbytes(L.ffn.w_gate_up)),
    "mlp_down": ("ffn", lambda d, L, n: nbytes(L.ffn.w_down)),
    "lm_head+argmax": (None, lambda d, L, n: nbytes(d.lm_head)),
    # a TP rank's (gpu/tp.py): its fp32 partial in and out of the all-reduce, then read and zeroed by the
    # residual add, the residual read and written
    "tp_allreduce+residual": (None, lambda d, L, n: 4 * nbytes(d.part) + 2 * nbytes(d.res)),
}


def step_bytes(d, seq_len: int) -> list[tuple[object, int]]:
    """(launch, bytes it must move at context `seq_len`) for every launch of the fused step, in order."""
    return [(s, GROUPS[s.group][1](d, None if s.layer is None else d.layers[s.layer], seq_len)) for s in d.plan()]


def bytes_per_step(d, seq_len: int) -> dict[str, int]:
    """Bytes the fused step must move at context `seq_len`, per kernel group and in total."""
    out: dict[str, int] = {}
    for s, nb in step_bytes(d, seq_len):
        out[s.group] = out.get(s.group, 0) + nb
    out["total"] = sum(out.values())
    return out


def group_times(steps, options, saved, reps: int = 20) -> dict[str, tuple[int, float]]:
    """Per launch group of `steps` (Launch records): (its launches, their median device time in s) back to
    back in one graph, run under `options()`; the tensors of `saved` put back around each group's run."""
    groups: dict[str, list] = {}
    for s in steps:
        groups.setdefault(s.group, []).append(s.run)
    keep = [(t, t.clone()) for t in saved]
    out = {}
    for name, fns in groups.items():
        gr = capture_launches(fns, options)
        for t, x in keep:
            t.copy_(x)
        out[name] = (len(fns), statistics.median(time_replays(gr, reps)))
        for t, x in keep:
            t.copy_(x)
        del gr
    return out


def group_marginals(steps, options, saved, reps: int = 30) -> dict:
    """What each launch group of `steps` costs inside their graph: the median replay time of all of them minus
    that of the graph captured without the group's launches (µs; the PDL overlap and launch gaps around the
    group included, which `group_times` times apart from the rest). The tensors of `saved` are put back around
    every capture and timing, so every variant replays from the same position."""
    keep = [(t, t.clone()) for t in saved]

    def restore() -> None:
        for t, x in keep:
            t.copy_(x)

    def timed(fns) -> float:
        gr = capture_launches(fns, options)
        restore()
        time_replays(gr, 5)
        restore()
        sec = statistics.median(time_replays(gr, reps))
        restore()
        del gr
        return sec

    full = timed([s.run for s in steps])
    groups = list(dict.fromkeys(s.group for s in steps))
    return {"all_us": full * 1e6,
            "groups_us": {g: (full - timed([s.run for s in steps if s.group != g])) * 1e6 for g in groups}}


def kernel_groups(d, reps: int = 20) -> dict:
    """Device time of each kernel group of the fused step: the group's launches for every layer back
    to back in one graph (weights stream from HBM as in a real step), with the bytes they move."""
    groups: dict[str, list] = {}
    for s, nb in step_bytes(d, int(d.state.seq_len)):
        groups.setdefault(s.group, []).append((s.run, nb))
    out = {}
    saved = [(t, t.clone()) for layer in d.state.layers for p, t in layer.parts().items() if p not in layer.ROWS]
    pos = d.state.position.clone()
    for name, items in groups.items():
        gr = capture_launches([fn for fn, _ in items], d.launch_options)
        ts = time_replays(gr, reps)
        sec = statistics.median(ts)
        nb = sum(x[1] for x in items)
        out[name] = {"launches": len(items), "us_per_step": sec * 1e6, "us_per_launch": sec * 1e6 / len(items),
                     "bytes_per_step": nb, "GBps": nb / sec / 1e9 if nb else None}
        del gr
    for t, x in saved:
        t.copy_(x)
    d.state.position.copy_(pos)
    return out


def fp8_weights(tensors: dict, cfg) -> dict:
    """The model's tensors in the published FP8 checkpoints' format (fp8.quantize_tensors: 128 x 128
    blocks; head, router, shared-expert gate and GDN b / a in bf16), as an FP8 checkpoint loads them
    on the GPU path (Engine.from_pretrained with fp8_weights="auto")."""
    from nexrt_vllm.engine.fp8 import quantize_tensors
    out = quantize_tensors(tensors, cfg)
    torch.cuda.empty_cache()
    return out


def graft_checkpoint(key: str, ckpt_dir: str) -> str:
    """`ckpt_dir`/<family>: the trained tiny checkpoint that shape `key` carries (graft.py), trained
    there first when absent (on the CPU)."""
    from nexrt_vllm.bench.graft import ensure_checkpoint
    return ensure_checkpoint(os.path.join(ckpt_dir, GRAFT_ARCH[key]), GRAFT_ARCH[key], SHAPES[key])


def graft_engine(key: str, ckpt_dir: str, max_len: int, device: str = "cuda", dtype: str = "bf16"):
    """The real shape `key` carrying the trained tiny checkpoint `ckpt_dir`/<family> (graft.py;
    trained there first when absent); `dtype` "fp8": then quantized into the block format."""
    from nexrt_vllm.bench import graft as G
    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.config import ModelConfig
    from nexrt_vllm.engine.model import Model
    from nexrt_vllm.engine.weights import load_checkpoint
    path = graft_checkpoint(key, ckpt_dir)
    tcfg, rcfg = ModelConfig.from_pretrained(path), ModelConfig.from_dict(SHAPES[key])
    tiny = load_checkpoint(path, tcfg, torch.float32, device, progress=False)[0]
    tensors = G.graft(tiny, tcfg, rcfg, torch.bfloat16, device)
    if dtype == "fp8":
        tensors = fp8_weights(tensors, rcfg)
    return Engine(rcfg, Model(rcfg, tensors, max_len), max_len), tcfg


def periodic_prompt(vocab: int, period: int = 7, n: int = 40, seed: int = 7) -> tuple[list[int], list[int]]:
    """(prompt, the segment it repeats): what the trained checkpoints continue (gpu_check.trained_parity)."""
    import random
    seg = random.Random(seed).sample(range(3, vocab), period)
    return [seg[i % period] for i in range(n)], seg


def random_engine(key: str, max_len: int, dtype: str = "bf16"):
    """An engine of shape `key` with random bf16 weights on the GPU (seed 0), quantized as the published
    FP8 checkpoints with dtype "fp8"."""
    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.config import ModelConfig
    from nexrt_vllm.engine.model import Model
    from nexrt_vllm.engine.weights import random_weights

    if dtype != "fp8":
        return Engine.from_config(SHAPES[key], device="cuda", dtype="bfloat16", max_seq_len=max_len, seed=0)
    cfg = ModelConfig.from_dict(SHAPES[key])
    tensors = fp8_weights(random_weights(cfg, torch.bfloat16, "cuda", seed=0), cfg)
    return Engine(cfg, Model(cfg, tensors, max_len), max_len)
