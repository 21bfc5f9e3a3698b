"""InferenceX-compatible serving client for any OpenAI-compatible endpoint (benchmarks/inferencex.py is its CLI).

A port of the client InferenceX publishes its numbers with (SemiAnalysisAI/InferenceX:
`utils/bench_serving/{benchmark_serving,backend_request_func}.py`, `utils/process_result.py`,
`benchmarks/benchmark_lib.sh`), so the NexRT router and plain vLLM are measured by the same rules and
the same metric definitions, file by file comparable with InferenceX's own results. Needs neither
torch nor vLLM: prompts are built with `tokenizers` from the model's `tokenizer.json`.

Deliberate deviations from InferenceX (each makes a broken response count as failed rather than as a
fast success; none changes a metric of a healthy stream) are listed in docs/BENCHMARKS.md.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from typing import AsyncIterable, Callable, Optional

import aiohttp
import numpy as np
from tqdm import tqdm

# benchmark_lib.sh + the InferenceX workflows: ISL/OSL pairs, `--random-range-ratio 0.8`,
# `--num-prompts CONC*10`, `--num-warmups 2*CONC`, `--percentile-metrics ttft,tpot,itl,e2el`.
SCENARIOS = {"1k1k": (1024, 1024), "8k1k": (8192, 1024)}
RANGE_RATIO = 0.8
MIN_PROMPTS = 16
MAX_FAILURE_PERCENT = 5
PERCENTILES = (90.0, 99.0, 99.9)
METRICS = ("ttft", "tpot", "itl", "e2el")
# Fields of the raw result that only `--save-detailed` keeps (benchmark_serving.py drops them).
DETAILED_FIELDS = ("ttfts", "itls", "generated_texts", "errors")
AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
CHAT_BACKENDS = ("openai-chat",)
COMPLETION_BACKENDS = ("openai", "vllm", "sglang", "lmdeploy", "scalellm")
BACKENDS = COMPLETION_BACKENDS + CHAT_BACKENDS


class BenchmarkError(Exception):
    """Bad configuration or input (missing tokenizer, impossible lengths, server never ready)."""


class BenchmarkFailed(Exception):
    """More than 5 % of the measured requests failed (InferenceX fails the run)."""


# ----------------------------------------------------------------------------------------------
# Tokenizer (prompt generation only)


class PromptTokenizer:
    """The slice of a HF tokenizer that prompt generation uses, on `tokenizers` alone.

    Semantics follow `PreTrainedTokenizerFast`: `vocab_size` excludes added tokens, `decode` keeps
    special tokens, `encode` adds none; the chat template renders like `apply_chat_template`.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        tok_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(tok_file):
            raise BenchmarkError(f"no tokenizer.json at {path!r} (pass --tokenizer DIR or FILE)")
        self._tok = Tokenizer.from_file(tok_file)
        self._dir = os.path.dirname(os.path.abspath(tok_file))
        cfg_file = os.path.join(self._dir, "tokenizer_config.json")
        self._cfg = {}
        self._template = None
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                self._cfg = json.load(f)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def _chat_template(self) -> str:
        tmpl = self._cfg.get("chat_template")
        jinja_file = os.path.join(self._dir, "chat_template.jinja")
        if tmpl is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                tmpl = f.read()
        if isinstance(tmpl, list):  # named templates: HF uses "default"
            tmpl = {t["name"]: t["template"] for t in tmpl}.get("default")
        if not isinstance(tmpl, str):
            raise BenchmarkError(f"--use-chat-template: no chat template in {self._dir}")
        return tmpl

    def apply_chat_template(self, prompt: str) -> str:
        if self._template is None:
            self._template = self._compile_chat_template()
        return self._template.render(messages=[{"role": "user", "content": prompt}],
                                     add_generation_prompt=True, **self._special_tokens())

    def _compile_chat_template(self):
        # The environment transformers renders chat templates in: trim/lstrip blocks, loop
        # controls, raise_exception, tojson, strftime_now.
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self._chat_template())

    def _special_tokens(self) -> dict:
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = self._cfg.get(key)
            special[key] = value.get("content") if isinstance(value, dict) else value
        return special


# ----------------------------------------------------------------------------------------------
# Prompts


