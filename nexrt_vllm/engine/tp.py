"""Tensor parallelism of the eager engine: TP = M ranks, weights split as vLLM splits them.

Each rank holds a `TPModel`: the plain `Model` over its shard, run with the *local* config (its
own head and channel counts), so every layer function and `DecodeState` work unchanged and the
rank's state is exactly its shard (K/V of its KV heads, conv channels q|k|v of its GDN heads,
recurrent state of its value heads). Per layer:

* attention: column-parallel q/k/v by heads (q_proj's per-head query|gate rows stay together), KV
  heads `handoff.sharding.kv_heads_of` (one replicated head per rank when M > num_kv_heads),
  q_norm/k_norm replicated, row-parallel o_proj;
* GDN: in_proj by key/value heads — Qwen3-Next's fused in_proj_qkvz / in_proj_ba are grouped per
  key head, so a rank takes whole groups; Qwen3.5's in_proj_qkv rows (and conv1d's channels) are
  three segments q|k|v, each split by heads separately; in_proj_z/b/a, dt_bias, A_log by value
  heads; the gated norm replicated; row-parallel out_proj;
* dense MLP and shared expert: column-parallel gate/up, row-parallel down;
* MoE: tensor parallel *within* every expert (each rank holds 1/M of every expert's
  intermediate rows, the router and the shared-expert gate replicated), as vLLM does without
  `--enable-expert-parallel`. At batch 1 each token reads top-k experts: split within experts, every
  rank reads exactly 1/M of those bytes; split across ranks (EP), the k chosen experts land on
  few ranks and the step waits for the busiest one, so most of the M-fold bandwidth idles;
* embedding replicated (a decode step reads one row of it: M copies cost memory, not bandwidth,
  and save an all-reduce per step); LM head vocab-parallel (it is read whole every step: each rank
  reads 1/M of it), logits all-gathered.

Each mixer's and each FFN's partial output is summed by one all-reduce (`TPModel.reduce`), in
fp32 for bf16/fp16 models (one rounding, as close to TP = 1 as a sum of partials gets).

Process layout: rank 0 is the caller's process and drives the engine (`TPEngine`, an `Engine`
whose prefill / decode_step / state import first tell the followers to do the same); ranks 1..W-1
are spawned processes (`Group`) that run the identical `Engine` code on their shards, so they fail
identically on bad input. Commands travel over one multiprocessing queue per follower (an idle
follower waits on its queue, not inside a collective that would time out); tensors and the
all-reduces go through torch.distributed (gloo on CPU, NCCL on CUDA). `TPEngine.use_graph` puts every
rank on the graph path: each captures its own fused step with the collectives inside, and rank 0's
replays lead the followers' (gpu/tp.py).
"""
from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nexrt_vllm.handoff.sharding import Sharding, kv_heads_of, split, vllm_sharding
from nexrt_vllm.launch import free_port

from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.engine import Engine, resolve_dtype
from nexrt_vllm.engine.errors import ConfigError, EngineError, NotBuiltError, StateError
from nexrt_vllm.engine.model import Model, rms_norm
from nexrt_vllm.engine.weights import EXPERT_RE, load_checkpoint, random_weights

log = logging.getLogger("nexrt.tp")


# ---------------------------------------------------------------------------------------------
# shapes and weights
# ---------------------------------------------------------------------------------------------


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config of one rank's shard (head and channel counts divided by tp); ConfigError if tp
    does not split the model the way vLLM can."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be a positive int, got {tp!r}")
    if tp == 1:
        return cfg

    def div(n: int, what: str) -> int:
        if n % tp:
            raise ConfigError(f"tp {tp} does not divide {what} {n} of {cfg.architecture}")
        return n // tp

    try:
        kv = kv_heads_of(cfg.num_kv_heads, tp, 0)
    except ValueError as e:
        raise ConfigError(f"{cfg.architecture}: {e}") from None
    kw = dict(num_heads=div(cfg.num_heads, "num_attention_heads"), num_kv_heads=kv[1] - kv[0],
              linear_num_key_heads=div(cfg.linear_num_key_heads, "linear_num_key_heads"),
              linear_num_value_heads=div(cfg.linear_num_value_heads, "linear_num_value_heads"))
    if cfg.intermediate_size:
        kw["intermediate_size"] = div(cfg.intermediate_size, "intermediate_size")
    if cfg.num_experts:
        kw["moe_intermediate_size"] = div(cfg.moe_intermediate_size, "moe_intermediate_size")
        kw["shared_expert_intermediate_size"] = div(cfg.shared_expert_intermediate_size,
                                                    "shared_expert_intermediate_size")
    return replace(cfg, **kw)


