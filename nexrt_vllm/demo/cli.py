"""`nexrt-vllm`: project command line. `nexrt-vllm demo` runs the whole interactive path on this
machine: vLLM (with NexRTConnector) → NexRT decode node → router, one streamed chat request,
TTFT and tokens/s per stage, then a clean shutdown (Ctrl-C included). `nexrt-vllm draft-token-map`
builds a decode node's draft token map from a corpus (node/draft_token_map.py)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time

from nexrt_vllm.handoff.transport import TRANSPORTS
from nexrt_vllm.launch import (Procs, free_port, node_argv, resolve_device, router_argv, tail_log, vllm_argv, wait_file,
                               wait_http)

DEMO_PROMPT = "Tell me a story about a fast decoder."


async def _chat(router_url: str, model: str, prompt: str, max_tokens: int, out) -> dict:
    """One streamed chat request through the interactive path; returns client-side timings."""
    import aiohttp

    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    ttft = None
    usage = timing = None
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{router_url}/v1/chat/completions", json=body,
                          headers={"X-NexRT-Class": "interactive"},
                          timeout=aiohttp.ClientTimeout(total=600)) as r:
            if r.status != 200:
                raise RuntimeError(f"router answered {r.status}: {await r.text()}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream failed: {chunk['error']['message']}")
                if chunk["choices"]:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    text = chunk["choices"][0].get("delta", {}).get("content")
                    if text:
                        out.write(text)
                        out.flush()
                if chunk.get("usage"):
                    usage, timing = chunk["usage"], chunk.get("nexrt_timing") or {}
    return {"ttft_s": ttft, "e2e_s": time.monotonic() - t0, "usage": usage, "timing": timing}


def _report(res: dict, out) -> None:
    n = res["usage"]["completion_tokens"]
    t = res["timing"]
    node = t.get("node") or {}
    dec_tokens = node.get("tokens", n - 1)
    lines = [
        "",
        "-" * 64,
        f"prompt tokens {res['usage']['prompt_tokens']}, completion tokens {n}",
        f"client  TTFT                 {res['ttft_s'] * 1e3:8.1f} ms",
        f"client  end-to-end           {res['e2e_s'] * 1e3:8.1f} ms   "
        f"({n / res['e2e_s']:.1f} tok/s incl. TTFT)",
        f"router  queue wait           {t.get('queue_s', 0) * 1e3:8.1f} ms",
        f"vLLM    prefill + 1st token  {t.get('prefill_s', 0) * 1e3:8.1f} ms",
        f"node    KV/state hand-off    {(node.get('transfer_s') or 0) * 1e3:8.1f} ms",
    ]
    if t.get("decode_s"):
        lines.append(f"node    decode               {t['decode_s'] * 1e3:8.1f} ms   "
                     f"({dec_tokens / t['decode_s']:.1f} tok/s, {dec_tokens} tokens)")
    if t.get("degraded"):
        d = t["degraded"]
        lines.append(f"NOTE    the fast tier could not serve this reply ({d['reason']}: {d['detail']}); "
                     f"vLLM's standard path did ({t.get('standard_s', 0) * 1e3:.1f} ms)")
    lines.append("-" * 64)
    out.write("\n".join(lines) + "\n")


def has_mtp_head(model: str) -> bool:
    """The checkpoint's config declares MTP layers (Qwen3.5 / Qwen3-Next checkpoints ship one)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("mtp_num_hidden_layers") or 0) > 0


