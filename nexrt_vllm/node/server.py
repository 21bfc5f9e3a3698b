"""`nexrt-decode`: the NexRT decode node service.

    nexrt-decode --model PATH [--host 127.0.0.1] [--port 8200] [--transport mooncake|nixl]
                 [--device cpu|cuda] [--max-seq-len N] [--recv-memory host|pinned|device] ...

Loads the engine, allocates and registers the receive buffers once, then serves

* the control endpoint (ZMQ ROUTER, msgpack; ``nexrt_vllm.handoff.protocol``) for hello/begin/done/abort;
* HTTP (docs/ARCHITECTURE.md §2): ``POST /v1/admit``, ``POST /v1/generate`` (NDJSON stream),
  ``POST /v1/cancel``, ``GET /health``, ``GET /capabilities`` (which advertises the control
  address and the transport, so peers need only the node's HTTP URL), ``GET /metrics``.

HTTP and ZMQ bind ``--host`` (default loopback). The Mooncake TCP transport listens on all
interfaces regardless (a property of Mooncake); NIXL/UCX follows ``UCX_NET_DEVICES``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict

import zmq
import zmq.asyncio
from aiohttp import web

from nexrt_vllm.engine.spec.draft_vocab import describe_draft_vocab
from nexrt_vllm.engine.spec.mtp import DRAFT_WEIGHTS
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.contracts import (AdmitReply, AdmitRequest, CancelRequest, ContractError, GenerateRequest,
                                          Refusal)
from nexrt_vllm.handoff.layout import LAYOUT_VERSION, LAYOUT_VERSIONS, model_identity
from nexrt_vllm.handoff.structured import LOGPROBS_MAX, STRUCTURED_TYPES
from nexrt_vllm.handoff.transport import TRANSPORTS
from nexrt_vllm.node import faults as F
from nexrt_vllm.node.service import DecodeNode, Options

log = logging.getLogger("nexrt.decode")

MAX_BATCH = 8
ROUND_ROWS = 32  # verify rows of the batched speculative round (kernels/batch_round.py MAX_ROWS)


def _error(e: Refusal) -> web.Response:
    headers = {"Retry-After": "1"} if e.status == 409 else None  # 409s are transient
    return web.json_response(e.to_wire(), status=e.status, headers=headers)


async def _body(request: web.Request, contract):
    """The request body decoded by its contract; a malformed one is a bad_message refusal."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refusal(P.Reason.BAD_MESSAGE, "body must be JSON") from None
    try:
        return contract.from_wire(body)
    except ContractError as e:
        raise Refusal(P.Reason.BAD_MESSAGE, str(e)) from None