@dataclass
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int


def sample_random_requests(tokenizer: PromptTokenizer, input_len: int, output_len: int,
                           num_prompts: int, range_ratio: float = RANGE_RATIO, seed: int = 0,
                           use_chat_template: bool = False, prefix_len: int = 0
                           ) -> list[RequestInput]:
    """InferenceX's `sample_random_requests` (serial path), draw for draw.

    Lengths uniform in [int(L·ratio), L]; token ids `(offset_i + i + j) % vocab` decoded, then
    re-encoded and padded/truncated (up to 10 rounds) until the text is exactly the target length.
    The RandomState replaces `np.random.seed(seed)` + global draws: the same sequence.
    """
    if input_len < 1 or output_len < 1 or num_prompts < 1:
        raise BenchmarkError(f"input_len, output_len and num_prompts must be >= 1 "
                             f"(got {input_len}, {output_len}, {num_prompts})")
    if not 0.0 <= range_ratio <= 1.0:
        raise BenchmarkError(f"range_ratio must be in [0, 1], got {range_ratio}")
    rng = np.random.RandomState(seed)
    vocab_size = tokenizer.vocab_size
    prefix_token_ids = rng.randint(0, vocab_size, size=prefix_len).tolist()
    if use_chat_template:
        # The template's own tokens count towards ISL ("- 1" for the dummy "a", as upstream).
        overhead = len(tokenizer.encode(tokenizer.apply_chat_template("a"))) - 1
        input_len -= overhead
        if input_len < 1:
            raise BenchmarkError(f"ISL is shorter than the chat template ({overhead} tokens)")

    def sample_uniform(seq_len):
        return rng.randint(int(seq_len * range_ratio), seq_len + 1, size=num_prompts).tolist()

    input_lens = sample_uniform(input_len)
    output_lens = sample_uniform(output_len)
    offsets = rng.randint(0, vocab_size, size=num_prompts)
    local_rng = np.random.RandomState(rng.get_state()[1][:4].tolist())

    requests = []
    for i in range(num_prompts):
        target = prefix_len + input_lens[i]
        ids = prefix_token_ids + [(offsets[i] + i + j) % vocab_size for j in range(input_lens[i])]
        prompt = tokenizer.decode(ids)
        for _ in range(10):
            ids = tokenizer.encode(prompt)
            if len(ids) < target:
                ids.extend(local_rng.randint(0, vocab_size, size=target - len(ids)).tolist())
            elif len(ids) > target:
                ids = ids[:target]
            else:
                break
            prompt = tokenizer.decode(ids)
        if use_chat_template:
            prompt = tokenizer.apply_chat_template(prompt)
        requests.append(RequestInput(prompt, len(tokenizer.encode(prompt)), output_lens[i]))
    return requests


# ----------------------------------------------------------------------------------------------
# One request: payload, SSE timing


@dataclass
class RequestOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0          # E2EL, seconds
    output_tokens: Optional[int] = 0   # `usage.completion_tokens`; 0 when no usage chunk came
    ttft: float = 0.0
    itl: list = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""


