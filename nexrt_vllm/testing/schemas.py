"""Fuzzed JSON schemas for structured-output tests: enums, nested objects, arrays, integers,
numbers, booleans, strings, consts and anyOf, each bounded (string lengths, integer ranges, array
sizes) so any model's constrained answer ends within a few hundred tokens.

Strings and enum values use letters and digits only: the tiny checkpoints' tokenizer spells a
space as part of a word token (Metaspace), never as a character of its own.
"""
from __future__ import annotations

import random
import string

_WORDS = ["red", "green", "blue", "ok", "no", "yes", "alpha", "beta", "x1", "z9", "cat", "dog"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["enum", "integer", "number", "boolean", "string", "const", "enum_mixed"])
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}
    if kind == "enum_mixed":
        return {"enum": [rng.choice(_WORDS), rng.randint(0, 99), True, None][:rng.randint(2, 4)]}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "const":
        return {"const": rng.choice(_WORDS)}
    return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}


def _node(rng: random.Random, depth: int) -> dict:
    r = rng.random()
    if depth >= 3 or r < 0.4:
        return _leaf(rng)
    if r < 0.65:
        lo = rng.randint(0, 1)
        return {"type": "array", "items": _node(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(1, 3)}
    if r < 0.72:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    return _object(rng, depth)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample([c for c in string.ascii_lowercase], rng.randint(1, 4))
    props = {n * rng.randint(1, 3): _node(rng, depth + 1) for n in names}
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required}


def fuzz_schemas(n: int, seed: int = 0) -> list[dict]:
    """`n` schemas, each an object at the top (as response_format json_schema requires)."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]


__all__ = ["fuzz_schemas"]