def rank_sharding(cfg: ModelConfig, tp: int, rank: int) -> Sharding:
    """The heads rank `rank` of a TP = tp engine holds (replicated KV heads included)."""
    return vllm_sharding(cfg.num_kv_heads, cfg.linear_num_key_heads, cfg.linear_num_value_heads, tp, rank,
                         shipped=False)


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """LM-head rows of a rank: chunks of ceil(vocab/tp) (the last one shorter, maybe empty)."""
    chunk = math.ceil(vocab / tp)
    return min(vocab, rank * chunk), min(vocab, (rank + 1) * chunk)


def _take(t: torch.Tensor, dim: int, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """Concatenation of [start, end) slices along `dim`, as a new tensor (the full one can go)."""
    parts = [t.narrow(dim, a, b - a) for a, b in pieces]
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()


def shard_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of every canonical tensor (weights.py names). Unknown names raise."""
    if tp == 1:
        return tensors
    return {name: shard_tensor(cfg, name, w, tp, rank) for name, w in tensors.items()}


def shard_tensor(cfg: ModelConfig, name: str, w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of one canonical tensor (weights.py names; also one expert's
    `layers.L.mlp.experts.J.{gate,up,down}_proj.weight` before the loader stacks them), a new tensor
    unless replicated: a loader can shard each tensor as it reads it (`weights.load_checkpoint(shard=)`),
    so a rank never holds the whole model. Unknown names raise."""
    if tp == 1:
        return w
    s = rank_sharding(cfg, tp, rank)
    hd, dk, dv = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q0, q1 = split(cfg.num_heads, tp, rank, "num_attention_heads")
    (kv0, kv1), (k0, k1), (v0, v1) = s.kv_heads, s.k_heads, s.v_heads
    nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    # conv channels / in_proj_qkv rows: q | k | v, each segment split by heads
    qkv_rows = [(k0 * dk, k1 * dk), (nk * dk + k0 * dk, nk * dk + k1 * dk),
                (2 * nk * dk + v0 * dv, 2 * nk * dk + v1 * dv)]
    group = 2 * dk + 2 * r * dv  # Qwen3-Next in_proj_qkvz rows per key head

    def chunk(n: int) -> list[tuple[int, int]]:
        a, b = split(n, tp, rank, "an intermediate size")
        return [(a, b)]

    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if name == "lm_head.weight":
        return _take(w, 0, [vocab_range(cfg.vocab_size, tp, rank)])
    elif name in ("embed_tokens.weight", "norm.weight") or leaf in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "linear_attn.norm.weight", "mlp.gate.weight",
            "mlp.shared_expert_gate.weight"):
        return w  # replicated
    elif leaf == "self_attn.q_proj.weight":  # per head: query rows then gate rows
        return _take(w, 0, [(q0 * 2 * hd, q1 * 2 * hd)])
    elif leaf in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        return _take(w, 0, [(kv0 * hd, kv1 * hd)])
    elif leaf == "self_attn.o_proj.weight":
        return _take(w, 1, [(q0 * hd, q1 * hd)])
    elif leaf == "linear_attn.in_proj_qkvz.weight":
        return _take(w, 0, [(k0 * group, k1 * group)])
    elif leaf == "linear_attn.in_proj_ba.weight":
        return _take(w, 0, [(k0 * 2 * r, k1 * 2 * r)])
    elif leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        return _take(w, 0, qkv_rows)
    elif leaf == "linear_attn.in_proj_z.weight":
        return _take(w, 0, [(v0 * dv, v1 * dv)])
    elif leaf in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias",
                  "linear_attn.A_log"):
        return _take(w, 0, [(v0, v1)])
    elif leaf == "linear_attn.out_proj.weight":
        return _take(w, 1, [(v0 * dv, v1 * dv)])
    elif leaf in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.shared_expert.gate_proj.weight",
                  "mlp.shared_expert.up_proj.weight"):
        return _take(w, 0, chunk(w.shape[0]))
    elif leaf in ("mlp.down_proj.weight", "mlp.shared_expert.down_proj.weight"):
        return _take(w, 1, chunk(w.shape[1]))
    elif leaf == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows then up rows
        i = w.shape[1] // 2
        (a, b), = chunk(i)
        return _take(w, 1, [(a, b), (i + a, i + b)])
    elif leaf == "mlp.experts.down_proj":  # [E, H, I]
        return _take(w, 2, chunk(w.shape[2]))
    elif (part := EXPERT_RE.match(name)):  # one expert's [I, H] gate / up, [H, I] down, as the stacks split
        return _take(w, 1, chunk(w.shape[1])) if part[3] == "down" else _take(w, 0, chunk(w.shape[0]))
    else:
        raise ConfigError(f"no tensor-parallel rule for weight {name!r}")