def build_payload(backend: str, model: str, inp: RequestInput, ignore_eos: bool = True) -> dict:
    """The request bodies of backend_request_func.py (temperature 0, streamed, usage included)."""
    if backend in CHAT_BACKENDS:
        payload = {"model": model, "messages": [{"role": "user", "content": inp.prompt}],
                   "temperature": 0.0, "max_completion_tokens": inp.output_len}
    else:
        payload = {"model": model, "prompt": inp.prompt, "temperature": 0.0, "best_of": 1,
                   "max_tokens": inp.output_len, "logprobs": None}
    payload.update({"stream": True, "stream_options": {"include_usage": True}})
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def consume_stream(lines: AsyncIterable[bytes], st: float, out: RequestOutput, chat: bool,
                         clock: Callable[[], float] = time.perf_counter) -> None:
    """Time one SSE stream exactly as InferenceX's request functions do.

    TTFT: send -> first chunk with non-empty `choices` (a role-only chat delta counts); ITL: gap
    between successive such chunks (per chunk, so a chunk carrying several tokens is one gap);
    E2EL: send -> last timestamp, which for chat includes the usage chunk and for completions is
    the last chunk with choices; output tokens from `usage.completion_tokens`.
    """
    first = False
    most_recent = st
    text = []
    error_event = None
    async for raw in lines:
        raw = raw.strip()
        if not raw:
            continue
        chunk = raw.decode("utf-8").removeprefix("data: ")
        if chunk == "[DONE]":
            continue
        timestamp = clock()
        data = json.loads(chunk)
        if choices := data.get("choices"):
            if not first:
                first = True
                out.ttft = timestamp - st
            else:
                out.itl.append(timestamp - most_recent)
            most_recent = timestamp
            piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
            text.append(piece or "")
        elif usage := data.get("usage"):
            out.output_tokens = usage.get("completion_tokens")
        elif "error" in data:
            error_event = data["error"]
        if chat:  # upstream's chat function stamps every chunk (so the usage chunk ends E2EL)
            most_recent = timestamp
    out.generated_text = "".join(text)
    out.latency = most_recent - st
    # Deviation (docs/BENCHMARKS.md): an in-stream error event or a stream without any choice
    # chunk fails the request (upstream counts an error event, and any chat 200, as success).
    if error_event is not None:
        out.success = False
        out.error = f"error event in stream: {json.dumps(error_event)[:500]}"
    elif not first:
        out.success = False
        out.error = "Never received a valid chunk to calculate TTFT."
    else:
        out.success = True


async def send_request(backend: str, api_url: str, model: str, inp: RequestInput,
                       ignore_eos: bool = True, headers: Optional[dict] = None,
                       clock: Callable[[], float] = time.perf_counter) -> RequestOutput:
    """One streamed request on its own connection (upstream opens a session per request)."""
    payload = build_payload(backend, model, inp, ignore_eos)
    hdrs = {"Content-Type": "application/json",
            "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}", **(headers or {})}
    out = RequestOutput(prompt_len=inp.prompt_len)
    async with aiohttp.ClientSession(trust_env=True, timeout=AIOHTTP_TIMEOUT) as session:
        st = clock()
        try:
            async with session.post(url=api_url, json=payload, headers=hdrs) as resp:
                if resp.status == 200:
                    await consume_stream(resp.content, st, out, backend in CHAT_BACKENDS, clock)
                else:
                    body = (await resp.text())[:500]
                    out.error = f"HTTP {resp.status} {resp.reason or ''}: {body}"
        except Exception:  # noqa: BLE001 - any transport/parse failure is a failed request
            out.success = False
            out.error = traceback.format_exc()
    return out


# ----------------------------------------------------------------------------------------------
# Metrics (calculate_metrics of benchmark_serving.py)


def _stats(name: str, values: list, percentiles=PERCENTILES) -> dict:
    # `values or 0`: upstream reports 0 for an empty list instead of NaN.
    v = values or 0
    out = {f"mean_{name}_ms": float(np.mean(v)) * 1000,
           f"median_{name}_ms": float(np.median(v)) * 1000,
           f"std_{name}_ms": float(np.std(v)) * 1000}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(v, p)) * 1000
    return out


def calculate_metrics(outputs: list[RequestOutput], duration_s: float,
                      tokenizer: Optional[PromptTokenizer] = None,
                      percentiles=PERCENTILES) -> tuple[dict, list[int]]:
    """Aggregate per-request outputs; returns (metrics in InferenceX's raw keys, output lens).

    TPOT per request = (E2EL - TTFT) / (output_tokens - 1), only for output_tokens > 1; ITL pools
    every chunk gap of every request; throughputs divide by the main run's wall time.
    """
    output_lens, ttfts, tpots, itls, e2els = [], [], [], [], []
    total_input = completed = 0
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens
        if n is None:  # usage without completion_tokens: count the text, as upstream
            if tokenizer is None:
                raise BenchmarkError("a response had no completion_tokens and no tokenizer was given")
            n = len(tokenizer.encode(o.generated_text))
        output_lens.append(n)
        total_input += o.prompt_len
        if n > 1:
            tpots.append((o.latency - o.ttft) / (n - 1))
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    total_output = sum(output_lens)
    metrics = {
        "completed": completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput:": None,  # sic: upstream's key (goodput SLOs are not used by InferenceX)
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_stats(name, values, percentiles))
    return metrics, output_lens


