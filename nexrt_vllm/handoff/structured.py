"""Per-token output options of a decode request that the router and the node share: how many
logprobs the node returns, and the grammar that constrains the tokens (structured output).

A grammar spec travels in ``/v1/admit`` and ``/v1/generate`` as
``{"structured": {"type": T, "value": V}}``:

===============  ============================================  =====================================
type             value                                         vLLM's equivalent
===============  ============================================  =====================================
``json_schema``  a JSON schema (object, or its JSON text)      ``structured_outputs.json`` /
                                                               ``response_format`` json_schema
``json_object``  absent                                        ``structured_outputs.json_object`` /
                                                               ``response_format`` json_object
``regex``        a regular expression                          ``structured_outputs.regex``
``choice``       a non-empty list of strings                   ``structured_outputs.choice``
``grammar``      an EBNF (GBNF) or Lark grammar                ``structured_outputs.grammar``
===============  ============================================  =====================================

The node compiles it with xgrammar exactly as vLLM's xgrammar backend does (same JSON-schema
options, the choice list turned into the same EBNF, Lark told apart from EBNF the same way), so
the first token vLLM samples under the constraint and the node's continuation obey one grammar.
``unsupported`` names what xgrammar cannot do — the cases where vLLM's ``auto`` backend would
switch to another library, which would break that equality — so the router can refuse a request
with a 400 before prefill.

Pure Python (no torch, no xgrammar): the router imports it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

LOGPROBS_MAX = 20  # top alternatives per token, as vLLM's default max_logprobs
LOGPROB_FLOOR = -9999.0  # what a masked token's -inf logprob is sent as (vLLM's OpenAI layer does the same)
STRUCTURED_TYPES = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_JSON_NESTING = 64  # vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING
# String formats xgrammar's JSON-schema converter implements (vLLM's STRING_SUPPORTED_FORMATS).
STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                            "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


class StructuredError(ValueError):
    """A grammar spec that is malformed or that the node cannot enforce; the message names why."""


def check_logprobs(v: Any) -> int | None:
    """``logprobs`` of a decode request: None (off) or the number of top alternatives, 0..20."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= LOGPROBS_MAX:
        raise StructuredError(f"logprobs must be null or an integer in [0, {LOGPROBS_MAX}], got {v!r}")
    return v


@dataclass(frozen=True)
class StructuredSpec:
    """One grammar constraint; constructing it validates the form (not the grammar's syntax,
    which only the compiler can check)."""

    type: str
    value: Any = None

    def __post_init__(self):
        t, v = self.type, self.value
        if t not in STRUCTURED_TYPES:
            raise StructuredError(f"structured.type {t!r} is not supported; supported: {list(STRUCTURED_TYPES)}")
        if t == "json_schema":
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as e:
                    raise StructuredError(f"structured.value is not valid JSON: {e}") from None
            if not isinstance(v, dict):
                raise StructuredError("structured.value of a json_schema must be a JSON schema object")
            object.__setattr__(self, "value", v)
        elif t == "json_object":
            if v is not None:
                raise StructuredError("structured.value must be absent for json_object")
        elif t == "choice":
            if not isinstance(v, (list, tuple)) or not v or not all(isinstance(c, str) for c in v):
                raise StructuredError("structured.value of a choice must be a non-empty list of strings")
            object.__setattr__(self, "value", tuple(v))
        elif not isinstance(v, str) or not v:
            raise StructuredError(f"structured.value of a {t} must be a non-empty string")

    @property
    def key(self) -> tuple[str, str]:
        """(type, text): equal keys compile to the same grammar (property order matters in JSON)."""
        if self.type == "json_schema":
            return self.type, json.dumps(self.value)
        if self.type == "choice":
            return self.type, json.dumps(list(self.value))
        return self.type, self.value or ""

    def to_wire(self) -> dict:
        if self.type == "json_object":
            return {"type": self.type}
        return {"type": self.type, "value": list(self.value) if self.type == "choice" else self.value}

    @classmethod
    def from_wire(cls, d: Any) -> "StructuredSpec | None":
        if d is None:
            return None
        if not isinstance(d, dict):
            raise StructuredError("structured must be an object {\"type\", \"value\"}")
        extra = sorted(set(d) - {"type", "value"})
        if extra:
            raise StructuredError(f"structured has unknown fields {extra}")
        return cls(d.get("type"), d.get("value"))

    def unsupported(self) -> str | None:
        """Why xgrammar (and so the node) cannot enforce this spec, or None. Mirrors vLLM's
        xgrammar validation (``has_xgrammar_unsupported_json_features``, the nesting limit and
        the NUL check on regexes); syntax errors surface when the node compiles the grammar."""
        if self.type == "json_schema":
            if _nesting_exceeds(self.value, MAX_JSON_NESTING):
                return f"json_schema nests objects and arrays more than {MAX_JSON_NESTING} levels deep"
            return _unsupported_json(self.value, "$")
        if self.type == "regex" and "\x00" in self.value:
            return "regex must not contain a NUL character"
        return None

    def grammar_text(self) -> str | None:
        """The EBNF a choice compiles to (vLLM's ``choice_as_grammar``); None for other types."""
        if self.type != "choice":
            return None
        return "root ::= " + " | ".join(f'"{_escape_ebnf(c)}"' for c in self.value)

    @property
    def is_lark(self) -> bool:
        """A ``grammar`` value in Lark syntax rather than EBNF (vLLM's ``grammar_is_likely_lark``)."""
        if self.type != "grammar":
            return False
        for line in self.value.split("\n"):
            line = re.sub(r"(#|//).*$", "", line).strip()
            if line and "::=" in line:
                return False
        return True


