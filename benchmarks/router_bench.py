"""Router overhead on loopback: what `nexrt-router` adds to TTFT and to every streamed token.

Upstreams are the test doubles of vLLM and a decode node (nexrt_vllm/testing/router_fakes.py: same HTTP
contracts, instant prefill, tokens emitted at a fixed pace), served from their own process; the
router runs as the real `nexrt-router` process; the client is this process. Measured:

- added TTFT = TTFT through the router − the same one-token prefill call made directly to the
  fake vLLM (so it covers admission, the prefill proxying, first-token detokenization and SSE);
- added per-token latency = (client receive time − the node's emit time) through the router −
  the same through a direct NDJSON stream from the fake node (CLOCK_MONOTONIC is system-wide, so
  emit and receive times compare across processes).

    python -m benchmarks.router_bench --requests 50 --tokens 64 --out benchmarks/results/router_bench.json

`--prompt-tokens N` sends each prompt as N token ids (an agent's long context: the router reads them, writes
them into the vLLM leg's body and reads them back from vLLM's answer) instead of a short text.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def serve_fakes(tokenizer_dir: str, token_interval: float, max_len: int) -> None:
    """Child mode: fake vLLM + fake node; prints their URLs as one JSON line, serves until EOF."""
    from aiohttp import web
    from nexrt_vllm.testing.router_fakes import FakeNode, FakeVLLM, Loop, Model

    loop = Loop()
    model = Model(tokenizer_dir)
    vllm = FakeVLLM(model, tokenizer_dir, max_model_len=max_len)
    node = FakeNode(model, vllm, max_seq_len=max_len)
    node.token_delay = token_interval

    async def emits(request):
        # Emit times of the tokens streamed so far, then forget them (one request at a time).
        out, node.emit_times[:] = list(node.emit_times), []
        return web.json_response(out)

    node.app.router.add_get("/bench/emits", emits)
    print(json.dumps({"vllm": loop.serve(vllm.app), "node": loop.serve(node.app)}), flush=True)
    sys.stdin.read()
    loop.close()


def pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]  # noqa: E731
    return {"p50": q(50), "p90": q(90), "p99": q(99), "mean": statistics.fmean(xs), "n": len(xs)}


async def measure(urls: dict, router: str, n_req: int, n_tok: int, prompt_tokens: int = 0) -> dict:
    import aiohttp

    from nexrt_vllm.handoff.contracts import AdmitReply, AdmitRequest, Claim, GenerateRequest, Sampling

    body = {"model": "tiny", "max_tokens": n_tok, "ignore_eos": True, "temperature": 0}
    ttft_router, ttft_direct, tok_router, tok_direct = [], [], [], []
    async with aiohttp.ClientSession() as s:
        async def emits():
            async with s.get(urls["node"] + "/bench/emits") as r:
                return await r.json()

        for i in range(n_req):
            prompt = f"benchmark request number {i}" if not prompt_tokens else \
                [(7 * j + i) % 1000 + 10 for j in range(prompt_tokens)]
            # Direct prefill leg (what the router's TTFT is built on).
            t0 = time.monotonic()
            async with s.post(urls["vllm"] + "/v1/completions", json={
                    **body, "prompt": prompt, "max_tokens": 1, "return_token_ids": True}) as r:
                await r.read()
            ttft_direct.append(time.monotonic() - t0)
            # Through the router.
            await emits()
            t0, arrivals = time.monotonic(), []
            async with s.post(router + "/v1/completions", headers={"X-NexRT-Class": "interactive"},
                              json={**body, "prompt": prompt, "stream": True}) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"text":"' in line \
                            and b'"text":""' not in line:
                        arrivals.append(time.monotonic())
            ttft_router.append(arrivals[0] - t0)
            em = await emits()
            assert len(em) == n_tok - 1 == len(arrivals) - 1, (len(em), len(arrivals))
            tok_router += [a - e for a, e in zip(arrivals[1:], em)]
            # Direct node stream (admit + generate against the fake node, no router).
            rid = f"bench-{i}"
            async with s.post(urls["node"] + "/v1/admit", json=AdmitRequest(rid).to_wire()) as r:
                adm = AdmitReply.from_wire(await r.json())
            claim = Claim(rid, adm.generation, adm.control_addr)
            async with s.post(urls["vllm"] + "/v1/completions", json={
                    **body, "prompt": prompt, "max_tokens": 1, "return_token_ids": True,
                    "kv_transfer_params": claim.to_params()}) as r:
                first = (await r.json())["choices"][0]["token_ids"][0]
            arrivals = []
            req = GenerateRequest(rid, first, n_tok, adm.generation, Sampling(ignore_eos=True))
            async with s.post(urls["node"] + "/v1/generate", json=req.to_wire()) as r:
                async for line in r.content:
                    if line.startswith(b'{"token"'):
                        arrivals.append(time.monotonic())
            em = await emits()
            tok_direct += [a - e for a, e in zip(arrivals, em)]
    ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
    added_ttft = [a - b for a, b in zip(ttft_router, ttft_direct)]
    return {
        "added_ttft_ms": pct(ms(added_ttft)),
        "added_per_token_ms": {k: pct(ms(tok_router))[k] - pct(ms(tok_direct))[k]
                               for k in ("p50", "p90", "p99", "mean")},
        "raw": {"ttft_router_ms": pct(ms(ttft_router)), "prefill_direct_ms": pct(ms(ttft_direct)),
                "token_latency_router_ms": pct(ms(tok_router)),
                "token_latency_direct_ms": pct(ms(tok_direct))},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    ap.add_argument("--token-interval-ms", type=float, default=2.0,
                    help="the fake node's pace (keeps tokens from queueing)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="prompts of this many token ids (0: a short text prompt)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "router_bench.json"))
    ap.add_argument("--serve-fakes", metavar="TOKENIZER_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_fakes:
        serve_fakes(args.serve_fakes, args.token_interval_ms / 1e3, args.prompt_tokens + args.tokens + 4096)
        return 0
    if args.requests < 1 or args.tokens < 2 or args.prompt_tokens < 0:
        ap.error("--requests >= 1, --tokens >= 2 and --prompt-tokens >= 0")

    from nexrt_vllm.testing import make_tokenizer

    tmp = tempfile.mkdtemp(prefix="router-bench-")
    make_tokenizer(tmp)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                                         os.environ.get("PYTHONPATH", "")])}
    fakes = subprocess.Popen([sys.executable, "-m", "benchmarks.router_bench", "--serve-fakes",
                              tmp, "--token-interval-ms", str(args.token_interval_ms),
                              "--prompt-tokens", str(args.prompt_tokens), "--tokens", str(args.tokens)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                             cwd=os.path.dirname(HERE))
    router = None
    try:
        urls = json.loads(fakes.stdout.readline())
        from nexrt_vllm.launch import free_port

        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "nexrt_vllm.router.server", "--port",
                                   str(port), "--vllm-url", urls["vllm"], "--decode-url",
                                   urls["node"], "--tokenizer", tmp, "--fallback", "error",
                                   "--log-level", "WARNING"])
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_wait(url))
        res = asyncio.run(measure(urls, url, args.requests, args.tokens, args.prompt_tokens))
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        fakes.stdin.close()
        fakes.wait(10)
    try:
        import orjson  # noqa: F401 - what router/fastjson.py reads and writes with
        json_lib = "orjson"
    except ImportError:
        json_lib = "json (standard library)"
    res["config"] = {"requests": args.requests, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
                     "router_json": json_lib,
                     "token_interval_ms": args.token_interval_ms, "host_cpus": os.cpu_count(),
                     "note": "loopback, fake upstreams (router overhead only)"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: res[k] for k in ("added_ttft_ms", "added_per_token_ms")}, indent=2))
    return 0


async def _wait(url: str, timeout: float = 30) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("router did not start")
            await asyncio.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