class Endpoints:
    """The node's HTTP handlers and its ZMQ control loop, over one DecodeNode."""

    def __init__(self, node: DecodeNode, args):
        self.node, self.args = node, args

    # ---- HTTP -------------------------------------------------------------------------------------
    async def admit(self, request: web.Request) -> web.Response:
        try:
            adm = self.node.admit(await _body(request, AdmitRequest))
        except Refusal as e:
            return _error(e)
        return web.json_response(AdmitReply(adm.rid, adm.generation, self.node.control_addr,
                                            self.node.opts.admit_timeout).to_wire())

    async def generate(self, request: web.Request) -> web.StreamResponse:
        from nexrt_vllm.engine import SamplingParams, SamplingParamsError

        try:
            req: GenerateRequest = await _body(request, GenerateRequest)
            try:
                sp = SamplingParams(max_tokens=req.max_tokens, logprobs=req.logprobs, **asdict(req.sampling))
            except SamplingParamsError as e:
                raise Refusal(P.Reason.BAD_MESSAGE, str(e)) from None
            # before the claim: a grammar that does not compile leaves the admission as it was
            constraint = await self.node.constraint(req.rid, req.structured, req.first_token, sp.stop_token_ids)
            adm = self.node.claim(req)
        except Refusal as e:
            return _error(e)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            stall = self.node.opts.faults.stall_first_token_s
            async with contextlib.aclosing(self.node.generate(adm, sp, req.first_token, constraint)) as lines:
                async for line in lines:
                    if stall and "token" in line:
                        await asyncio.sleep(stall)  # test fault: a slow first token
                        stall = 0.0
                    # a client that stops reading counts as gone (its socket buffer fills up)
                    await asyncio.wait_for(resp.write(json.dumps(line).encode() + b"\n"), self.args.write_timeout)
        except asyncio.TimeoutError:
            log.info("client of rid=%s stopped reading for %ss", adm.rid, self.args.write_timeout)
            resp.force_close()
        except (ConnectionResetError, asyncio.CancelledError):
            # client vanished: leaving the `async with` cancels the decode and frees the slot
            log.info("client of rid=%s went away", adm.rid)
            raise
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(self.node.cancel((await _body(request, CancelRequest)).rid).to_wire())
        except Refusal as e:
            return _error(e)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(self.node.health())

    async def capabilities(self, request: web.Request) -> web.Response:
        cfg, peer = self.node.cfg, self.node.transport.peer_info()
        return web.json_response({
            "model": self.node.model_name, **model_identity(cfg),
            "eos_token_ids": list(cfg.eos_token_ids), "max_seq_len": self.node.opts.max_seq_len,
            "max_batch": self.node.opts.max_batch, "protocol_version": P.PROTOCOL_VERSION,
            "protocol_versions": list(P.PROTOCOL_VERSIONS),
            "layout_version": LAYOUT_VERSION, "context_cache_bytes": self.node.context.cache.capacity,
            "control_addr": self.node.control_addr,
            "transport": {"backend": peer["backend"], "recv_memory": self.args.recv_memory,
                          "recv_buffers": len(self.node.buffers), "recv_buffer_bytes": self.node.buffers[0].size,
                          **({"target": peer["target"]} if "target" in peer else {})},
            "sampling": {"temperature": True, "top_p": True, "top_k": True, "seed": True, "ignore_eos": True,
                         "stop_token_ids": True, "logprobs": True, "max_logprobs": LOGPROBS_MAX,
                         "logprobs_mode": "raw_logprobs", "penalties": False},
            "structured_output": self._structured_caps(),
            "device": self.args.device, "graph": self.args.graph, "load_format": self.args.load_format,
            # the --tuning overrides the graph path runs with (none off it)
            "tuning": self.args.tuning_overrides if self.args.graph != "off" else {},
            "dtype": str(self.node.engine.dtype).removeprefix("torch."),
            "weight_format": self.node.engine.weight_format,
            "layout_versions": list(LAYOUT_VERSIONS), "handoff_parts": True, "tp": self._tp(),
            "speculative": self._speculative(),
        })

    def _speculative(self) -> dict | None:
        spec = self.node.engine.speculative
        if spec is None:
            return None
        return {"method": self.args.speculative, "num_speculative_tokens": spec.num_speculative_tokens,
                "draft_weights": self.args.draft_weights,
                "synthetic_acceptance": spec.synthetic.describe() if spec.synthetic is not None else None,
                "draft_vocab": describe_draft_vocab(self.node.engine.draft_vocab, self.node.cfg.vocab_size)}

    def _structured_caps(self) -> dict:
        if self.node.grammars is None:
            return {"types": [], "reason": self.node.grammars_missing}
        from importlib.metadata import version
        return {"types": list(STRUCTURED_TYPES), "backend": "xgrammar", "backend_version": version("xgrammar"),
                "json_schema_whitespace": "any", "on_graph": self._masks_on_graph()}

    def _masks_on_graph(self) -> bool:
        """Whether grammar-constrained requests decode on the captured graph: not on the batch step's
        node (their slot engine's eager loop), not where the masks cannot be host-mapped."""
        eng = self.node.engine
        if eng.batch_graph is not None:
            return False
        return eng.graph is None or eng.graph.masks

    def _tp(self) -> dict:
        """The node group: its size, backend and the heads each rank holds (docs/NODE.md)."""
        from nexrt_vllm.node.reshard import node_shards

        eng, group = self.node.engine, getattr(self.node.engine, "group", None)
        size = getattr(eng, "tp", 1)
        dev = self.args.device
        coll = getattr(getattr(getattr(eng, "graph", None), "d", None), "coll", None)
        return {"size": size, "backend": group.backend if group else None,
                "collectives": getattr(coll, "kind", None),
                "ranks": [{"rank": r, "device": f"cuda:{r}" if dev.startswith("cuda") and size > 1 else dev,
                           "shard": sh.to_wire()} for r, sh in enumerate(node_shards(self.node.cfg, size))]}

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.node.metrics.render(), content_type="text/plain", charset="utf-8")

    # ---- control endpoint ----------------------------------------------------------------------------
    async def control_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) < 2:
                continue  # not a REQ/DEALER envelope; nothing to answer to
            ident, data = frames[:-1], frames[-1]
            try:
                reply = self.node.handle(data)
            except Exception as e:  # noqa: BLE001 - a handler bug must not kill the control endpoint
                log.exception("control message failed")
                reply = P.encode(P.Refuse(P.Reason.BAD_MESSAGE.value, f"node error: {type(e).__name__}: {e}"),
                                 P.reply_version(data))
            await sock.send_multipart([*ident, reply])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser("nexrt-decode", description="NexRT decode node")
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    ap.add_argument("--host", default="127.0.0.1", help="address for HTTP and the control endpoint")
    ap.add_argument("--port", type=int, default=8200, help="HTTP port (0 = pick a free one)")
    ap.add_argument("--control-port", type=int, default=0, help="ZMQ control port (0 = pick a free one)")
    ap.add_argument("--transport", choices=TRANSPORTS, default="mooncake")
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: the checkpoint's)")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: random weights from config.json alone (speed runs only, like vLLM's "
                         "--load-format dummy; tokens are meaningless)")
    ap.add_argument("--fp8-weights", choices=("auto", "keep", "dequantize"), default="auto",
                    help="FP8 checkpoints: keep the projections e4m3 + block scales (the fused kernels read them; "
                         "docs/GPU.md) or dequantize them at load; auto = keep on CUDA with bfloat16")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks, one process each (rank r on cuda:r with --device cuda, which needs "
                         "N visible GPUs): rank 0 serves HTTP and the control endpoint, the others follow it; on "
                         "CUDA every rank captures its own graph step (docs/GPU.md)")
    ap.add_argument("--tp-collectives", choices=("group", "peer"), default="group",
                    help="the graph step's collectives at --tp > 1: group = torch.distributed (NCCL on CUDA), "
                         "peer = one-shot kernels over peer-mapped buffers (one launch each; docs/GPU.md)")
    ap.add_argument("--graph", choices=("auto", "fused", "eager", "off"), default="auto",
                    help="GPU decode path (docs/GPU.md): one CUDA graph per token, captured at start-up; "
                         "fused = Triton kernels, eager = the eager ops in the graph, off = eager loop; "
                         "auto = fused on CUDA with bfloat16, off otherwise")
    ap.add_argument("--speculative", choices=("off", "mtp"), default="off",
                    help="mtp: speculative decoding with the checkpoint's MTP head (exact: the same greedy "
                         "tokens, the same sampling distribution; docs/NODE.md); on the CUDA graph path "
                         "(--graph fused) greedy requests run one captured round per verify")
    ap.add_argument("--num-speculative-tokens", type=int, default=3,
                    help="tokens the MTP head drafts per round (verify width = this + 1)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="graph path: the MTP head drafts from the first N token ids only (its lm_head reads "
                         "N rows instead of the whole vocabulary; output is exact either way, acceptance may "
                         "drop); default: the whole vocabulary")
    ap.add_argument("--draft-token-map", default=None, metavar="FILE",
                    help="graph path: the MTP head drafts from the token ids of this map (JSON {\"token_ids\": "
                         "[...]}, e.g. the most frequent ids of text like the traffic: `nexrt-vllm draft-token-map`); "
                         "exact output, acceptance depends on the map's coverage; not with --draft-vocab")
    ap.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default="checkpoint",
                    help="the MTP head's format: checkpoint = as stored; fp8 = its projections and a copy of the "
                         "lm_head quantized to block-scaled e4m3 at load (as the published FP8 releases store "
                         "the head), so a draft reads about half the bytes; exact output either way, acceptance "
                         "may move")
    ap.add_argument("--speculative-synthetic-acceptance", type=float, default=None, metavar="L",
                    help="benchmarks only: pin the mean tokens per round to L with vLLM's synthetic schedule "
                         "(accepted drafts are emitted as drafted, so output is no longer the model's own; e.g. "
                         "InferenceX's 3.39 for Qwen3.5 MTP at 3 drafts); off by default")
    ap.add_argument("--speculative-synthetic-rates", default=None, metavar="R1,R2,...",
                    help="benchmarks only: the same with explicit unconditional per-position rates (one per draft, "
                         "non-increasing, each in [0, 1])")
    ap.add_argument("--speculative-synthetic-seed", type=int, default=0,
                    help="seed of the synthetic acceptance draws")
    ap.add_argument("--recv-memory", choices=("host", "pinned", "device"), default=None,
                    help="receive buffer memory (default: host on CPU, pinned on CUDA)")
    ap.add_argument("--max-batch", type=int, default=1,
                    help="requests decoded together (1-8): each admitted request has its own slot (state, "
                         "sampling, stops); they join and leave between steps. > 1 with --tp 1. On the CUDA graph "
                         "path (--graph fused or auto) greedy requests without logprobs or grammar run the captured "
                         "batch step (with --speculative: the batched round, max-batch x (drafts + 1) <= 32 rows), "
                         "the others their slot's eager step or round; on CPU or --graph off every slot runs its "
                         "own eager steps or rounds")
    ap.add_argument("--tuning", default="", metavar="FIELD=VALUE,...",
                    help="CUDA graph path: launch-shape overrides of the fused kernels (gpu/tuning.py Tuning fields, "
                         "as decode_bench.py --tuning takes them, e.g. gemv_rows=4096/16/256/1/5/2+10000/32/256/2/3+"
                         "4611686018427387904/32/256/2/3), for a GPU whose own sweep found faster shapes; default: "
                         "the shipped defaults (docs/GPU.md)")
    ap.add_argument("--recv-buffers", type=int, default=None,
                    help="receive buffers (default: max-batch + 1, so a stale writer's buffer can be "
                         "quarantined without blocking)")
    ap.add_argument("--recv-buffer-mib", type=float, default=None,
                    help="bytes per receive buffer (default: the state of max-seq-len tokens, fp32 recurrent)")
    ap.add_argument("--admit-timeout", type=float, default=30.0, help="seconds from admit to begin")
    ap.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds from begin to done")
    ap.add_argument("--start-timeout", type=float, default=30.0, help="seconds from done to generate")
    ap.add_argument("--write-timeout", type=float, default=10.0,
                    help="seconds a stream write may block before the client counts as gone")
    ap.add_argument("--context-cache-gib", type=float, default=0.0,
                    help="keep finished requests' attention rows (on --device) for their conversation's next turn, "
                         "up to this many GiB; that turn's hand-off ships only the rows the node lacks "
                         "(docs/NODE.md, \"Context cache\"); 0 = off")
    ap.add_argument("--quarantine", type=float, default=30.0,
                    help="seconds a buffer stays unused after its writer was cut off mid-transfer")
    ap.add_argument("--tokenizer", default=None,
                    help="Hugging Face tokenizer directory for structured output (default: --model); the "
                         "grammar masks are built from it with xgrammar, as vLLM builds them")
    ap.add_argument("--no-structured", action="store_true", help="refuse structured-output requests")
    ap.add_argument("--ready-file", default=None, help="write the bound HTTP URL here once serving")
    ap.add_argument("--log-level", default="INFO")
    return ap