def _escape_ebnf(s: str) -> str:
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
    return "".join(escapes.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
                   for ch in s)


def _nesting_exceeds(spec: Any, limit: int) -> bool:
    level = [spec]
    for _ in range(limit):
        level = [c for n in level if isinstance(n, (dict, list))
                 for c in (n.values() if isinstance(n, dict) else n) if isinstance(c, (dict, list))]
        if not level:
            return False
    return True


def _types(obj: dict) -> set[str]:
    t = obj.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _pattern_and_length(obj: Any) -> bool:
    return isinstance(obj, dict) and ("pattern" in obj or "format" in obj) and ("minLength" in obj
                                                                                   or "maxLength" in obj)


def _unsupported_json(obj: Any, where: str) -> str | None:
    """The first schema feature xgrammar does not implement, named with its JSON path."""
    if not isinstance(obj, dict):
        return None
    types = _types(obj)
    if types & {"integer", "number"} and "multipleOf" in obj:
        return f"json_schema: multipleOf on a number is not supported (at {where})"
    if "array" in types:
        for k in ("uniqueItems", "contains", "minContains", "maxContains"):
            if k in obj:
                return f"json_schema: {k} on an array is not supported (at {where})"
    if "string" in types:
        if "format" in obj and obj["format"] not in STRING_FORMATS:
            return f"json_schema: string format {obj['format']!r} is not supported (at {where})"
        if _pattern_and_length(obj):
            return f"json_schema: pattern/format together with minLength/maxLength is not supported (at {where})"
    if "object" in types and "propertyNames" in obj:
        if _pattern_and_length(obj.get("propertyNames")):
            return f"json_schema: propertyNames with a pattern and a length bound is not supported (at {where})"
        for k in ("patternProperties", "properties"):
            if k in obj:
                return f"json_schema: propertyNames together with {k} is not supported (at {where})"
        if obj.get("unevaluatedProperties", True) is not True:
            return f"json_schema: propertyNames together with unevaluatedProperties is not supported (at {where})"
    if "object" in types and isinstance(obj.get("patternProperties"), dict):
        if "properties" in obj:
            return f"json_schema: patternProperties together with properties is not supported (at {where})"
        if len(obj["patternProperties"]) > 1:
            return f"json_schema: more than one patternProperties entry is not supported (at {where})"
    if isinstance(obj.get("allOf"), list) and len(obj["allOf"]) >= 2:
        return f"json_schema: allOf with several branches is not supported (at {where})"
    for k, v in obj.items():
        if isinstance(v, dict):
            why = _unsupported_json(v, f"{where}.{k}")
        elif isinstance(v, list):
            why = next((w for i, x in enumerate(v) if (w := _unsupported_json(x, f"{where}.{k}[{i}]"))), None)
        else:
            why = None
        if why:
            return why
    return None


__all__ = ["LOGPROBS_MAX", "LOGPROB_FLOOR", "MAX_JSON_NESTING", "STRUCTURED_TYPES", "StructuredError",
           "StructuredSpec", "check_logprobs"]