# ----------------------------------------------------------------------------------------------
# One closed-loop run (benchmark() of benchmark_serving.py)


@dataclass
class RunConfig:
    backend: str
    api_url: str
    model: str                      # `model` field sent (served name)
    model_id: str                   # recorded in the JSON (`--model`)
    tokenizer_id: str
    max_concurrency: int
    num_warmups: int
    ignore_eos: bool = True
    headers: dict = field(default_factory=dict)
    disable_tqdm: bool = False


async def run_closed_loop(cfg: RunConfig, requests: list[RequestInput],
                          tokenizer: Optional[PromptTokenizer] = None,
                          clock: Callable[[], float] = time.perf_counter) -> dict:
    """Warm-ups (copies of the first prompt, excluded), then every request at once behind a
    semaphore of `max_concurrency` (request rate inf). Returns InferenceX's benchmark result."""
    if cfg.max_concurrency < 1:
        raise BenchmarkError(f"max_concurrency must be >= 1, got {cfg.max_concurrency}")
    if not requests:
        raise BenchmarkError("no requests to run")

    def request(inp):
        return send_request(cfg.backend, cfg.api_url, cfg.model, inp, cfg.ignore_eos,
                            cfg.headers, clock)

    async def limited(sem, inp, bar):
        async with sem:
            out = await request(inp)
        if bar is not None:
            bar.update(1)
        return out

    if cfg.num_warmups > 0:
        bar = None if cfg.disable_tqdm else tqdm(total=cfg.num_warmups, desc="warm-up")
        sem = asyncio.Semaphore(cfg.max_concurrency)
        await asyncio.gather(*(limited(sem, requests[0], bar) for _ in range(cfg.num_warmups)))
        if bar is not None:
            bar.close()

    bar = None if cfg.disable_tqdm else tqdm(total=len(requests), desc=f"conc {cfg.max_concurrency}")
    sem = asyncio.Semaphore(cfg.max_concurrency)
    start = clock()
    start_unix = time.time()
    outputs = await asyncio.gather(*(asyncio.create_task(limited(sem, r, bar)) for r in requests))
    if bar is not None:
        bar.close()
    duration = clock() - start
    return bench_result(outputs, duration, start_unix, tokenizer)


def bench_result(outputs: list[RequestOutput], duration: float, start_unix: float,
                 tokenizer: Optional[PromptTokenizer] = None) -> dict:
    """InferenceX's benchmark result of one run's outputs."""
    metrics, output_lens = calculate_metrics(outputs, duration, tokenizer)
    ordered = {k: metrics.pop(k) for k in ("completed", "total_input_tokens", "total_output_tokens",
                                           "request_throughput", "request_goodput:",
                                           "output_throughput", "total_token_throughput")}
    return {
        "duration": duration,
        "benchmark_start_time_unix": start_unix,
        "benchmark_end_time_unix": time.time(),
        **ordered,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        **metrics,
    }


