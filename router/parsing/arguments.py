"""Tool-call arguments: string values typed from the tool's JSON schema, and the prefix of a growing
argument object that is safe to stream (vllm/tool_parsers/utils.py, vllm/parser/engine/)."""
from __future__ import annotations

import json
import math
from typing import Any


def tool_properties(tools: list[dict] | None, name: str) -> dict:
    """`tools` as in the request body; the named function's parameter properties, or {}."""
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties", {})
    return {}


def schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return ["string"]
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    enum_ = schema.get("enum")
    if isinstance(enum_, list) and enum_:
        for v in enum_:
            types.add("null" if v is None else "boolean" if isinstance(v, bool)
                      else "integer" if isinstance(v, int) else "number" if isinstance(v, float)
                      else "string" if isinstance(v, str) else "array" if isinstance(v, list)
                      else "object" if isinstance(v, dict) else "")
        types.discard("")
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for choice in schema[key]:
                types.update(schema_types(choice))
    return list(types) if types else ["string"]


_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer",
    "uint32": "integer", "uint64": "integer", "long": "integer", "short": "integer",
    "unsigned": "integer", "float": "number", "float32": "number", "float64": "number",
    "double": "number", "bool": "boolean", "dict": "object", "arr": "array", "list": "array",
    "sequence": "array"}


def _json_finite(obj: Any) -> bool:
    try:
        json.dumps(obj, allow_nan=False)
        return True
    except (ValueError, TypeError):
        return False


def coerce(value: str, types: list[str]) -> Any:
    """Best-effort string → schema type; priority null, integer, number, boolean, object/array, string."""
    norm = {_TYPE_ALIASES.get(k, k) for k in (t.strip().lower() for t in types)}
    for cand in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if cand not in norm:
            continue
        if cand == "null":
            if value.lower() == "null":
                return None
        elif cand == "string":
            return value
        elif cand == "integer":
            try:
                return int(value)
            except (ValueError, TypeError):
                pass
        elif cand == "number":
            try:
                v = float(value)
            except (ValueError, TypeError):
                continue
            if math.isfinite(v):
                return v if v != int(v) else int(v)
        elif cand == "boolean":
            low = value.lower().strip()
            if low in ("true", "1"):
                return True
            if low in ("false", "0"):
                return False
        else:
            try:
                parsed = json.loads(value)
            except (json.JSONDecodeError, ValueError, TypeError):
                continue
            if _json_finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except (json.JSONDecodeError, ValueError):
        return value
    return parsed if _json_finite(parsed) else value


def _coerce_value(value: Any, schema: dict) -> tuple[Any, bool]:
    if isinstance(value, str):
        out = coerce(value, schema_types(schema))
        return (out, True) if out is not value else (value, False)
    if isinstance(value, dict):
        props = schema.get("properties")
        if isinstance(props, dict):
            return value, _coerce_dict(value, props)
        return value, False
    if isinstance(value, list):
        items = schema.get("items")
        changed = False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                out, ch = _coerce_value(item, items)
                if ch:
                    value[i] = out
                    changed = True
        return value, changed
    out = coerce(json.dumps(value, ensure_ascii=False), schema_types(schema))
    if type(out) is not type(value) or out != value:
        return out, True
    return value, False


def _coerce_dict(args: dict, props: dict) -> bool:
    changed = False
    for key, value in args.items():
        prop = props.get(key)
        if isinstance(prop, dict):
            out, ch = _coerce_value(value, prop)
            if ch:
                args[key] = out
                changed = True
    return changed


def fix_arg_types(args_json: str, name: str, tools: list[dict] | None) -> str:
    """Re-type string argument values from the tool's JSON schema; unchanged text when nothing changes."""
    if not tools or not name:
        return args_json
    try:
        args = json.loads(args_json)
    except (json.JSONDecodeError, ValueError):
        return args_json
    if not isinstance(args, dict):
        return args_json
    props = tool_properties(tools, name)
    if not props:
        return args_json
    return json.dumps(args, ensure_ascii=False) if _coerce_dict(args, props) else args_json


def streamable_string_keys(props: dict) -> set[str] | None:
    if not props:
        return None
    return {k for k, s in props.items() if set(schema_types(s)) == {"string"}}


def safe_arg_prefix(js: str, string_keys: set[str] | None) -> str:
    """Prefix of a growing JSON object that later ticks cannot rewrite (vLLM `safe_arg_prefix`)."""
    last_colon, last_key, pending_key = -1, None, None
    in_string = escape = False
    start, depth = -1, 0
    for i, c in enumerate(js):
        if escape:
            escape = False
            continue
        if in_string:
            if c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                if depth == 1 and start >= 0:
                    pending_key = js[start + 1:i]
            continue
        if c == '"':
            in_string, start = True, i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ":" and depth == 1:
            last_colon, last_key, pending_key = i, pending_key, None
    if last_colon < 0:
        return ""
    end = last_colon + 1
    while end < len(js) and js[end] in " \t\n\r":
        end += 1
    if end >= len(js) or js[end] != '"':
        return js[:end]
    if string_keys is not None and last_key not in string_keys:
        return js[:end]
    escape = False
    for i in range(end + 1, len(js)):
        c = js[i]
        if escape:
            escape = False
        elif c == "\\":
            escape = True
        elif c == '"':
            return js[:i]
    return js
