"""Request classes: `X-NexRT-Class: interactive` (or --default-class interactive without a
'standard' header) takes the fast path; everything else is proxied unchanged to --standard-url,
byte for byte, streaming included."""
import json

import pytest
import requests
from aiohttp import web

from nexrt_vllm.testing import make_tokenizer
from nexrt_vllm.testing.router_fakes import Stack


class Standard:
    def __init__(self):
        self.seen = []
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.handle)
        self.app.router.add_post("/v1/chat/completions", self.handle)

    async def handle(self, request):
        raw = await request.read()
        self.seen.append((request.path_qs, raw, dict(request.headers)))
        body = json.loads(raw)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b'data: {"i": %d}\n\n' % i)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"echo": body, "n": body.get("n")}, status=201)


@pytest.fixture(scope="module", params=["standard", "interactive"])
def stack(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    make_tokenizer(d)
    std = Standard()
    from nexrt_vllm.testing.router_fakes import Loop
    loop = Loop()
    std_url = loop.serve(std.app)
    s = Stack(d, n_nodes=1, router_args=("--default-class", request.param,
                                          "--standard-url", std_url))
    s.std, s.default = std, request.param
    yield s
    s.close()
    loop.close()


def test_standard_requests_are_proxied_unchanged(stack):
    hdr = {} if stack.default == "standard" else {"X-NexRT-Class": "standard"}
    # Even fields the interactive tier refuses (n=2) pass through untouched.
    raw = b'{"model": "any-model", "prompt": "x",   "n": 2}'
    r = requests.post(stack.url + "/v1/completions?trace=1", data=raw, timeout=10,
                      headers={**hdr, "Content-Type": "application/json", "X-Custom": "7"})
    assert r.status_code == 201 and r.json()["n"] == 2
    path, seen_raw, headers = stack.std.seen[-1]
    assert path == "/v1/completions?trace=1" and seen_raw == raw and headers["X-Custom"] == "7"
    r = requests.post(stack.url + "/v1/chat/completions", timeout=10, headers=hdr,
                      json={"model": "m", "messages": [], "stream": True})
    assert r.text == "".join(f'data: {{"i": {i}}}\n\n' for i in range(3)) + "data: [DONE]\n\n"
    assert stack.nodes[0].admits == 0


def test_interactive_header_takes_fast_path(stack):
    n = len(stack.std.seen)
    hdr = {"X-NexRT-Class": "interactive"} if stack.default == "standard" else {}
    r = requests.post(stack.url + "/v1/completions", headers=hdr, timeout=10,
                      json={"model": "tiny", "prompt": "fast", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert len(stack.std.seen) == n and stack.nodes[0].generated
