"""The first hand-off after a decode node starts costs what the second does (the router's warm-up).

    python3 benchmarks/checks/first_handoff.py --device cuda --transport nixl --json OUT.json \
        [--model DIR | --shape 2b --tokenizer TOKDIR] [--restarts 3]

One vLLM with NexRTConnector, one decode node on a fixed port, and a router, as the product runs them.
Twice: a router started with `--no-warmup` (before), then one with its warm-up (after). Each time
the node is started again `--restarts` times; after each start, once the router has it back in
rotation (and, with warm-up, has warmed it), two interactive completions, and the node's own
transfer time of each hand-off (accept to done, `nexrt_timing.node.transfer_s`) and the control
`hello`s it received (a sender's connection set-up) are recorded. The JSON has every pair and the
median first / second ratio of each router; the exit status is 1 unless the warmed ratio is at most
`--max-ratio` (1.5) and no warmed first request had to say hello (nexrt_vllm.bench.checks).
`--model` defaults to the trained tiny Qwen3-Next; `--shape 2b` runs the real Qwen3.5-2B shape with
random weights on both sides (as gpu_e2e does; needs `--tokenizer`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request

from nexrt_vllm.bench.checks import finish, record, write
from nexrt_vllm.launch import Procs, free_port, node_argv, router_argv, vllm_argv, wait_file, wait_http

PROMPT_WORDS = 200


def log(*a):
    print(f"[first_handoff {time.strftime('%H:%M:%S')}]", *a, flush=True)


def _get(url: str) -> dict | str:
    """The body of a GET, also of an error status (the router's /health answers 503 with no node)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read().decode()
    except urllib.error.HTTPError as e:
        body = e.read().decode()
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


def metric(url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in _get(url + "/metrics").splitlines():
        if line.startswith(name) and line[len(name)] in " {" and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def completion(router: str, model: str, prompt: str) -> float:
    """One interactive completion through the router; the node's transfer time of its hand-off."""
    req = urllib.request.Request(router + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": model, "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True}).encode())
    with urllib.request.urlopen(req, timeout=300) as r:
        t = json.loads(r.read())["nexrt_timing"]
    if "degraded" in t:
        raise RuntimeError(f"served by the standard path: {t['degraded']}")
    return float(t["node"]["transfer_s"])


def prompts(n: int, model: str, real_tokenizer: bool):
    """Distinct prompts (no request reuses another's prefix cache) of PROMPT_WORDS words: periodic text
    in the tiny checkpoint's own vocabulary, or random common words for the real tokenizer."""
    import random
    if not real_tokenizer:
        from nexrt_vllm.testing.real_stack import periodic_texts
        yield from periodic_texts(model, ((5, PROMPT_WORDS),) * n)
        return
    rng = random.Random(0)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
             "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
    for _ in range(n):
        yield " ".join(rng.choice(words) for _ in range(PROMPT_WORDS))


class Stack:
    def __init__(self, a, model: str, work: str):
        self.a, self.model, self.work = a, model, work
        self.procs = Procs(work)
        self.node_port, self.starts, self.node = free_port(), 0, None
        self.node_url = f"http://127.0.0.1:{self.node_port}"
        self.router_url = self.router = None
        extra = ["--load-format", "dummy"] if a.shape else []
        self.node_extra = extra
        vport = free_port()
        self.vllm_url = f"http://127.0.0.1:{vport}"
        self.procs.start("vllm", vllm_argv(model, vport, a.max_len, a.transport, a.device, a.gpu_share,
                                           extra=extra + (["--enforce-eager"] if not a.shape and a.device == "cuda"
                                                          else [])))
        self.start_node()
        asyncio.run(wait_http(self.vllm_url + "/health", self.procs, a.start_timeout, "vLLM"))

    def start_node(self) -> None:
        if self.node is not None:
            self.procs.end(self.node)
        self.starts += 1
        ready = os.path.join(self.work, f"node{self.starts}.ready")
        self.node = self.procs.start(f"node{self.starts}", node_argv(
            self.model, ready, max_seq_len=self.a.max_len, port=self.node_port, transport=self.a.transport,
            device=self.a.device, extra=self.node_extra))
        asyncio.run(wait_file(ready, self.procs, self.a.start_timeout, "decode node"))

    def start_router(self, warmup: bool) -> None:
        if self.router is not None:
            self.procs.end(self.router)
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        self.router = self.procs.start(f"router{'_warm' if warmup else '_cold'}", router_argv(
            port, self.vllm_url, [self.node_url], self.model,
            extra=["--health-interval", "0.5", "--fallback", "error", "--log-level", "INFO"]
            + ([] if warmup else ["--no-warmup"])))
        asyncio.run(wait_http(self.router_url + "/health", self.procs, 120, "router"))

    def restart_node(self) -> None:
        """Stop the node, wait until the router has seen it gone, start it again on its port."""
        self.procs.end(self.node)
        deadline = time.monotonic() + 60
        while _get(self.router_url + "/health")["nodes"][0]["healthy"]:
            if time.monotonic() > deadline:
                raise TimeoutError("the router did not notice the node stop")
            time.sleep(0.05)
        self.start_node()

    def in_rotation(self, warmed: float | None, timeout: float = 300) -> None:
        """Until the router has the node (this start) in rotation, and warmed it when `warmed` (the
        router's count of ok warm-ups before the start) is given."""
        deadline = time.monotonic() + timeout
        while True:
            h = _get(self.router_url + "/health")
            node = h["nodes"][0]
            ok = node["healthy"] and not node["in_flight"]
            if ok and warmed is not None:
                ok = metric(self.router_url, "nexrt_router_warmups_total", 'outcome="ok"') > warmed
            if ok:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"node not back in rotation{' and warmed' if warmed is not None else ''}: {h}")
            time.sleep(0.1)


