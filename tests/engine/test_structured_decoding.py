"""Grammar-constrained decoding and logprobs on the eager engine (`Engine.steps`).

Every answer to a fuzzed set of 24 JSON schemas (enums, nested objects, arrays, integers,
numbers, booleans, bounded strings, consts, anyOf) parses and validates against its schema, as the
tokenizer decodes it and as xgrammar's own token bytes spell it; regex, choice, EBNF, Lark and
json_object constraints hold too. Logprobs are log_softmax of the step's logits after the mask.
"""
import json
import re

import jsonschema
import pytest
import torch

from nexrt_vllm.engine import Engine, InputError, SamplingParams, SamplingParamsError
from nexrt_vllm.engine.structured import Grammars, apply_mask
from nexrt_vllm.handoff.structured import StructuredError, StructuredSpec
from nexrt_vllm.testing.schemas import fuzz_schemas

torch.set_num_threads(1)
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def env(qwen3_5_ckpt):
    from transformers import AutoTokenizer

    eng = Engine.from_pretrained(qwen3_5_ckpt, device="cpu", dtype="float32", max_seq_len=512, progress=False)
    return eng, Grammars(qwen3_5_ckpt, eng.config.vocab_size), AutoTokenizer.from_pretrained(qwen3_5_ckpt)


def answer(env, spec: StructuredSpec, prompt, **sampling):
    """The first token as vLLM picks it (argmax / sample of the masked prefill logits), then the
    engine's constrained continuation; -> (token ids, finish_reason, records)."""
    eng, grammars, _ = env
    c = grammars.constraint(grammars.compile(spec), eng.config.eos_token_ids)
    first = int(apply_mask(eng.prefill(prompt), c.fill()).argmax())
    recs = list(eng.steps(first, SamplingParams(max_tokens=MAX_TOKENS, **sampling), c))
    return [first] + [r.token for r in recs], eng.finish_reason, recs


def texts(env, ids):
    eng, grammars, tok = env
    body = [t for t in ids if t not in eng.config.eos_token_ids]
    raw = b"".join(grammars.info.decoded_vocab[t] for t in body).decode()
    return tok.decode(body), raw


@pytest.mark.parametrize("i", range(24))
def test_fuzzed_schema_answers_validate(env, i):
    schema = fuzz_schemas(24, seed=7)[i]
    ids, why, _ = answer(env, StructuredSpec("json_schema", schema), [5 + i, 17, 3, 99, 42, 7 + i])
    assert why == "stop" and ids[-1] in env[0].config.eos_token_ids, (why, len(ids))
    for text in texts(env, ids):
        jsonschema.validate(json.loads(text), schema)


def test_fuzzed_set_covers_the_schema_features():
    blob = json.dumps(fuzz_schemas(24, seed=7))
    for feature in ('"enum"', '"type": "array"', '"type": "number"', '"type": "integer"', '"type": "boolean"',
                    '"maxLength"', '"anyOf"', '"const"', '"required"'):
        assert feature in blob, feature
    nested = [s for s in fuzz_schemas(24, seed=7) if '"type": "object"' in json.dumps(s["properties"])]
    assert len(nested) >= 5


@pytest.mark.parametrize("spec,check", [
    (StructuredSpec("regex", "[a-f]{2,4}-[0-9]{1,3}"), lambda t: re.fullmatch(r"[a-f]{2,4}-[0-9]{1,3}", t)),
    (StructuredSpec("choice", ["alpha", "beta", "gamma"]), lambda t: t in ("alpha", "beta", "gamma")),
    (StructuredSpec("grammar", 'root ::= "x" [0-9] [0-9]? ("!" | "?")'), lambda t: re.fullmatch(r"x[0-9]{1,2}[!?]", t)),
    (StructuredSpec("grammar", 'start: "ab" NUM\nNUM: /[0-9]{2}/'), lambda t: re.fullmatch(r"ab[0-9]{2}", t)),
    (StructuredSpec("json_object"), lambda t: isinstance(json.loads(t), dict)),
])
def test_other_grammars_hold(env, spec, check):
    ids, why, _ = answer(env, spec, [9, 8, 7, 6])
    _, raw = texts(env, ids)
    assert why == "stop" and ids[-1] in env[0].config.eos_token_ids
    assert check(raw), raw