async def _demo(args, procs: Procs, workdir: str) -> None:
    model = args.model
    if model is None:
        from nexrt_vllm.testing import make_checkpoint

        model = os.path.join(workdir, "tiny-qwen3-next")
        print(f"[demo] writing a tiny random Qwen3-Next checkpoint with an MTP head to {model} (random weights: "
              f"the reply is gibberish; the point is the path and its timings)", flush=True)
        make_checkpoint(model, arch="qwen3_next", mtp=True)
    spec = args.speculative
    if spec == "auto":
        spec = "mtp" if has_mtp_head(model) else "off"
    node_extra = ["--speculative", "mtp", "--num-speculative-tokens", str(args.num_speculative_tokens)] \
        if spec == "mtp" else []
    device = resolve_device(args.device)
    transport = args.transport if args.transport != "auto" else ("nixl" if device == "cuda" else "mooncake")
    threads = {"OMP_NUM_THREADS": "1", "NEXRT_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    vport, rport = free_port(), free_port()
    ready = os.path.join(workdir, "node.ready")
    mode = f"MTP, {args.num_speculative_tokens} drafts per round" if spec == "mtp" else "one token per step"
    print(f"[demo] starting vLLM ({device}) and a decode node ({device}, transport {transport}, {mode}); logs in "
          f"{workdir}", flush=True)
    procs.start("vllm", vllm_argv(model, vport, args.max_model_len, transport, device, args.gpu_share),
                env=threads)
    procs.start("node", node_argv(model, ready, max_seq_len=args.max_model_len, transport=transport, device=device,
                                  extra=node_extra), env=threads)
    node = await wait_file(ready, procs, args.start_timeout, "decode node")
    print(f"[demo] decode node up at {node['url']}", flush=True)
    vllm_url = f"http://127.0.0.1:{vport}"
    await wait_http(f"{vllm_url}/health", procs, args.start_timeout, "vLLM")
    print(f"[demo] vLLM up at {vllm_url}", flush=True)
    router_url = f"http://127.0.0.1:{rport}"
    procs.start("router", router_argv(rport, vllm_url, [node["url"]], model))
    await wait_http(f"{router_url}/health", procs, 60, "router")
    print(f"[demo] router up at {router_url}\n", flush=True)
    print(f"user> {args.prompt}\nassistant> ", end="", flush=True)
    res = await _chat(router_url, model, args.prompt, args.max_tokens, sys.stdout)
    _report(res, sys.stdout)


async def _until_interrupted(coro) -> None:
    """Runs the demo; SIGINT / SIGTERM cancel it and end in KeyboardInterrupt. The signal is
    recorded before the cancel, so a cancellation that a library turns into a timeout (which a
    wait loop then retries) still ends the demo."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    main = asyncio.ensure_future(coro)
    stop = asyncio.ensure_future(interrupted.wait())
    try:
        await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not interrupted.is_set():
        return main.result()
    deadline = loop.time() + 10
    while not main.done() and loop.time() < deadline:
        main.cancel()
        await asyncio.wait({main}, timeout=0.5)
    if main.done() and not main.cancelled():
        main.exception()    # retrieved: the interrupt is what the user sees
    raise KeyboardInterrupt


def demo(args) -> int:
    workdir = tempfile.mkdtemp(prefix="nexrt-demo-")
    procs = Procs(workdir)
    try:
        asyncio.run(_until_interrupted(_demo(args, procs, workdir)))
        return 0
    except KeyboardInterrupt:
        print("\n[demo] interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"\n[demo] failed: {e}", file=sys.stderr)
        for name, _, log in procs.procs:
            print(f"--- {name} ({log}) ---\n{tail_log(log, 15)}", file=sys.stderr)
        return 1
    finally:
        # Stopping is bounded (SIGTERM, then SIGKILL after 20 s): a second signal must not cut it
        # short and leave children behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("[demo] shutting down", file=sys.stderr, flush=True)
        procs.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nexrt-vllm", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run vLLM + decode node + router and stream one chat reply",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--model", default=None,
                   help="checkpoint directory (default: make a tiny random Qwen3-Next one)")
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--max-model-len", type=int, default=2048)
    d.add_argument("--transport", choices=("auto", *TRANSPORTS), default="auto",
                   help="auto: nixl on a GPU (device memory to device memory), mooncake on CPU")
    d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where vLLM and the decode node run (auto: cuda when a GPU is visible)")
    d.add_argument("--gpu-share", type=float, default=0.3,
                   help="GPU only: vLLM's --gpu-memory-utilization (the node needs the rest)")
    d.add_argument("--speculative", choices=("auto", "off", "mtp"), default="auto",
                   help="the node's decoding: MTP rounds (the served mode where the checkpoint has an MTP head; "
                        "auto picks it then), or one token per step")
    d.add_argument("--num-speculative-tokens", type=int, default=3)
    d.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds to wait for vLLM and the node to start")
    from nexrt_vllm.node import draft_token_map
    m = sub.add_parser("draft-token-map", help="build a draft token map (nexrt-decode --draft-token-map): the "
                       "token ids most frequent in a corpus", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    draft_token_map.add_arguments(m)
    args = ap.parse_args(argv)
    if args.cmd == "draft-token-map":
        return draft_token_map.run(args)
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
