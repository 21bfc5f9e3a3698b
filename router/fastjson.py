"""JSON on the router's request path: orjson where it is installed (vLLM's environment has it), else the
standard library.

An agent's turn can carry its whole context as token ids: at 64K tokens ~400 KB of JSON that the router
reads from the client, writes into the vLLM leg's body, and reads back from vLLM's answer (which returns
the prompt's ids). On the event loop that is three passes of 3-7 ms each with the standard library on a
CI core, under 2 ms each with orjson (benchmarks/router_bench.py --prompt-tokens).

Reading: what orjson refuses (NaN, Infinity, a number beyond a double) is read by the standard library,
as before. Integers beyond 64 bits are read as floats by orjson; every field the router checks refuses
them either way (400), and vLLM does for the fields it passes through. Writing: what orjson cannot write
(integers beyond 64 bits, keys that are not strings) is written by the standard library; a NaN, which
only the standard library reads, orjson writes as null.
"""
from __future__ import annotations

import json

try:
    import orjson
except ImportError:  # the standard library alone: the same values, slower on large bodies
    orjson = None


def loads(raw: bytes | str):
    """The value of a JSON text; ValueError (json.JSONDecodeError) when it is not JSON."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the standard library's reading decides (NaN, Infinity, or the error it raises)
    return json.loads(raw)


def dumps(obj) -> str:
    """`obj` as compact JSON text (the body aiohttp sends for `json=`)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj).decode()
        except TypeError:
            pass
    return json.dumps(obj, separators=(",", ":"))
