"""The grammar spec of a decode request (handoff/structured.py): its wire form, its refusals, and
that it reads a request as vLLM's xgrammar backend does (the unsupported-schema check, the choice
grammar, Lark vs EBNF), checked against vLLM's own functions."""
import pytest

from nexrt_vllm.handoff.structured import LOGPROBS_MAX, StructuredError, StructuredSpec, check_logprobs
from nexrt_vllm.testing.schemas import fuzz_schemas

UNSUPPORTED = [
    {"type": "number", "multipleOf": 2},
    {"type": ["integer", "null"], "multipleOf": 3},
    {"type": "array", "uniqueItems": True},
    {"type": "array", "contains": {"type": "integer"}},
    {"type": "array", "minContains": 1},
    {"type": "string", "format": "phone"},
    {"type": "string", "pattern": "^a+$", "maxLength": 3},
    {"type": "string", "format": "email", "minLength": 3},
    {"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 2}},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {"a": {}}},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "patternProperties": {"^a": {}}},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "unevaluatedProperties": False},
    {"type": "object", "patternProperties": {"^a": {}}, "properties": {"a": {}}},
    {"type": "object", "patternProperties": {"^a": {}, "^b": {}}},
    {"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]},
    {"type": "object", "properties": {"deep": {"type": "array", "items": {"type": "number", "multipleOf": 0.5}}}},
]
SUPPORTED = fuzz_schemas(20, seed=3) + [
    {"type": "string", "format": "email"}, {"type": "string", "pattern": "^[a-z]+$"},
    {"type": "string", "minLength": 2, "maxLength": 5}, {"allOf": [{"type": "string"}]},
    {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
    {"type": "object", "propertyNames": {"pattern": "^a"}}, {"type": "array", "items": {"type": "number"}, "maxItems": 2},
]


@pytest.mark.parametrize("schema", UNSUPPORTED + SUPPORTED)
def test_unsupported_json_features_mirror_vllm(schema):
    from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    why = StructuredSpec("json_schema", schema).unsupported()
    assert (why is not None) == has_xgrammar_unsupported_json_features(schema), why
    assert why is None or why.startswith("json_schema: ")


def test_unsupported_names_the_feature_and_where():
    why = StructuredSpec("json_schema", UNSUPPORTED[-1]).unsupported()
    assert why == "json_schema: multipleOf on a number is not supported (at $.properties.deep.items)"
    deep = {"type": "array", "items": {}}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    assert "nests objects and arrays more than 64 levels" in StructuredSpec("json_schema", deep).unsupported()
    assert StructuredSpec("regex", "a\x00b").unsupported() == "regex must not contain a NUL character"


@pytest.mark.parametrize("choice", [["yes", "no"], ['say "hi"', "back\\slash", "tab\tand\nnewline", "\x01ctl"]])
def test_choice_grammar_is_vllms(choice):
    from vllm.v1.structured_output.utils import choice_as_grammar

    assert StructuredSpec("choice", choice).grammar_text() == choice_as_grammar(choice)


@pytest.mark.parametrize("grammar", ['root ::= "a" | "b"', 'start: "a" | "b"', "# comment ::= x\nstart: NAME",
                                     "// x\nroot ::= [0-9]+", "?start: value\nvalue: /[0-9]+/"])
def test_lark_detection_is_vllms(grammar):
    from vllm.v1.structured_output.utils import grammar_is_likely_lark

    assert StructuredSpec("grammar", grammar).is_lark == grammar_is_likely_lark(grammar)


@pytest.mark.parametrize("wire", [
    {"type": "json_schema", "value": {"type": "object", "properties": {"b": {}, "a": {}}}},
    {"type": "json_object"}, {"type": "regex", "value": "[0-9]+"}, {"type": "choice", "value": ["x", "y"]},
    {"type": "grammar", "value": 'root ::= "x"'}])
def test_wire_round_trip(wire):
    spec = StructuredSpec.from_wire(wire)
    assert spec.to_wire() == wire and StructuredSpec.from_wire(spec.to_wire()) == spec
    assert spec.key == StructuredSpec.from_wire(wire).key


def test_json_schema_as_text_and_key_keeps_property_order():
    a = StructuredSpec("json_schema", '{"properties": {"b": {}, "a": {}}}')
    assert a.value == {"properties": {"b": {}, "a": {}}}
    assert a.key != StructuredSpec("json_schema", {"properties": {"a": {}, "b": {}}}).key  # xgrammar keeps the order


@pytest.mark.parametrize("wire,text", [
    ([], "structured must be an object"),
    ({"type": "yaml", "value": "a: 1"}, "structured.type 'yaml' is not supported"),
    ({"type": "json_schema", "value": "{not json"}, "structured.value is not valid JSON"),
    ({"type": "json_schema", "value": [1]}, "must be a JSON schema object"),
    ({"type": "json_object", "value": {}}, "must be absent for json_object"),
    ({"type": "choice", "value": []}, "non-empty list of strings"),
    ({"type": "choice", "value": ["a", 1]}, "non-empty list of strings"),
    ({"type": "regex", "value": ""}, "must be a non-empty string"),
    ({"type": "grammar", "value": 3}, "must be a non-empty string"),
    ({"type": "regex", "value": "a", "strict": True}, "unknown fields ['strict']"),
])
def test_malformed_specs_are_named(wire, text):
    with pytest.raises(StructuredError, match=text.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        StructuredSpec.from_wire(wire)


def test_logprobs_bounds():
    assert check_logprobs(None) is None and check_logprobs(0) == 0 and check_logprobs(LOGPROBS_MAX) == 20
    for bad in (-1, 21, 1.5, True, "3"):
        with pytest.raises(StructuredError, match=r"logprobs must be null or an integer in \[0, 20\]"):
            check_logprobs(bad)