def _synthetic(ap, args):
    """The pinned acceptance schedule the flags ask for (engine.spec.synthetic), or None."""
    length, rates = args.speculative_synthetic_acceptance, args.speculative_synthetic_rates
    if length is None and rates is None:
        return None
    if args.speculative == "off":
        ap.error("--speculative-synthetic-acceptance / --speculative-synthetic-rates need --speculative mtp")
    if length is not None and rates is not None:
        ap.error("give --speculative-synthetic-acceptance or --speculative-synthetic-rates, not both")
    from nexrt_vllm.engine.spec.synthetic import SyntheticAcceptance, SyntheticAcceptanceError, check_rates, \
        rates_for_length
    n = args.num_speculative_tokens
    try:
        r = rates_for_length(length, n) if length is not None else check_rates(rates.split(","), n)
    except SyntheticAcceptanceError as e:
        ap.error(f"--speculative-synthetic-{'acceptance' if length is not None else 'rates'}: {e}")
    return SyntheticAcceptance(r, args.speculative_synthetic_seed)


def _positive(ap, args) -> None:
    if args.recv_buffers is None:
        args.recv_buffers = args.max_batch + 1
    if not 1 <= args.max_batch <= MAX_BATCH:
        ap.error(f"--max-batch must be in [1, {MAX_BATCH}], got {args.max_batch}")
    if args.max_batch > 1:
        if args.graph == "eager":
            ap.error(f"--max-batch {args.max_batch} on the CUDA graph path runs the fused batch step (--graph fused "
                     f"or auto), not --graph eager")
        # the batched round graph verifies every slot's M positions as rows of one launch (at most 32)
        rows = args.max_batch * (args.num_speculative_tokens + 1)
        if args.speculative != "off" and rows > ROUND_ROWS and (
                args.graph == "fused" or (args.graph == "auto" and args.device.startswith("cuda"))):
            ap.error(f"--speculative {args.speculative} with --max-batch {args.max_batch} on the CUDA graph path "
                     f"verifies --max-batch x (--num-speculative-tokens + 1) = {rows} rows per round, at most "
                     f"{ROUND_ROWS}: lower either (or --graph off: each slot's eager round)")
        if args.tp > 1:
            ap.error("--max-batch > 1 with --tp > 1 is not built")
    from nexrt_vllm.engine.gpu.tuning import tuning_overrides
    try:
        tuning, args.tuning_overrides = tuning_overrides(args.tuning)
    except ValueError as e:
        ap.error(f"--tuning: {e}")
    args.launch_tuning = tuning if args.tuning else None  # what the graph path is built with (None: defaults)
    for name in ("max_seq_len", "recv_buffers", "tp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.graph in ("fused", "eager") and not args.device.startswith("cuda"):
        ap.error(f"--graph {args.graph} needs --device cuda")
    if args.speculative != "off":
        if args.tp > 1:
            ap.error(f"--speculative {args.speculative} with --tp > 1 is not built (tensor-parallel ranks run "
                     f"the one-token step)")
        if args.graph == "eager":
            ap.error(f"--speculative {args.speculative} on the CUDA graph path runs the fused kernels "
                     f"(--graph fused or auto), not --graph eager")
        if not 1 <= args.num_speculative_tokens <= 15:
            ap.error("--num-speculative-tokens must be in [1, 15]")
        if args.draft_vocab is not None and args.draft_token_map is not None:
            ap.error("give --draft-vocab or --draft-token-map, not both")
    elif args.draft_vocab is not None or args.draft_token_map is not None:
        ap.error("--draft-vocab / --draft-token-map need --speculative mtp")
    elif args.draft_weights != "checkpoint":
        ap.error("--draft-weights needs --speculative mtp")
    args.synthetic = _synthetic(ap, args)
    if args.tp > 1 and args.device not in ("cpu", "cuda"):
        ap.error(f"--tp > 1 places rank r on cuda:r: give --device cuda or cpu, not {args.device!r}")
    if args.tp > 1 and args.device == "cuda":
        import torch
        if torch.cuda.device_count() < args.tp:
            ap.error(f"--tp {args.tp} --device cuda runs rank r on cuda:r: it needs {args.tp} CUDA devices, "
                     f"{torch.cuda.device_count()} visible")
    for name in ("admit_timeout", "transfer_timeout", "start_timeout", "write_timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.context_cache_gib < 0:
        ap.error("--context-cache-gib must be >= 0")
    if args.tp_collectives != "group" and (args.tp == 1 or args.graph == "off" or args.device != "cuda"):
        ap.error("--tp-collectives chooses the CUDA graph step's collectives at --tp > 1: it needs --tp > 1, "
                 "--device cuda and the graph path")
    if args.context_cache_gib and args.tp > 1:
        ap.error("--context-cache-gib with --tp > 1 is not built (the cache keeps one device's rows)")


def _draft_vocab(args):
    """The MTP head's draft vocabulary the flags give (engine/spec/draft_vocab.py): None, the first N
    ids, or the ids of the --draft-token-map file, read and checked against the checkpoint's
    vocabulary before the weights load (a ValueError naming the file otherwise)."""
    if args.draft_token_map is None:
        return args.draft_vocab
    from nexrt_vllm.engine import ConfigError
    from nexrt_vllm.engine.config import ModelConfig
    from nexrt_vllm.engine.spec.draft_vocab import check_draft_vocab
    from nexrt_vllm.node.draft_token_map import TokenMapError, read_token_map
    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    try:
        ids = read_token_map(args.draft_token_map)
        check_draft_vocab(ids, vocab)
    except (TokenMapError, ConfigError) as e:
        raise ValueError(f"--draft-token-map {args.draft_token_map}: {e}") from None
    return ids


def _grammars(args, cfg):
    """(engine.structured.Grammars, None) for the checkpoint's tokenizer, or (None, why not)."""
    if args.no_structured:
        return None, "structured output is disabled on this node (--no-structured)"
    path = args.tokenizer or args.model
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None, f"structured output needs the model's tokenizer: none in {path} (start the node with --tokenizer)"
    try:
        from nexrt_vllm.engine.structured import Grammars
        t0 = time.monotonic()
        g = Grammars(path, cfg.vocab_size)
    except ImportError as e:
        return None, f"structured output needs xgrammar and transformers ({e})"
    log.info("structured output: xgrammar over the tokenizer in %s (%.1fs)", path, time.monotonic() - t0)
    return g, ""


async def serve(args) -> None:
    import torch
    from prometheus_client import disable_created_metrics

    from nexrt_vllm.engine import Engine
    from nexrt_vllm.handoff.transport import make_receiver
    from nexrt_vllm.node.buffers import allocate
    from nexrt_vllm.node.context_cache import ContextCache, NodeContext
    from nexrt_vllm.node.convert import native_bytes
    from nexrt_vllm.node.metrics import NodeMetrics

    disable_created_metrics()
    torch.set_num_threads(int(os.environ.get("NEXRT_THREADS", torch.get_num_threads())))
    memory = args.recv_memory = args.recv_memory or ("pinned" if args.device.startswith("cuda") else "host")
    draft_vocab = _draft_vocab(args)
    t0 = time.monotonic()
    group = None
    if args.tp > 1:
        from nexrt_vllm.engine.tp import Group
        log.info("starting %d tensor-parallel ranks", args.tp)
        from nexrt_vllm.engine import EngineError
        try:
            # on CUDA the first graph capture compiles the Triton kernels on every rank between collectives
            group = Group(args.tp, device=args.device, threads=torch.get_num_threads(),
                          timeout=600.0 if args.device == "cuda" else 60.0)
        except EngineError as e:
            raise RuntimeError(f"--tp {args.tp}: {e}") from None
        try:
            engine = group.engine(args.tp, path=args.model, dtype=args.dtype, max_seq_len=args.max_seq_len,
                                  load_format=args.load_format)
        except BaseException as e:
            group.close()
            if isinstance(e, EngineError) and not isinstance(e, ValueError):
                raise RuntimeError(f"--tp {args.tp}: {e}") from None
            raise
    elif args.load_format == "dummy":
        from nexrt_vllm.engine.config import ModelConfig
        engine = Engine.from_config(ModelConfig.from_pretrained(args.model), device=args.device, dtype=args.dtype,
                                    max_seq_len=args.max_seq_len)
    else:
        engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                        max_seq_len=args.max_seq_len, fp8_weights=args.fp8_weights)
    cfg = engine.config
    log.info("weights loaded (%s, %s) in %.1fs", args.load_format, engine.weight_format, time.monotonic() - t0)
    # GPU graph path: compiled and captured once here, before the node serves (not per request).
    if args.graph == "auto":
        args.graph = "fused" if engine.device.type == "cuda" and engine.dtype == torch.bfloat16 else "off"
    if args.speculative != "off":
        from nexrt_vllm.engine import EngineError
        try:
            engine.enable_speculative(args.speculative, args.num_speculative_tokens, draft_vocab,
                                      synthetic=args.synthetic, draft_weights=args.draft_weights)
        except EngineError as e:
            raise ValueError(f"--speculative {args.speculative}: {e}") from None
        dv = describe_draft_vocab(draft_vocab, cfg.vocab_size)
        log.info("speculative decoding: %s, %d draft tokens per round, draft weights: %s, draft vocabulary: "
                 "%s %d ids%s", args.speculative, args.num_speculative_tokens, args.draft_weights, dv["kind"],
                 dv["size"],
                 "" if args.graph != "off" or draft_vocab is None
                 else " (the CUDA graph path's round reads it; this node runs the eager round, which drafts "
                      "from every id)")
        if args.synthetic is not None:
            log.warning("synthetic acceptance (benchmark mode): %s - output is not the model's own",
                        args.synthetic.describe())
    if args.tuning and args.graph == "off":
        log.warning("--tuning %s: launch shapes of the CUDA graph path; this node runs --graph off: not used",
                    args.tuning)
    if args.graph != "off":
        from nexrt_vllm.engine import EngineError
        log.info("compiling kernels and capturing the %s decode graph (greedy + sampling; the first start "
                 "on a machine compiles the Triton kernels, about a minute)", args.graph)
        t0 = time.monotonic()
        try:
            if args.launch_tuning is not None:
                log.info("launch shapes: the defaults with %s", args.tuning_overrides)
            if args.max_batch > 1:
                engine.use_batch_graph(args.max_batch, args.launch_tuning)
            elif args.tp > 1:
                engine.use_graph(args.graph, args.launch_tuning, collectives=args.tp_collectives)
            else:
                engine.use_graph(args.graph, args.launch_tuning)
        except EngineError as e:
            raise ValueError(f"--graph {args.graph}: {e}") from None
        graph = engine.batch_graph or engine.graph
        log.info("graph path %s captured in %.1fs (%s, control ring %s)", args.graph, time.monotonic() - t0,
                 f"batch step over {args.max_batch} slots" if engine.batch_graph else "one request",
                 getattr(graph.d, "b", graph.d).control)  # a batched round's control: its batch decoder's
    _warm_engine(engine)
    if args.recv_buffer_mib:
        size = int(args.recv_buffer_mib * (1 << 20))
    else:
        elem = engine.state.dtype.itemsize
        # one spare block of 2048 tokens absorbs the sender's rounding up to whole pages
        size = native_bytes(cfg, args.max_seq_len + 2048, kv_bytes=elem, conv_bytes=elem)
    transport = make_receiver(args.transport, args.host)
    buffers = allocate(transport, args.recv_buffers, size, memory, args.device)

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if args.control_port:
        sock.bind(f"tcp://{args.host}:{args.control_port}")
        cport = args.control_port
    else:
        cport = sock.bind_to_random_port(f"tcp://{args.host}")
    faults = F.from_env()
    if faults:
        log.warning("TEST FAULTS ACTIVE (%s=%s): %s", F.ENV, os.environ.get(F.ENV), faults)
    opts = Options(max_seq_len=args.max_seq_len, admit_timeout=args.admit_timeout,
                   transfer_timeout=args.transfer_timeout, start_timeout=args.start_timeout,
                   quarantine_s=args.quarantine, max_batch=args.max_batch, faults=faults)
    grammars, missing = _grammars(args, cfg)
    metrics = NodeMetrics()
    context = NodeContext(ContextCache(int(args.context_cache_gib * (1 << 30)), metrics))
    node = DecodeNode(engine, cfg, transport, buffers, opts, device=args.device,
                      control_addr=f"tcp://{args.host}:{cport}",
                      model_name=os.path.basename(os.path.abspath(args.model)),
                      metrics=metrics, grammars=grammars, grammars_missing=missing, context=context)
    node.metrics.graph.labels(mode=args.graph, device=args.device).set(1)
    if engine.speculative is not None:
        node.metrics.speculative(args.speculative, args.num_speculative_tokens,
                                 args.synthetic.length if args.synthetic is not None else None)
        for e in node.engines:  # every slot's rounds
            e.speculative.on_round = node.metrics.acceptance_length.observe
    svc = Endpoints(node, args)
    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/v1/admit", svc.admit)
    app.router.add_post("/v1/generate", svc.generate)
    app.router.add_post("/v1/cancel", svc.cancel)
    app.router.add_get("/health", svc.health)
    app.router.add_get("/capabilities", svc.capabilities)
    app.router.add_get("/metrics", svc.metrics)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    url = f"http://{args.host}:{port}"
    stop = asyncio.Event()
    tasks = [asyncio.create_task(svc.control_loop(sock)), asyncio.create_task(node.reaper())]
    if group is not None:
        tasks.append(asyncio.create_task(_watch(group, stop)))
    log.info("nexrt-decode serving %s on %s (control %s, transport %s, %d slot(s), %d x %.1f MiB %s buffers)",
             node.model_name, url, node.control_addr, args.transport, args.max_batch, len(buffers),
             size / (1 << 20), memory)
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"url": url, "control_addr": node.control_addr, "pid": os.getpid()}, f)
        os.replace(tmp, args.ready_file)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await runner.cleanup()
        sock.close(linger=0)
        ctx.term()
        node.close()
        transport.close()
        if group is not None:
            group.close()
    if group is not None and group.broken:
        raise RuntimeError(f"tensor-parallel group failed: {group.broken}")