async def run_interleaved(cfgs: list[RunConfig], requests: list[RequestInput],
                          tokenizer: Optional[PromptTokenizer] = None,
                          clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Concurrency 1 on several endpoints, request by request: prompt i goes to every endpoint in
    turn (the order rotated each prompt), so drift of the machine or of any one server over the run
    falls on all of them alike (a deviation from InferenceX, which measures one endpoint per run).
    Warm-ups interleaved the same way. Returns each endpoint's benchmark result; its duration is the
    sum of its own requests' latencies (its wall time had it run alone)."""
    if any(c.max_concurrency != 1 for c in cfgs):
        raise BenchmarkError("interleaved runs are concurrency 1")
    if not requests:
        raise BenchmarkError("no requests to run")

    def request(cfg, inp):
        return send_request(cfg.backend, cfg.api_url, cfg.model, inp, cfg.ignore_eos, cfg.headers, clock)

    def order(i):
        return [cfgs[(i + k) % len(cfgs)] for k in range(len(cfgs))]

    for w in range(max(c.num_warmups for c in cfgs)):
        for cfg in order(w):
            if w < cfg.num_warmups:
                await request(cfg, requests[0])
    start_unix = time.time()
    outputs: dict[int, list] = {id(c): [] for c in cfgs}
    for i, inp in enumerate(requests):
        for cfg in order(i):
            outputs[id(cfg)].append(await request(cfg, inp))
    results = []
    for cfg in cfgs:
        outs = outputs[id(cfg)]
        results.append(bench_result(outs, sum(o.latency for o in outs) or 1e-9, start_unix, tokenizer))
    return results


def raw_result(cfg: RunConfig, num_prompts: int, bench: dict, metadata: dict,
               save_detailed: bool = False) -> dict:
    """The file benchmark_serving.py writes with --save-result (same keys, same order)."""
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": cfg.backend,
           "model_id": cfg.model_id, "tokenizer_id": cfg.tokenizer_id, "best_of": 1,
           "num_prompts": num_prompts, **metadata, "request_rate": "inf", "burstiness": 1.0,
           "max_concurrency": cfg.max_concurrency, **bench}
    if not save_detailed:
        for k in DETAILED_FIELDS:
            out.pop(k, None)
    return out


def check_failure_rate(completed: int, num_prompts: int) -> None:
    # Exact ">5 %" (upstream's float `1 - completed/n > 0.05` also fails runs at exactly 5 %).
    failure_rate = 1 - completed / num_prompts
    if (num_prompts - completed) * 100 > MAX_FAILURE_PERCENT * num_prompts:
        raise BenchmarkFailed(f"FAIL: request failure rate {failure_rate:.1%} exceeds "
                              f"{MAX_FAILURE_PERCENT}% threshold ({completed}/{num_prompts} completed)")


def print_summary(result: dict) -> None:
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for label, key in (("Successful requests:", "completed"),
                       ("Benchmark duration (s):", "duration"),
                       ("Total input tokens:", "total_input_tokens"),
                       ("Total generated tokens:", "total_output_tokens"),
                       ("Request throughput (req/s):", "request_throughput"),
                       ("Output token throughput (tok/s):", "output_throughput"),
                       ("Total Token throughput (tok/s):", "total_token_throughput")):
        print(f"{label:<40} {result[key]:<10.2f}" if isinstance(result[key], float)
              else f"{label:<40} {result[key]:<10}")
    for name in METRICS:
        print("{s:{c}^{n}}".format(s=name.upper(), n=50, c="-"))
        for stat in ("mean", "median", "p99"):
            print(f"{stat.capitalize() + ' ' + name.upper() + ' (ms):':<40} "
                  f"{result[f'{stat}_{name}_ms']:<10.2f}")
    tpot = result["median_tpot_ms"]
    if tpot > 0:
        print(f"{'Median interactivity (tok/s/user):':<40} {1000.0 / tpot:<10.2f}")
    print("=" * 50)


# ----------------------------------------------------------------------------------------------
# Aggregate file (utils/process_result.py)


@dataclass
class Identity:
    """What process_result.py reads from the environment, as explicit values."""
    hw: str = "cpu"
    image: str = ""
    framework: str = "vllm"
    precision: str = "bf16"
    spec_decoding: str = "none"
    model_prefix: str = ""
    recipe_fingerprint: str = ""
    router: Optional[dict] = None           # {"name", "version"}
    kv_p2p_transfer: str = ""
    # single node: GPUs = tp * pp * pcp
    tp: int = 1
    pp: int = 1
    dcp: int = 1
    pcp: int = 1
    ep: int = 1
    dp_attention: str = "false"
    # disaggregated (prefill_gpus set): InferenceX encodes every disaggregated result as multinode
    prefill_gpus: int = 0
    decode_gpus: int = 0
    prefill_tp: int = 0                     # 0: = prefill_gpus / prefill_workers
    decode_tp: int = 0
    prefill_ep: int = 1
    decode_ep: int = 1
    prefill_dp_attention: str = "false"
    decode_dp_attention: str = "false"
    prefill_workers: int = 1
    decode_workers: int = 1

    @property
    def disagg(self) -> bool:
        return self.prefill_gpus > 0


