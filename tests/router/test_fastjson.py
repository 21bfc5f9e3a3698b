"""The router's JSON (router/fastjson.py): with orjson and without it, every text reads as the standard
library reads it (NaN, Infinity and huge exponents too, falling back to it), except integers beyond 64
bits, which orjson reads as floats; every value writes to text that reads back equal (integers beyond
64 bits and non-string keys through the standard library); what is not JSON raises ValueError."""
import json
import math

import pytest

from nexrt_vllm.router import fastjson

TEXTS = [b'{"model":"m","prompt":[1,2,3],"max_tokens":16,"temperature":0.7,"stop":["\\n"]}',
         '{"messages":[{"role":"user","content":"h\u00e9llo \\ud83d\\ude00"}],"seed":9223372036854775807}'.encode(),
         b'[]', b'"x"', b'null', b'{"a":1,"a":2}', b' {"n": -0.0, "e": 1e-7, "u": 18446744073709551615} ',
         b'{"t": NaN, "i": Infinity, "x": -Infinity}', b'[1e400]']


@pytest.fixture(params=["orjson", "stdlib"])
def mode(request, monkeypatch):
    if request.param == "orjson":
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(fastjson, "orjson", None)
    return request.param


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("text", TEXTS)
def test_reads_as_the_standard_library(mode, text):
    assert same(fastjson.loads(text), json.loads(text))
    assert same(fastjson.loads(text.decode()), json.loads(text))


def test_integers_beyond_64_bits(mode):
    got = fastjson.loads(b'{"seed": 123456789012345678901234567890}')["seed"]
    assert got == 123456789012345678901234567890 if mode == "stdlib" else got == pytest.approx(1.2345678901234568e29)
    for v in ({"seed": 2 ** 70}, {1: "a"}, {"x": [2 ** 64, -(2 ** 65)]}):  # written by the standard library
        assert json.loads(fastjson.dumps(v)) == json.loads(json.dumps(v))


@pytest.mark.parametrize("bad", [b"", b"{", b'{"a":}', b"[1,]", b"\xff\xfe", b"nul"])
def test_not_json_raises_value_error(mode, bad):
    with pytest.raises(ValueError):
        fastjson.loads(bad)


def test_writes_what_reads_back(mode):
    body = {"prompt": list(range(70000)), "kv_transfer_params": {"nexrt": {"rid": "r-1", "gen": 3}},
            "temperature": 0.0, "stop": ["</s>", "\u00e9"], "logit_bias": {"17": -100}}
    text = fastjson.dumps(body)
    assert isinstance(text, str) and json.loads(text) == body and " " not in text[:50]
