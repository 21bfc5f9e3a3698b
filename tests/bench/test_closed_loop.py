"""The closed loop: warm-ups excluded, concurrency held, files written, >5 % failures fail the run.

The server here is a scripted double of an OpenAI-compatible endpoint (the real vLLM and the real
router are driven in tests/bench/test_smoke.py).
"""
import asyncio
import glob
import json
import os
import threading

import pytest
from aiohttp import web

from benchmarks.inferencex import main
from nexrt_vllm.bench.inferencex import Identity, RequestInput, RunConfig, make_agg, run_closed_loop
from nexrt_vllm.launch import free_port
from nexrt_vllm.testing import make_tokenizer


class FakeOpenAI:
    """Streams `max_tokens` one-token chunks; the first `slow` requests wait `slow_s` first."""

    def __init__(self, slow=0, slow_s=0.0, fail_every=0):
        self.bodies, self.inflight, self.max_inflight = [], 0, 0
        self.slow, self.slow_s, self.fail_every = slow, slow_s, fail_every
        self.inflight_after_warmup = []

    async def handle(self, request):
        body = await request.json()
        self.bodies.append(body)
        n = len(self.bodies)
        if self.fail_every and n % self.fail_every == 0:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        if n > self.slow:
            self.inflight_after_warmup.append(self.inflight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(self.slow_s if n <= self.slow else 0.01)
            chat = "messages" in body
            max_tokens = body["max_completion_tokens" if chat else "max_tokens"]
            for i in range(max_tokens):
                choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else \
                    {"index": 0, "text": f"t{i}"}
                await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
                await asyncio.sleep(0.002)
            await resp.write(b"data: " + json.dumps(
                {"choices": [], "usage": {"completion_tokens": max_tokens}}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.inflight -= 1

    async def health(self, request):
        return web.Response(text="ok")


@pytest.fixture
def serve():
    """Runs a FakeOpenAI in a thread (the CLI calls asyncio.run itself); yields (fake, url)."""
    started = []

    def start(fake):
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        holder = {}

        async def boot():
            app = web.Application()
            app.router.add_post("/v1/completions", fake.handle)
            app.router.add_post("/v1/chat/completions", fake.handle)
            app.router.add_get("/health", fake.health)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            holder["runner"] = runner
            holder["port"] = site._server.sockets[0].getsockname()[1]
            ready.set()

        t = threading.Thread(target=lambda: (loop.run_until_complete(boot()), loop.run_forever()),
                             daemon=True)
        t.start()
        assert ready.wait(10), "fake server did not start"
        started.append((loop, t, holder["runner"]))
        return f"http://127.0.0.1:{holder['port']}"

    yield start
    for loop, t, runner in started:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


def _requests(n, out_len=5):
    return [RequestInput(prompt=f"p{i}", prompt_len=10 + i, output_len=out_len) for i in range(n)]


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_warmups_excluded_and_concurrency_held(serve, backend):
    conc, n = 2, 8
    fake = FakeOpenAI(slow=2 * conc, slow_s=0.4)   # warm-ups are slow, measured requests fast
    url = serve(fake)
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    cfg = RunConfig(backend=backend, api_url=url + endpoint, model="m", model_id="m",
                    tokenizer_id="t", max_concurrency=conc, num_warmups=2 * conc,
                    disable_tqdm=True)
    reqs = _requests(n)
    res = asyncio.run(run_closed_loop(cfg, reqs))
    assert len(fake.bodies) == 2 * conc + n
    warm = fake.bodies[:2 * conc]
    key = "messages" if backend == "openai-chat" else "prompt"
    first = reqs[0].prompt
    assert all((b[key][0]["content"] if key == "messages" else b[key]) == first for b in warm)
    for b in fake.bodies:
        assert b["temperature"] == 0.0 and b["ignore_eos"] is True and b["stream"] is True
        assert b["stream_options"] == {"include_usage": True}
    assert res["completed"] == n and len(res["ttfts"]) == n
    assert max(res["ttfts"]) < 0.3, "a warm-up's 0.4 s leaked into the measured TTFTs"
    assert res["duration"] < 0.4 * 2
    assert res["input_lens"] == [r.prompt_len for r in reqs]
    assert res["output_lens"] == [5] * n and res["total_output_tokens"] == 5 * n
    assert all(len(itl) == 4 for itl in res["itls"])
    assert fake.max_inflight == conc and max(fake.inflight_after_warmup) == conc


def test_cli_writes_raw_agg_and_plot(serve, tmp_path):
    url = serve(FakeOpenAI())
    tok = tmp_path / "tok"
    make_tokenizer(str(tok))
    plot = tmp_path / "p.png"
    rc = main(["run", "--base-url", url, "--model", "tiny", "--tokenizer", str(tok),
               "--isl", "32", "--osl", "6", "--conc", "1", "2", "--result-dir", str(tmp_path),
               "--label", "fake", "--disable-tqdm", "--prefill-gpus", "1", "--decode-gpus", "1",
               "--metadata", "path=fake", "--plot", str(plot)])
    assert rc == 0
    files = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "fake" / "*.json")))
    assert files == ["agg_fake_isl32_osl6_conc1.json", "agg_fake_isl32_osl6_conc2.json",
                     "fake_isl32_osl6_conc1.json", "fake_isl32_osl6_conc2.json"]
    raw = json.loads((tmp_path / "fake" / "fake_isl32_osl6_conc2.json").read_text())
    assert raw["num_prompts"] == 20 and raw["completed"] == 20    # max(10*conc, 16)
    assert raw["max_concurrency"] == 2 and raw["request_rate"] == "inf"
    assert raw["path"] == "fake" and "ttfts" not in raw           # not --save-detailed
    assert all(25 <= n <= 32 for n in raw["input_lens"])          # int(0.8*32) .. 32
    agg = json.loads((tmp_path / "fake" / "agg_fake_isl32_osl6_conc2.json").read_text())
    assert agg == make_agg(raw, Identity(prefill_gpus=1, decode_gpus=1), 32, 6)
    assert agg["conc"] == 2 and agg["median_intvty"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_too_many_failures_fail_the_run(serve, tmp_path, capsys):
    fake = FakeOpenAI(fail_every=4)    # 25 % of requests answer 500
    url = serve(fake)
    tok = tmp_path / "tok"
    make_tokenizer(str(tok))
    rc = main(["run", "--base-url", url, "--model", "tiny", "--tokenizer", str(tok),
               "--isl", "16", "--osl", "3", "--conc", "1", "--num-warmups", "0",
               "--result-dir", str(tmp_path), "--label", "bad", "--disable-tqdm"])
    assert rc == 1
    assert "exceeds 5% threshold" in capsys.readouterr().err
    raw = json.loads((tmp_path / "bad" / "bad_isl16_osl3_conc1.json").read_text())
    assert raw["completed"] == 12 and raw["num_prompts"] == 16
    assert not (tmp_path / "bad" / "agg_bad_isl16_osl3_conc1.json").exists()


def test_server_never_ready(tmp_path, capsys):
    port = free_port()
    tok = tmp_path / "tok"
    make_tokenizer(str(tok))
    rc = main(["run", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer",
               str(tok), "--scenario", "1k1k", "--ready-timeout", "1", "--result-dir",
               str(tmp_path)])
    assert rc == 1
    assert "not ready after 1 s" in capsys.readouterr().err


def test_interleaved_paths_get_the_same_prompts_in_turn(serve, tmp_path):
    """`run --interleave`: every prompt goes to each endpoint in turn (order rotated per prompt,
    warm-ups too), each endpoint's results are its own, each written under its label."""
    arrivals = []

    class Logged(FakeOpenAI):
        def __init__(self, name, **kw):
            super().__init__(**kw)
            self.name = name

        async def handle(self, request):
            arrivals.append(self.name)
            return await super().handle(request)

    a, b = Logged("a"), Logged("b", slow=10**6, slow_s=0.05)  # b: every request 50 ms before its first token
    url_a, url_b = serve(a), serve(b)
    tok = tmp_path / "tok"
    make_tokenizer(str(tok))
    n = 5
    rc = main(["run", "--base-url", url_a, "--model", "tiny", "--tokenizer", str(tok), "--isl", "24", "--osl", "4",
               "--num-prompts", str(n), "--result-dir", str(tmp_path), "--label", "a", "--disable-tqdm",
               "--kv-p2p-transfer", "nixl", "--interleave", f"b={url_b}", "--save-detailed"])
    assert rc == 0
    assert arrivals == ["a", "b", "b", "a"] + ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert [x["prompt"] for x in a.bodies] == [x["prompt"] for x in b.bodies]
    raw = {p: json.load(open(tmp_path / p / f"{p}_isl24_osl4_conc1.json")) for p in "ab"}
    agg = {p: json.load(open(tmp_path / p / f"agg_{p}_isl24_osl4_conc1.json")) for p in "ab"}
    assert raw["a"]["completed"] == raw["b"]["completed"] == n
    assert raw["a"]["interleaved_with"] == ["b"] and raw["b"]["interleaved_with"] == ["a"]
    assert max(raw["a"]["ttfts"]) < 0.05 <= min(raw["b"]["ttfts"])
    assert agg["a"]["kv_p2p_transfer"] == "nixl" and not agg["b"].get("kv_p2p_transfer")
    # conc > 1 cannot be interleaved
    assert main(["run", "--base-url", url_a, "--model", "tiny", "--tokenizer", str(tok), "--isl", "24",
                 "--osl", "4", "--conc", "2", "--result-dir", str(tmp_path), "--interleave", f"b={url_b}"]) == 1