def make_agg(raw: dict, ident: Identity, isl: int, osl: int) -> dict:
    """process_result.py: identity, topology, per-GPU throughputs, then every `*_ms` key in
    seconds without `_ms`, and for every `*tpot*` key an `*intvty*` key = 1000 / value_ms."""
    if ident.router is not None and (set(ident.router) != {"name", "version"}
                                     or not all(isinstance(v, str) and v
                                                for v in ident.router.values())):
        raise BenchmarkError("router metadata must be exactly non-empty 'name' and 'version'")
    data = {"hw": ident.hw, "conc": int(raw["max_concurrency"]), "image": ident.image,
            "model": raw["model_id"], "infmax_model_prefix": ident.model_prefix,
            "framework": ident.framework, "precision": ident.precision,
            "spec_decoding": ident.spec_decoding, "disagg": ident.disagg,
            "recipe_fingerprint": ident.recipe_fingerprint, "isl": int(isl), "osl": int(osl)}
    if ident.router is not None:
        data["router"] = dict(ident.router)
    if ident.kv_p2p_transfer:
        data["kv_p2p_transfer"] = ident.kv_p2p_transfer
    total = float(raw["total_token_throughput"])
    output = float(raw["output_throughput"])
    if ident.disagg:
        if ident.decode_gpus < 0 or min(ident.prefill_workers, ident.decode_workers) < 1:
            raise BenchmarkError("decode GPUs must be >= 0 and worker counts >= 1")
        all_gpus = ident.prefill_gpus + ident.decode_gpus
        has_decode = ident.decode_gpus > 0
        data.update({
            "is_multinode": True,
            "prefill_tp": ident.prefill_tp or ident.prefill_gpus // ident.prefill_workers,
            "prefill_pp": 1, "prefill_dcp_size": 1, "prefill_pcp_size": 1,
            "prefill_ep": ident.prefill_ep, "prefill_dp_attention": ident.prefill_dp_attention,
            "prefill_num_workers": ident.prefill_workers,
            "decode_tp": (ident.decode_tp or ident.decode_gpus // ident.decode_workers)
            if has_decode else 0,
            "decode_pp": 1, "decode_dcp_size": 1, "decode_pcp_size": 1,
            "decode_ep": ident.decode_ep if has_decode else 0,
            "decode_dp_attention": ident.decode_dp_attention,
            "decode_num_workers": ident.decode_workers,
            "num_prefill_gpu": ident.prefill_gpus, "num_decode_gpu": ident.decode_gpus,
            "tput_per_gpu": total / all_gpus,
            "output_tput_per_gpu": output / (ident.decode_gpus if has_decode else all_gpus),
            "input_tput_per_gpu": (total - output) / ident.prefill_gpus,
        })
    else:
        if min(ident.tp, ident.pp, ident.dcp, ident.pcp, ident.ep) < 1:
            raise BenchmarkError("tp, pp, dcp, pcp and ep must be >= 1")
        gpus = ident.tp * ident.pp * ident.pcp
        data.update({
            "is_multinode": False, "tp": ident.tp, "pp": ident.pp, "dcp_size": ident.dcp,
            "pcp_size": ident.pcp, "ep": ident.ep, "dp_attention": ident.dp_attention,
            "tput_per_gpu": total / gpus, "output_tput_per_gpu": output / gpus,
            "input_tput_per_gpu": (total - output) / gpus,
        })
    for key, value in raw.items():
        if key.endswith("ms"):
            data[key.replace("_ms", "")] = float(value) / 1000.0
        if "tpot" in key:
            # Deviation: upstream divides by zero (crash) for a 0 ms statistic; we write null.
            v = float(value)
            data[key.replace("_ms", "").replace("tpot", "intvty")] = 1000.0 / v if v else None
    return data


# ----------------------------------------------------------------------------------------------
# Server readiness, files


async def wait_ready(base_url: str, timeout_s: float) -> None:
    """Poll GET /health until 200 (InferenceX's server scripts do the same before the client)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            try:
                async with session.get(f"{base_url}/health") as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = repr(e)
            if time.monotonic() >= deadline:
                raise BenchmarkError(f"{base_url}/health not ready after {timeout_s:.0f} s ({last})")
            await asyncio.sleep(0.5)


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
