"""How a wire body is defined: the control messages (``protocol``) and the HTTP / claim bodies
(``contracts``) follow one pattern.

* A body is a frozen dataclass deriving ``WireBody``; its fields are the wire map's keys, in wire
  order. Statuses and reasons are ``str`` enums: stored as the enum, sent as their value.
* ``__post_init__`` checks every field with the helpers below, so a decoded body and one built
  locally obey the same rules; a bad value raises ``ContractError`` ("<body>.<field> <problem>").
* ``to_wire()`` is the body's one encoder (to the wire map) and the class method ``from_wire(map)``
  its one decoder. The default is the flat form: every field, in declaration order; a body whose
  wire form omits absent fields overrides them.

The transport around the map is the caller's: msgpack with a protocol version for the control
messages (``protocol.encode`` / ``protocol.decode``), JSON or ``kv_transfer_params`` for the rest.

Pure Python (no torch, no vLLM): the router imports it.
"""
from __future__ import annotations

from dataclasses import MISSING, fields
from enum import Enum
from typing import Any, ClassVar


class ContractError(ValueError):
    """A body that breaks its contract; ``str(e)`` is ``"<body>.<field> <problem>"``."""

    def __init__(self, body: str, field_name: str | None, problem: str):
        super().__init__(f"{body}.{field_name} {problem}" if field_name else f"{body} {problem}")
        self.body, self.field, self.problem = body, field_name, problem


# --------------------------------------------------------------------------------------------
# field checks: each returns the value or raises ContractError(body, name, ...)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def as_map(body: str, d: Any) -> dict:
    if not isinstance(d, dict):
        raise ContractError(body, None, "must be an object")
    return d


_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
               list: "a list", bytes: "bytes"}


def check_type(body: str, name: str, v: Any, kind: type) -> Any:
    """``v`` if it is of ``kind`` (str, int, float = any number, bool, dict, list or bytes); a bool is no number."""
    ok = is_int(v) if kind is int else is_number(v) if kind is float else isinstance(v, kind)
    if not ok:
        raise ContractError(body, name, "is missing" if v is None else
                            f"must be {_KIND_NAMES[kind]}, got {type(v).__name__}")
    return v


def nonempty_str(body: str, name: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ContractError(body, name, "must be a non-empty string")
    return v


def int_at_least(body: str, name: str, v: Any, low: int, what: str) -> int:
    if not is_int(v) or v < low:
        raise ContractError(body, name, f"must be {what}, got {v!r}")
    return v


def opt_int_at_least(body: str, name: str, v: Any, low: int, what: str) -> int | None:
    return None if v is None else int_at_least(body, name, v, low, what)


def as_enum(body: str, name: str, v: Any, enum: type[Enum], problem: str | None = None) -> Enum:
    """``enum(v)``; ``problem`` (default: the allowed values) names a value outside it."""
    try:
        return enum(v)
    except ValueError:
        raise ContractError(body, name, problem or f"must be one of {[e.value for e in enum]}, got {v!r}") from None


# --------------------------------------------------------------------------------------------


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else list(v) if isinstance(v, tuple) else v


class WireBody:
    """Base of every wire body (a frozen dataclass): the flat encoder and decoder."""

    BODY: ClassVar[str] = ""  # the body's name in ContractError messages

    def to_wire(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_wire(cls, d: Any):
        """Every required field (``None`` when absent, which its check refuses) and each optional
        field that is present and not null (else its default); fields not in ``__init__`` (a
        message's ``type``) and unknown keys are the caller's."""
        d = as_map(cls.BODY, d)
        return cls(**{f.name: d.get(f.name) for f in fields(cls) if f.init and (
            (f.default is MISSING and f.default_factory is MISSING) or d.get(f.name) is not None)})

    def _set(self, name: str, value: Any) -> None:
        """Normalise a field in ``__post_init__`` (the body is frozen)."""
        object.__setattr__(self, name, value)


__all__ = ["ContractError", "WireBody", "as_enum", "as_map", "check_type", "int_at_least", "is_int", "is_number",
           "nonempty_str", "opt_int_at_least"]
