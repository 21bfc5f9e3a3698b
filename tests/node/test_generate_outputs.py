"""/v1/generate with logprobs and a grammar, on a real `nexrt-decode` process fed by the engine's own
prefill (testing.node_process.PrefillSide).

The node's NDJSON lines carry each token's logprob and top alternatives; they, and the tokens of a
constrained request, equal what the prefill side's engine (same checkpoint, same dtype) computes
for the same request. Refusals come before the stream, with a 400 naming the problem, and leave
the admission (and the slot) as they were. /capabilities lists what is supported.
"""
import json

import pytest
import torch

from nexrt_vllm.engine import SamplingParams
from nexrt_vllm.engine.structured import Grammars, apply_mask
from nexrt_vllm.handoff.structured import StructuredSpec
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

torch.set_num_threads(1)
PROMPT = [5, 17, 3, 99, 42, 7, 11, 23]
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 500},
                                           "kind": {"enum": ["cat", "dog"]},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                    "maxItems": 2}},
          "required": ["id", "kind"]}
JSON = {"type": "json_schema", "value": SCHEMA}


@pytest.fixture(scope="module")
def node(qwen3_5_ckpt):
    n = NodeProcess(qwen3_5_ckpt, "mooncake", max_seq_len=256)
    yield n
    assert n.wait_free()["busy_slots"] == 0
    n.stop()


@pytest.fixture(scope="module")
def side(qwen3_5_ckpt):
    s = PrefillSide(qwen3_5_ckpt, "mooncake", max_seq_len=256)
    s.grammars = Grammars(qwen3_5_ckpt, s.engine.config.vocab_size)
    yield s
    s.close()


def _lines(node, rid, gen, first, max_tokens, **kw):
    with node.open_generate(rid, gen, first, max_tokens, **kw) as r:
        return [json.loads(x) for x in r if x.strip()]


def _reference(side, prep, spec, params):
    """vLLM's part played by the engine: the first token (masked argmax with a grammar), then the
    engine's own continuation of the request from the same state."""
    eng = side.engine
    logits = eng.prefill(PROMPT)
    c = None
    if spec is not None:
        c = side.grammars.constraint(side.grammars.compile(StructuredSpec.from_wire(spec)),
                                     set(params.stop_token_ids) | set(eng.config.eos_token_ids))
        logits = apply_mask(logits, c.fill())
    first = int(logits.argmax())
    return first, list(eng.steps(first, params, c)), eng.finish_reason


def _run(node, side, rid, spec=None, at_admit=False, max_tokens=24, **kw):
    prep = side.prepare(PROMPT)
    first, want, why = _reference(side, prep, spec, SamplingParams(max_tokens=max_tokens, **kw))
    adm = node.admit(rid, **({"structured": spec} if at_admit else {}))
    side.send(node, rid, adm["generation"], prep)
    extra = {} if at_admit or spec is None else {"structured": spec}
    lines = _lines(node, rid, adm["generation"], first, max_tokens, **kw, **extra)
    return first, want, why, lines


@pytest.mark.parametrize("k", [0, 5, 20])
def test_logprobs_lines_equal_the_engine(node, side, k):
    _, want, why, lines = _run(node, side, f"lp-{k}", logprobs=k, ignore_eos=True, max_tokens=8)
    assert lines[-1]["finish_reason"] == why == "length"
    assert [x["token"] for x in lines[:-1]] == [r.token for r in want]
    for x, r in zip(lines[:-1], want):
        assert x["logprob"] == pytest.approx(r.logprob, abs=1e-6)
        assert [i for i, _ in x["top_logprobs"]] == [i for i, _ in r.top] and len(r.top) == k
        assert [v for _, v in x["top_logprobs"]] == pytest.approx([v for _, v in r.top], abs=1e-6)


def test_no_logprobs_fields_unless_asked(node, side):
    _, want, _, lines = _run(node, side, "plain", ignore_eos=True, max_tokens=4)
    assert lines[:-1] == [{"token": r.token} for r in want]


@pytest.mark.parametrize("at_admit", [False, True])
def test_json_schema_tokens_equal_the_engine(node, side, at_admit):
    first, want, why, lines = _run(node, side, f"json-{at_admit}", JSON, at_admit=at_admit, max_tokens=80, logprobs=3)
    toks = [x["token"] for x in lines[:-1]]
    assert toks == [r.token for r in want] and lines[-1]["finish_reason"] == why == "stop"
    assert [x["logprob"] for x in lines[:-1]] == pytest.approx([r.logprob for r in want], abs=1e-6)
    text = b"".join(side.grammars.info.decoded_vocab[t] for t in [first] + toks[:-1]).decode()
    obj = json.loads(text)
    assert obj["kind"] in ("cat", "dog") and 0 <= obj["id"] <= 500