def test_sampled_answers_obey_the_grammar(env):
    schema = fuzz_schemas(3, seed=11)[1]
    for seed in range(3):
        ids, why, _ = answer(env, StructuredSpec("json_schema", schema), [4, 5, 6], temperature=1.0, seed=seed)
        assert why == "stop"
        jsonschema.validate(json.loads(texts(env, ids)[1]), schema)


def test_logprobs_are_the_masked_log_softmax(env):
    """Each step's logprobs = log_softmax(masked logits): the chosen token's value and the top 5,
    forbidden tokens never listed, the allowed ones summing to probability one."""
    eng, grammars, _ = env
    spec = StructuredSpec("json_schema", {"type": "object", "properties": {"v": {"enum": ["ab", "cd", "ef"]}},
                                          "required": ["v"]})
    prompt = [11, 12, 13]
    ids, _, recs = answer(env, spec, prompt, logprobs=5)
    # replay teacher-forced on the eager model, masking by hand
    c = grammars.constraint(grammars.compile(spec), eng.config.eos_token_ids)
    eng.prefill(prompt)
    c.accept(ids[0])
    for tok, rec in zip(ids[:-1], recs):
        ref = torch.log_softmax(apply_mask(eng.decode_step(tok), c.fill()), -1)
        assert rec.logprob == pytest.approx(float(ref[rec.token]), abs=1e-5)
        finite = int(torch.isfinite(ref).sum())
        assert len(rec.top) == min(5, finite)
        assert [i for i, _ in rec.top] == torch.sort(ref, descending=True, stable=True).indices[:len(rec.top)].tolist()
        c.accept(rec.token)
    assert any(len(r.top) == 1 for r in recs)  # forced tokens: the only allowed one, logprob 0
    assert all(r.logprob == 0.0 for r in recs if len(r.top) == 1)


def test_unconstrained_logprobs(env):
    """Without a grammar: logprobs do not change the tokens; greedy picks the top alternative."""
    eng, _, _ = env
    first = int(eng.prefill([3, 4, 5]).argmax())
    n0, snap = eng.export_state()
    recs = list(eng.steps(first, SamplingParams(max_tokens=5, logprobs=20, ignore_eos=True)))
    eng.import_state(n0, snap)
    plain = list(eng.stream(first, SamplingParams(max_tokens=5, ignore_eos=True)))
    assert [r.token for r in recs] == plain
    assert all(len(r.top) == 20 and r.top[0] == (r.token, r.logprob) and r.logprob < 0 for r in recs)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "5"])
def test_logprobs_out_of_range(bad):
    with pytest.raises(SamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_first_token_outside_the_grammar(env):
    eng, grammars, _ = env
    c = grammars.constraint(grammars.compile(StructuredSpec("regex", "[0-9]+")), eng.config.eos_token_ids)
    eng.prefill([1, 2, 3])
    letter = grammars.info.decoded_vocab.index(b"a")
    with pytest.raises(InputError, match="not allowed by the grammar"):
        eng.steps(letter, SamplingParams(max_tokens=4), c)


@pytest.mark.parametrize("spec,why", [
    (StructuredSpec("json_schema", {"type": "integer", "multipleOf": 3}), "multipleOf"),
    (StructuredSpec("json_schema", {"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredSpec("json_schema", {"type": "string", "format": "credit-card"}), "format 'credit-card'"),
    (StructuredSpec("json_schema", {"allOf": [{"type": "string"}, {"enum": ["a"]}]}), "allOf"),
    (StructuredSpec("regex", "[a-"), "regex does not compile"),
    (StructuredSpec("grammar", "root ::= undefined_rule"), "grammar does not compile"),
])
def test_unsupported_or_broken_grammars_are_refused(env, spec, why):
    with pytest.raises(StructuredError, match=re.escape(why)):
        env[1].compile(spec)