def rounds(stack: Stack, warmup: bool, n: int, texts) -> list[dict]:
    out = []
    for _ in range(n):
        before = metric(stack.router_url, "nexrt_router_warmups_total", 'outcome="ok"')
        stack.restart_node()
        stack.in_rotation(before if warmup else None)
        h0 = metric(stack.node_url, "nexrt_control_messages_total", 'type="hello"')
        first = completion(stack.router_url, stack.model, next(texts))
        h1 = metric(stack.node_url, "nexrt_control_messages_total", 'type="hello"')
        second = completion(stack.router_url, stack.model, next(texts))
        row = {"first_ms": round(1e3 * first, 3), "second_ms": round(1e3 * second, 3),
               "ratio": round(first / second, 3), "hellos_before_first": h0, "hellos_by_first": h1 - h0}
        log("warm-up" if warmup else "no warm-up", row)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--transport", choices=("nixl", "mooncake"), default="nixl")
    ap.add_argument("--model", default=None, help="checkpoint (default: the trained tiny Qwen3-Next)")
    ap.add_argument("--shape", choices=("2b", "35b"), default=None, help="a real shape with random weights")
    ap.add_argument("--tokenizer", default=None, help="dir with the Qwen3.5 tokenizer.json (--shape)")
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--max-ratio", type=float, default=1.5)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--gpu-share", type=float, default=0.3)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if a.shape and not a.tokenizer:
        ap.error("--shape needs --tokenizer")
    work = tempfile.mkdtemp(prefix="first-handoff-")
    if a.shape:
        from nexrt_vllm.bench.model_dir import write_model_dir
        model = os.path.join(work, f"model-{a.shape}")
        write_model_dir(model, a.shape, a.tokenizer, None)
    elif a.model:
        model = a.model
    else:
        import shutil

        from nexrt_vllm.testing import stored
        from nexrt_vllm.testing.connector_harness import TRAINED
        model = os.path.join(work, "tiny-trained")
        kept = stored.lookup("qwen3_next", "bfloat16", TRAINED)
        if kept is None:
            raise SystemExit("the stored trained tiny checkpoint is missing (python -m nexrt_vllm.testing.stored)")
        shutil.copytree(kept, model)
    res = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "device": a.device,
           "transport": a.transport, "model": a.shape or os.path.basename(model), "prompt_words": PROMPT_WORDS,
           "restarts": a.restarts, "max_ratio": a.max_ratio}
    if a.device == "cuda":
        import torch
        res["hw"] = torch.cuda.get_device_name()
    texts = prompts(4 * a.restarts + 4, model, bool(a.shape))
    stack = None
    try:
        stack = Stack(a, model, work)
        stack.start_router(warmup=False)
        completion(stack.router_url, model, next(texts))  # vLLM's own first request, before any measured one
        res["no_warmup"] = rounds(stack, False, a.restarts, texts)
        stack.start_router(warmup=True)
        res["warmup"] = rounds(stack, True, a.restarts, texts)
        for k in ("no_warmup", "warmup"):
            res[f"{k}_median_ratio"] = statistics.median(r["ratio"] for r in res[k])
        record(res, "warm_first_within_ratio", res["warmup_median_ratio"] <= a.max_ratio)
        record(res, "warm_first_said_no_hello", all(r["hellos_by_first"] == 0 for r in res["warmup"]))
    except Exception as e:  # noqa: BLE001 - recorded; the exit status says it failed
        res["error"] = f"{type(e).__name__}: {e}"
        record(res, "ran", False)
        log("FAILED", res["error"])
    finally:
        if stack is not None:
            stack.procs.stop()
        write(res, a.json)
    log({k: res.get(k) for k in ("no_warmup_median_ratio", "warmup_median_ratio")})
    return finish(res, a.json)


if __name__ == "__main__":
    sys.exit(main())