def _warm_engine(engine) -> None:
    """A short greedy and a short sampled decode before the node serves, so that the first request
    does not pay the engine's first-call costs (allocations, kernel selection, lazy initialisation).
    Every hand-off imports its own state over what this leaves behind. The transport's connection to
    vLLM's sender is warmed by the router's probe hand-off (router/README.md, "Warm-up")."""
    from nexrt_vllm.engine import EngineError, SamplingParams

    t0 = time.monotonic()
    try:
        for sp in (SamplingParams(max_tokens=3, ignore_eos=True),
                   SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=0)):
            engine.prefill([0])
            for _ in engine.steps(0, sp):
                pass
        if engine.batch_graph is not None:  # the batch step's host loop, slot 0 alone
            engine.prefill([0])
            for _ in engine.batch_graph.generate(0, 0, SamplingParams(max_tokens=3, ignore_eos=True)):
                pass
    except (EngineError, RuntimeError) as e:
        log.warning("engine warm-up failed (the first request pays its first-call costs): %s", e)
        return
    log.info("engine warmed in %.2fs", time.monotonic() - t0)


async def _watch(group, stop: asyncio.Event) -> None:
    """A follower rank that dies leaves the group unusable: stop serving (exit status 1)."""
    while not stop.is_set():
        await asyncio.sleep(0.5)
        dead = group.dead()
        if dead:
            group.broken = f"rank(s) {dead} exited"
            log.error("tensor-parallel %s; stopping", group.broken)
            stop.set()


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _positive(ap, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(args))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"nexrt-decode: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
