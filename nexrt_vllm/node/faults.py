"""Fault injection for tests and the soak benchmark only: ``NEXRT_TEST_FAULTS`` in the node's
environment, a comma-separated list of

* ``refuse_begin`` or ``refuse_begin=P``: reject a hand-off's ``begin`` (reason ``busy``) with
  probability P (default 1), ending the admission as a real refusal would;
* ``stall_first_token=S``: wait S seconds before streaming the first decoded token (a slow
  conversion), so that a test can kill the node "before its first token".

Unset in production; a node with faults logs them as a warning at start.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

ENV = "NEXRT_TEST_FAULTS"


@dataclass(frozen=True)
class Faults:
    refuse_begin: float = 0.0
    stall_first_token_s: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0), compare=False)

    def __bool__(self) -> bool:
        return bool(self.refuse_begin or self.stall_first_token_s)

    def refuse(self) -> bool:
        return self.refuse_begin > 0 and self.rng.random() < self.refuse_begin


def from_env(value: str | None = None) -> Faults:
    value = os.environ.get(ENV, "") if value is None else value
    kw = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        name, _, arg = item.partition("=")
        try:
            if name == "refuse_begin":
                kw["refuse_begin"] = float(arg) if arg else 1.0
            elif name == "stall_first_token":
                kw["stall_first_token_s"] = float(arg)
            else:
                raise ValueError("unknown fault")
        except ValueError:
            raise ValueError(f"{ENV}: cannot use {item!r} (known: refuse_begin[=P], "
                             f"stall_first_token=S)") from None
    if not 0 <= kw.get("refuse_begin", 0) <= 1 or kw.get("stall_first_token_s", 0) < 0:
        raise ValueError(f"{ENV}={value!r}: probability in [0, 1] and seconds >= 0 expected")
    return Faults(**kw)