@pytest.mark.parametrize("spec", [{"type": "regex", "value": "[a-z]{2}[0-9]{2,3}"},
                                  {"type": "choice", "value": ["north", "south", "east"]},
                                  {"type": "grammar", "value": 'root ::= ("yes" | "no") "."'},
                                  {"type": "json_object"}])
def test_other_grammars_equal_the_engine(node, side, spec):
    _, want, why, lines = _run(node, side, f"g-{spec['type']}", spec, max_tokens=40)
    assert [x["token"] for x in lines[:-1]] == [r.token for r in want] and lines[-1]["finish_reason"] == why


def _refused(node, side, rid, admit_kw=None, **gen):
    """Admit + hand off, then a refused generate; afterwards the same admission still decodes (or,
    admitted with a grammar, is cancelled)."""
    prep = side.prepare(PROMPT)
    adm = node.admit(rid, **(admit_kw or {}))
    side.send(node, rid, adm["generation"], prep)
    body = {"rid": rid, "generation": adm["generation"], "first_token": prep["first"], "max_tokens": 4, **gen}
    status, err = node.call("POST", "/v1/generate", body)
    if admit_kw:
        assert node.call("POST", "/v1/cancel", {"rid": rid})[1]["state"] == "ready"
    else:
        ok = _lines(node, rid, adm["generation"], prep["first"], 3, ignore_eos=True)
        assert ok[-1]["finish_reason"] == "length" and len(ok) == 3
    return status, err["error"]


@pytest.mark.parametrize("gen,kind,text", [
    ({"logprobs": 21}, "bad_message", "logprobs must be"),
    ({"logprobs": -1}, "bad_message", "logprobs must be"),
    ({"structured": {"type": "xml", "value": "<a/>"}}, "bad_message", "structured.type 'xml' is not supported"),
    ({"structured": {"type": "regex"}}, "bad_message", "must be a non-empty string"),
    ({"structured": {"type": "json_schema", "value": {"type": "number", "multipleOf": 0.5}}}, "unsupported",
     "multipleOf on a number is not supported (at $)"),
    ({"structured": {"type": "json_schema", "value": {"type": "object", "properties": {
        "a": {"type": "array", "contains": {"type": "integer"}}}}}}, "unsupported",
     "contains on an array is not supported (at $.properties.a)"),
    ({"structured": {"type": "regex", "value": "(ab"}}, "unsupported", "regex does not compile"),
])
def test_generate_refusals(node, side, gen, kind, text, request):
    status, err = _refused(node, side, request.node.callspec.id, **gen)
    assert status == 400 and err["type"] == kind and text in err["message"], (status, err)


def test_first_token_outside_the_grammar(node, side):
    letter = side.grammars.info.decoded_vocab.index(b"q")
    prep = side.prepare(PROMPT)
    adm = node.admit("first-bad")
    side.send(node, "first-bad", adm["generation"], prep)
    status, body = node.call("POST", "/v1/generate", {"rid": "first-bad", "generation": adm["generation"],
                                                      "first_token": letter, "max_tokens": 4, "structured": JSON})
    assert status == 400 and f"first_token {letter} is not allowed by the json_schema grammar" in body["error"]["message"]
    assert node.call("POST", "/v1/cancel", {"rid": "first-bad"})[0] == 200


def test_admit_refuses_unsupported_before_taking_the_slot(node):
    status, body = node.call("POST", "/v1/admit", {"rid": "adm-bad", "structured": {
        "type": "json_schema", "value": {"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {}}}})
    assert status == 400 and body["error"]["type"] == "unsupported" and "propertyNames" in body["error"]["message"]
    assert node.health()["busy_slots"] == 0


def test_generate_must_repeat_the_admitted_grammar(node, side):
    status, err = _refused(node, side, "mismatch", admit_kw={"structured": JSON},
                           structured={"type": "regex", "value": "[0-9]+"})
    assert status == 400 and "differs from the one given at admit" in err["message"]


def test_capabilities(node):
    caps = node.call("GET", "/capabilities")[1]
    assert caps["sampling"]["logprobs"] is True and caps["sampling"]["max_logprobs"] == 20
    assert caps["sampling"]["logprobs_mode"] == "raw_logprobs"
    so = caps["structured_output"]
    assert so["types"] == ["json_schema", "json_object", "regex", "choice", "grammar"] and so["backend"] == "xgrammar"


def test_node_without_structured_output(qwen3_5_ckpt):
    n = NodeProcess(qwen3_5_ckpt, "mooncake", "--no-structured", max_seq_len=64)
    try:
        so = n.call("GET", "/capabilities")[1]["structured_output"]
        assert so["types"] == [] and "--no-structured" in so["reason"]
        status, body = n.call("POST", "/v1/admit", {"rid": "x", "structured": {"type": "json_object"}})
        assert status == 400 and body["error"]["type"] == "unsupported" and "--no-structured" in body["error"]["message"]
    finally:
        n.stop()