class TPModel(Model):
    """One rank's shard of the model: `Model` with the local config, partial outputs all-reduced."""

    def __init__(self, cfg: ModelConfig, shard: dict[str, torch.Tensor], max_seq_len: int, *, tp: int, rank: int,
                 group=None, mtp: dict[str, torch.Tensor] | None = None):
        super().__init__(local_config(cfg, tp), shard, max_seq_len, mtp=mtp)
        self.full_config, self.tp, self.rank, self.group = cfg, tp, rank, group
        self.vocab = cfg.vocab_size
        a, b = vocab_range(cfg.vocab_size, tp, rank)
        self.vocab_chunk = math.ceil(cfg.vocab_size / tp)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed[a:b]  # a view: the replicated embedding is the head

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            dist.all_reduce(x, group=self.group)
            return x
        y = x.float()
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h[-1:], self.final_norm, self.config.rms_norm_eps)
        local = F.linear(h, self.lm_head)[0].float()
        if local.numel() < self.vocab_chunk:
            local = F.pad(local, (0, self.vocab_chunk - local.numel()), value=float("-inf"))
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts)[: self.vocab]


def _build(spec: dict, tp: int, rank: int, group, device) -> Engine:
    """Load (or make random) this rank's shard of the weights, wrap it in an Engine."""
    if spec.get("path") is not None:
        cfg = ModelConfig.from_pretrained(spec["path"])
    else:
        cfg = ModelConfig.from_dict(spec["config"])
    local_config(cfg, tp)  # ConfigError before any weight is read
    dt = resolve_dtype(spec.get("dtype"), cfg)

    def mine(name: str, w: torch.Tensor) -> torch.Tensor:
        return shard_tensor(cfg, name, w, tp, rank)

    # each tensor sharded as it is read (or made): the device holds the rank's shard, never the model
    if spec.get("path") is not None and spec.get("load_format", "auto") != "dummy":
        shard, mtp = load_checkpoint(spec["path"], cfg, dt, device, progress=False, shard=mine)
    else:
        shard, mtp = random_weights(cfg, dt, device, spec.get("seed", 0), shard=mine), None
    model = TPModel(cfg, shard, spec["max_seq_len"], tp=tp, rank=rank, group=group, mtp=mtp)
    return Engine(cfg, model, spec["max_seq_len"])


# ---------------------------------------------------------------------------------------------
# the process group
# ---------------------------------------------------------------------------------------------


def _sizes(world: int) -> list[int]:
    """TP sizes a group of `world` ranks offers: its powers of two below world, and world."""
    out, n = [], 2
    while n < world:
        out.append(n)
        n *= 2
    return out + ([world] if world > 1 else [])


def _init(rank: int, world: int, port: int, backend: str, timeout: float) -> dict:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    # every rank creates the same subgroups in the same order: ranks [0, n) for each size n
    return {n: (None if n == world else dist.new_group(list(range(n)))) for n in _sizes(world)}


def _device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


class Group:
    """Rank 0's handle on `world` ranks: this process plus world-1 spawned followers.

    An engine of TP = n runs on ranks [0, n) (n a power of two below world, or world), so tests
    can run TP = 2 and TP = 4 on one group. Every wait is bounded: start-up by `start_timeout`,
    collectives by `timeout`, follower replies by `timeout`."""

    def __init__(self, world: int, *, device: str = "cpu", timeout: float = 60.0, start_timeout: float = 300.0,
                 threads: int = 1):
        if world < 2:
            raise ConfigError(f"a TP group needs at least 2 ranks, got {world}")
        if device.startswith("cuda") and device != "cuda":
            raise ConfigError(f"TP ranks use cuda:0..{world - 1}; give --device cuda, not {device!r}")
        if device == "cuda" and torch.cuda.device_count() < world:
            raise ConfigError(f"a TP group of {world} ranks runs rank r on cuda:r: it needs {world} CUDA devices, "
                              f"{torch.cuda.device_count()} visible")
        self.world, self.device, self.timeout = world, device, timeout
        self.backend = "nccl" if device == "cuda" else "gloo"
        port = free_port()
        ctx = mp.get_context("spawn")
        self.replies = ctx.Queue()
        self.queues = {r: ctx.Queue() for r in range(1, world)}
        # the graph path's lock step (gpu/tp.py Lockstep): [replays announced, end of the last run]
        self.words = ctx.RawArray("q", 2)
        self._lockstep = None
        self.procs = {r: ctx.Process(target=_follower_main, name=f"nexrt-tp-rank{r}", daemon=True,
                                     args=(r, world, port, self.backend, device, timeout, threads,
                                           self.queues[r], self.replies, self.words))
                      for r in range(1, world)}
        for p in self.procs.values():
            p.start()
        self.broken: str | None = None
        try:
            self.collect("up", range(1, world), start_timeout)
            self.subgroups = _init(0, world, port, self.backend, timeout)
        except BaseException:
            self._kill()
            raise

    def dead(self) -> list[int]:
        return [r for r, p in self.procs.items() if not p.is_alive()]

    def send(self, ranks, *cmd) -> None:
        if self.broken:
            raise EngineError(f"TP group is broken: {self.broken}")
        gone = [r for r in ranks if not self.procs[r].is_alive()]
        if gone:
            self.broken = f"rank(s) {gone} exited"
            raise EngineError(f"TP group is broken: {self.broken}")
        for r in ranks:
            self.queues[r].put(cmd)

    def collect(self, what: str, ranks, timeout: float | None = None) -> dict:
        """Wait for `what` from every rank in `ranks`; EngineError naming the rank on error/death/timeout.
        Returns each rank's answer."""
        timeout = self.timeout if timeout is None else timeout
        waiting, deadline, got = set(ranks), time.monotonic() + timeout, {}
        while waiting:
            try:
                kind, rank, info = self.replies.get(timeout=0.2)
            except queue.Empty:
                gone = [r for r in waiting if not self.procs[r].is_alive()]
                if gone:
                    raise EngineError(f"TP rank(s) {gone} exited before {what}") from None
                if time.monotonic() > deadline:
                    raise EngineError(f"TP rank(s) {sorted(waiting)}: no {what} within {timeout}s") from None
                continue
            if kind == "error":
                raise EngineError(f"TP rank {rank}: {info}")
            if kind == what:
                waiting.discard(rank)
                got[rank] = info
        return got

    def engine(self, tp: int, *, path: str | None = None, config: dict | None = None, dtype=None,
               max_seq_len: int = 4096, load_format: str = "auto", seed: int = 0) -> "TPEngine":
        """Load a model at TP = tp on ranks [0, tp): rank 0's engine, the followers' in lock step."""
        if tp not in self.subgroups:
            raise ConfigError(f"this group of {self.world} ranks runs TP in {sorted(self.subgroups)}, not {tp}")
        if (path is None) == (config is None):
            raise ConfigError("give a checkpoint path or a config, not both")
        spec = {"path": path, "config": config.to_dict() if isinstance(config, ModelConfig) else config,
                "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
                "max_seq_len": max_seq_len, "load_format": load_format, "seed": seed}
        followers = range(1, tp)
        group = self.subgroups[tp]
        cfg = ModelConfig.from_pretrained(path) if path is not None else ModelConfig.from_dict(spec["config"])
        local_config(cfg, tp)  # refuse before the followers start loading
        self.send(followers, "load", tp, spec)
        try:
            eng = _build(spec, tp, 0, group, _device(self.device, 0))
        except BaseException:
            try:  # let the followers finish loading, so the group stays in step
                self.collect("loaded", followers)
            except EngineError:
                pass
            raise
        self.collect("loaded", followers)
        return TPEngine(eng.config, eng.model, eng.max_seq_len, self, tp)

    def lockstep(self):
        """The group's one `gpu.tp.Lockstep` (its run numbers are the group's, whichever engine runs)."""
        if self._lockstep is None:
            from nexrt_vllm.engine.gpu.tp import Lockstep
            self._lockstep = Lockstep(self.words, self.send)
        return self._lockstep

    def close(self) -> None:
        for r, q in self.queues.items():
            if self.procs[r].is_alive():
                q.put(("stop",))
        for p in self.procs.values():
            p.join(10)
        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)


class TPEngine(Engine):
    """Rank 0 of a TP engine: the Engine API; every step is mirrored on ranks 1..tp-1."""

    def __init__(self, config: ModelConfig, model: TPModel, max_seq_len: int, group: Group, tp: int):
        super().__init__(config, model, max_seq_len)
        self.group, self.tp = group, tp
        self._followers = range(1, tp)

    def slot(self) -> Engine:
        raise NotBuiltError("more than one request per node (--max-batch > 1) with tensor parallelism is not built")

    def prefill(self, ids):
        ids = list(ids)
        self.group.send(self._followers, "prefill", ids)
        return super().prefill(ids)

    def decode_step(self, token: int):
        self.group.send(self._followers, "decode", token)
        return super().decode_step(token)

    def use_graph(self, mode: str = "fused", tuning=None, interpret: bool = False, collectives: str = "group") -> None:
        """`Engine.use_graph` at TP > 1 (gpu/tp.py): every rank builds its `TPDecoder` and captures the
        same step variants in the same order (their warm-up steps run the collectives); rank 0's
        `TPRunner` then serves `stream`, each replay announced to the followers. `interpret`: on CPU,
        a replay runs the step's launches through the Triton interpreter instead (tests).
        `collectives`: "group" (torch.distributed: NCCL on CUDA, gloo on CPU) or "peer" (one-shot
        kernels over peer-mapped buffers, gpu/tp.py `PeerCollectives`)."""
        if self.device.type != "cuda" and not interpret:
            raise EngineError(f"the graph path needs a CUDA device (engine is on {self.device})")
        if collectives not in ("group", "peer"):
            raise ConfigError(f"TP collectives are 'group' or 'peer', not {collectives!r}")
        from nexrt_vllm.engine.gpu.tp import PeerMemory, TPDecoder, TPRunner
        self.graph = None
        peers = self._share_peers() if collectives == "peer" else None
        try:
            self.group.send(self._followers, "graph", self.tp, mode, tuning, interpret, peers)
            try:
                mine = None if peers is None else dict(peers, parts=[self.peer_own, *peers["parts"][1:]])
                d = TPDecoder(self.model, self.state, _collectives(self.model, self.tp, 0, mine), mode, tuning)
            except BaseException:
                with contextlib.suppress(EngineError):  # the followers fail alike; let them answer, so the
                    self.group.collect("graphed", self._followers)  # group stays in step
                raise
            self.group.collect("graphed", self._followers)
        finally:
            for h in (peers or {}).get("handles", ()):
                PeerMemory.unlink(h)  # every rank has mapped the named buffers (CPU) by now, or failed
        runner = TPRunner(d, self.group.lockstep(), self._followers)
        variants = [v for v in runner.VARIANTS if runner.masks or not v[2]]
        self.group.send(self._followers, "capture", variants)
        for v in variants:
            runner.capture(*v)
        self.group.collect("captured", self._followers)
        self.graph = runner

    def _share_peers(self) -> dict:
        """Every rank's peer memory (gpu/tp.py `PeerMemory`): each allocates its own and answers a handle
        on it; the handles, rank 0's included, go to every rank with the graph command."""
        from nexrt_vllm.engine.gpu.tp import PeerMemory
        cfg = self.config
        half, programs = PeerMemory.capacity(max(cfg.hidden_size, math.ceil(cfg.vocab_size / self.tp)))
        self.group.send(self._followers, "peer", half, programs)
        self.peer_own = PeerMemory.allocate(self.tp, half, programs, self.device)
        got = self.group.collect("peer", self._followers)
        got[0] = tuple(PeerMemory.share(t) for t in self.peer_own)
        return {"half": half, "programs": programs, "parts": [got[r] for r in range(self.tp)],
                "handles": [h for r in range(self.tp) for h in got[r]]}

    def enable_speculative(self, method: str = "mtp", num_speculative_tokens: int = 3) -> None:
        raise NotBuiltError("speculative decoding (MTP) with tensor parallelism (--tp > 1) is not built")

    def import_state(self, seq_len, tensors):
        raise StateError("a TP engine takes its state as shards: import_shards(seq_len, shards), "
                         "shards from nexrt_vllm.node.reshard")

    def export_state(self):
        raise StateError("a TP engine gives its state as shards: export_shards()")

    def import_shards(self, seq_len: int, shards: list[dict[str, torch.Tensor]]) -> None:
        """Load rank r's state from shards[r] (native names, the local shapes; K/V with seq_len
        rows or more). Every shard is validated before any rank loads anything."""
        if len(shards) != self.tp:
            raise StateError(f"{len(shards)} shards for TP = {self.tp}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= self.max_seq_len:
            raise StateError(f"seq_len must be an int in [1, {self.max_seq_len}], got {seq_len!r}")
        want, rows = _wire_layout(self.state, seq_len)
        trimmed = []
        for r, shard in enumerate(shards):
            problems = [f"missing {sorted(set(want) - set(shard))}"] if set(want) - set(shard) else []
            if set(shard) - set(want):
                problems.append(f"unexpected {sorted(set(shard) - set(want))}")
            t = {}
            for name in sorted(set(want) & set(shard)):
                x, (shape, dt) = shard[name], want[name]
                if name in rows and isinstance(x, torch.Tensor) and x.dim() == 3:
                    x = x[:, :seq_len]
                if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != dt:
                    problems.append(f"{name}: {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                                    f" {getattr(x, 'dtype', '')}, expected {shape} {dt}")
                t[name] = x
            if problems:
                raise StateError(f"shard {r} does not match rank {r}'s state: " + "; ".join(problems))
            trimmed.append(t)
        self.group.send(self._followers, "state", seq_len)
        for r in self._followers:
            for name in sorted(want):
                dist.send(trimmed[r][name].contiguous().to(self.device), dst=r)
        super().import_state(seq_len, trimmed[0])

    def export_shards(self) -> tuple[int, list[dict[str, torch.Tensor]]]:
        """(seq_len, every rank's state copy, K/V trimmed to seq_len rows)."""
        n, own = super().export_state()
        self.group.send(self._followers, "export")
        want, _ = _wire_layout(self.state, n)
        shards = [own]
        for r in self._followers:
            got = {}
            for name in sorted(want):
                shape, dt = want[name]
                got[name] = torch.empty(shape, dtype=dt, device=self.device)
                dist.recv(got[name], src=r)
            shards.append(got)
        return n, shards


def _wire_layout(state, seq_len: int) -> tuple[dict, set]:
    """(hand-off name -> (shape, dtype) with the per-token tensors (K/V) trimmed to seq_len rows,
    the names of those per-token tensors)."""
    out, rows = {}, set()
    for i, layer in enumerate(state.layers):
        for (name, t), part in zip(layer.named(i).items(), layer.parts()):
            if part in layer.ROWS:
                rows.add(name)
                out[name] = ((t.shape[0], seq_len, *t.shape[2:]), t.dtype)
            else:
                out[name] = (tuple(t.shape), t.dtype)
    return out, rows


# ---------------------------------------------------------------------------------------------
# follower ranks
# ---------------------------------------------------------------------------------------------


def _follower_main(rank, world, port, backend, device, timeout, threads, commands, replies, words) -> None:
    torch.set_num_threads(threads)
    logging.basicConfig(level=os.environ.get("NEXRT_TP_LOG", "WARNING"),
                        format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    parent = mp.parent_process()
    dev = _device(device, rank)
    try:
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)  # before NCCL sees this rank
        replies.put(("up", rank, None))
        subgroups = _init(rank, world, port, backend, timeout)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails its start with it
        replies.put(("error", rank, f"{type(e).__name__}: {e}"))
        return
    engine = runner = peer_own = None
    while True:
        try:
            cmd = commands.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # rank 0 is gone: nobody will drive this rank again
            continue
        op = cmd[0]
        if op == "stop":
            return
        try:
            if op == "load":
                _, tp, spec = cmd
                engine = runner = None
                engine = _build(spec, tp, rank, subgroups[tp], dev)
                replies.put(("loaded", rank, None))
            elif op == "peer":
                from nexrt_vllm.engine.gpu.tp import PeerMemory
                peer_own = PeerMemory.allocate(engine.model.tp, cmd[1], cmd[2], dev)
                replies.put(("peer", rank, tuple(PeerMemory.share(t) for t in peer_own)))
            elif op == "graph":
                _, tp, mode, tuning, interpret, peers = cmd
                runner = None
                if peers is not None:
                    peers["parts"][rank] = peer_own  # (its own memory, not a mapping of it)
                runner = _follower_graph(engine, tp, rank, subgroups[tp], mode, tuning, interpret, peers)
                replies.put(("graphed", rank, None))
            elif op == "capture":
                for v in cmd[1]:
                    runner.capture(*v)
                replies.put(("captured", rank, None))
            elif op == "run":
                runner.follow(words, *cmd[1:], alive=lambda: parent is None or parent.is_alive())
            elif op == "prefill":
                engine.prefill(cmd[1])
            elif op == "decode":
                engine.decode_step(cmd[1])
            elif op == "state":
                seq_len = cmd[1]
                tensors = {}
                for name, (shape, dt) in sorted(_wire_layout(engine.state, seq_len)[0].items()):
                    tensors[name] = torch.empty(shape, dtype=dt, device=dev)
                    dist.recv(tensors[name], src=0)
                engine.import_state(seq_len, tensors)
            elif op == "export":
                n, tensors = engine.export_state()
                for name in sorted(tensors):
                    dist.send(tensors[name].contiguous(), dst=0)
            else:
                raise EngineError(f"unknown TP command {op!r}")
        except Exception as e:  # noqa: BLE001 - rank 0 runs the same code and raises the same error
            if op in ("load", "graph", "capture"):
                replies.put(("error", rank, f"{type(e).__name__}: {e}"))
            log.warning("rank %d: %s failed: %s", rank, op, traceback.format_exc(limit=3))


def _follower_graph(engine, tp, rank, group, mode, tuning, interpret, peers):
    """A follower's `gpu.tp.Follower` over its engine's shard (the kernels interpreted on CPU if asked)."""
    if interpret:
        from nexrt_vllm.engine import kernels
        kernels.load(interpret=True)
    from nexrt_vllm.engine.gpu.tp import Follower, TPDecoder
    return Follower(TPDecoder(engine.model, engine.state, _collectives(engine.model, tp, rank, peers), mode, tuning))


def _collectives(model, tp: int, rank: int, peers):
    """Rank `rank`'s collectives: the process group's, or over `peers` (`TPEngine._share_peers`; each part
    a handle, or the rank's own (buffer, signals))."""
    from nexrt_vllm.engine.gpu.tp import Collectives, PeerCollectives, PeerMemory
    if peers is None:
        return Collectives(tp, rank, model.group)
    parts = [p if isinstance(p[0], torch.Tensor) else tuple(PeerMemory.open(h) for h in p) for p in peers["parts"]]
    mem = PeerMemory(rank, [b for b, _ in parts], [g for _, g in parts], peers["half"], peers["programs"])
    return PeerCollectives(tp, rank, mem)
