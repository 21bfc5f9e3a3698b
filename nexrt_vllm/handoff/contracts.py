"""The HTTP and claim bodies exchanged by the router, the decode node and the connector
(docs/ARCHITECTURE.md §2), each defined once with one encoder (``to_wire``) and one decoder
(``from_wire``) that every side uses.

==================  ==========================================  ===========================
body                wire                                        written by -> read by
==================  ==========================================  ===========================
AdmitRequest        ``POST /v1/admit``                          router -> node
AdmitReply          its 200 answer                              node -> router
Claim               ``kv_transfer_params["nexrt"]`` of the      router -> connector
                    prefill request
HandoffReport       ``kv_transfer_params["nexrt"]`` of vLLM's   connector -> router
                    answer (``HandoffStatus``)
PROBE / ProbeReply  the same two places, for a configuration    router -> connector -> router
                    probe (no claim, no hand-off)
GenerateRequest     ``POST /v1/generate`` (``Sampling`` inside) router -> node
CancelRequest       ``POST /v1/cancel``                         router -> node
CancelReply         its 200 answer (``AdmissionState``)         node -> router
Refusal             any 4xx answer of the node:                 node -> router
                    ``{"error": {"type": reason, "message"}}``
==================  ==========================================  ===========================

Each body is a wire body (``nexrt_vllm.handoff.wire``): constructing it validates it, so a decoded
body and a locally built one obey the same rules; a bad value raises ``ContractError`` (a
``ValueError``) naming the body and the field. Decoders take parsed JSON, ignore fields they do
not know (forward compatible) except ``GenerateRequest``, which refuses them: a sampling option
the node would silently drop must not look accepted.

Pure Python (no torch, no vLLM): the router imports it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from nexrt_vllm.handoff.protocol import Reason
from nexrt_vllm.handoff.structured import StructuredError, StructuredSpec, check_logprobs
from nexrt_vllm.handoff.wire import (ContractError, WireBody, as_enum, as_map, int_at_least, is_int, is_number,
                                     nonempty_str, opt_int_at_least)

CLAIM_KEY = "nexrt"  # our only key in kv_transfer_params, in and out (MultiConnector-safe)


class HandoffStatus(str, Enum):
    """Where a claimed request's hand-off stands when vLLM finishes it."""

    SENDING = "sending"  # normal: pages still being written; the node's ``done`` decides
    SENT = "sent"  # the node acknowledged ``done``
    FAILED = "failed"  # the node will get no state (refused, unreachable, bad claim)
    ABORTED = "aborted"  # vLLM aborted the request before its prefill completed

    @property
    def failed(self) -> bool:
        """The node will get no state from this hand-off."""
        return self in (HandoffStatus.FAILED, HandoffStatus.ABORTED)


class AdmissionState(str, Enum):
    """A node admission's state as the node reports it (``/v1/cancel``, ``/health``)."""

    RESERVED = "reserved"  # admitted, waiting for the sender's ``begin``
    RECEIVING = "receiving"  # ``begin`` accepted, pages being written
    READY = "ready"  # ``done`` validated, waiting for ``/v1/generate``
    DECODING = "decoding"
    FINISHED = "finished"  # no longer in flight


# The node's HTTP refusals: reason -> status. 409s are transient (the client may retry).
REFUSAL_STATUS = {
    Reason.BAD_MESSAGE: 400,  # malformed body or sampling parameters
    Reason.UNKNOWN_RID: 404,  # rid not admitted / not in flight
    Reason.TOO_LONG: 413,  # prompt_len + 1 over max_seq_len
    Reason.BUSY: 409,
    Reason.CANCELLING: 409,  # the previous request is still stopping
    Reason.DUPLICATE: 409,  # rid already admitted / already started
    Reason.STALE_GENERATION: 409,  # generation of an earlier admission
    Reason.UNSUPPORTED: 400,  # an output option the node cannot honour (no grammar backend, a schema feature)
}


# --------------------------------------------------------------------------------------------
# checks of this module's bodies (the shared ones are in ``wire``)


def _tcp_addr(body: str, name: str, v: Any) -> str:
    if not isinstance(v, str) or not v.startswith("tcp://"):
        raise ContractError(body, name, "must be a tcp:// address")
    return v


def _structured(body: str, v: Any) -> dict | None:
    """A grammar spec's wire form (``handoff.structured``), checked for its shape; whether the node
    can compile and enforce it is the node's answer (400 ``unsupported``)."""
    try:
        spec = StructuredSpec.from_wire(v)
    except StructuredError as e:
        raise ContractError(body, "structured", f"is malformed: {e}") from None
    return None if spec is None else spec.to_wire()


# --------------------------------------------------------------------------------------------
# admission


@dataclass(frozen=True)
class AdmitRequest(WireBody):
    """``POST /v1/admit``: reserve the node's slot for ``rid`` before any byte moves."""

    rid: str
    prompt_len: int | None = None  # when known, the node refuses a too-long prompt up front
    structured: dict | None = None  # a grammar spec: the node compiles it while the prefill runs

    BODY = "admit"

    def __post_init__(self):
        nonempty_str(self.BODY, "rid", self.rid)
        opt_int_at_least(self.BODY, "prompt_len", self.prompt_len, 1, "a positive integer")
        self._set("structured", _structured(self.BODY, self.structured))

    def to_wire(self) -> dict:
        return {k: v for k, v in (("rid", self.rid), ("prompt_len", self.prompt_len),
                                  ("structured", self.structured)) if v is not None}


@dataclass(frozen=True)
class AdmitReply(WireBody):
    """The node's 200 answer to ``/v1/admit``: what the claim needs."""

    rid: str
    generation: int  # identifies this admission of the slot; a stale one is refused
    control_addr: str  # the node's ZMQ control endpoint
    admit_timeout_s: float  # the sender's ``begin`` must arrive within this

    BODY = "admit_reply"

    def __post_init__(self):
        nonempty_str(self.BODY, "rid", self.rid)
        int_at_least(self.BODY, "generation", self.generation, 0, "a non-negative integer")
        _tcp_addr(self.BODY, "control_addr", self.control_addr)
        v = self.admit_timeout_s
        if not is_number(v) or not v > 0:
            raise ContractError(self.BODY, "admit_timeout_s", f"must be a positive number, got {v!r}")


# --------------------------------------------------------------------------------------------
# claim and hand-off report (kv_transfer_params["nexrt"], through vLLM)


@dataclass(frozen=True)
class Claim(WireBody):
    """``kv_transfer_params["nexrt"]`` of the prefill request: hand this request's state to the
    node admission ``(rid, generation)`` at ``control_addr``."""

    rid: str
    generation: int
    control_addr: str
    node_url: str | None = None  # for logs only

    BODY = f"kv_transfer_params.{CLAIM_KEY}"

    def __post_init__(self):
        nonempty_str(self.BODY, "rid", self.rid)
        int_at_least(self.BODY, "generation", self.generation, 0, "a non-negative integer")
        _tcp_addr(self.BODY, "control_addr", self.control_addr)
        if self.node_url is not None and not isinstance(self.node_url, str):
            raise ContractError(self.BODY, "node_url", "must be a string")

    def to_params(self) -> dict:
        """The whole ``kv_transfer_params`` value carrying this claim."""
        return {CLAIM_KEY: self.to_wire()}

    @classmethod
    def from_params(cls, params: Any) -> "Claim | None":
        """The request's claim; ``None`` if the request is not ours (no ``"nexrt"`` key)."""
        if not isinstance(params, dict) or CLAIM_KEY not in params:
            return None
        return cls.from_wire(params[CLAIM_KEY])


@dataclass(frozen=True)
class HandoffReport(WireBody):
    """``kv_transfer_params["nexrt"]`` of vLLM's answer: the connector's view of the hand-off when
    vLLM finished the request. ``rid``/``generation``/``seq_len`` are absent for a malformed claim."""

    status: HandoffStatus
    rid: str | None = None
    generation: int | None = None
    seq_len: int | None = None  # tokens of state the node receives
    reason: Reason | None = None  # why it failed / was aborted
    error: str = ""

    BODY = f"kv_transfer_params.{CLAIM_KEY}"

    def __post_init__(self):
        self._set("status", as_enum(self.BODY, "status", self.status, HandoffStatus))
        if self.rid is not None:
            nonempty_str(self.BODY, "rid", self.rid)
        opt_int_at_least(self.BODY, "generation", self.generation, 0, "a non-negative integer")
        opt_int_at_least(self.BODY, "seq_len", self.seq_len, 0, "a non-negative integer")
        if self.reason == "":
            self._set("reason", None)  # the wire's "no reason"
        if self.reason is not None:
            self._set("reason", as_enum(self.BODY, "reason", self.reason, Reason,
                                        f"{self.reason!r} is not a protocol reason"))
        if not isinstance(self.error, str):
            raise ContractError(self.BODY, "error", "must be a string")

    def to_wire(self) -> dict:
        out: dict[str, Any] = {k: v for k, v in (("rid", self.rid), ("generation", self.generation),
                                                 ("seq_len", self.seq_len)) if v is not None}
        out["status"] = self.status.value
        if self.reason is not None or self.error:
            out["reason"] = self.reason.value if self.reason is not None else ""
            out["error"] = self.error
        return out

    def to_params(self) -> dict:
        return {CLAIM_KEY: self.to_wire()}

    @classmethod
    def from_params(cls, params: Any) -> "HandoffReport | None":
        """The connector's report in vLLM's ``kv_transfer_params``; ``None`` if there is none."""
        if params is None:
            return None
        if not isinstance(params, dict):
            raise ContractError("kv_transfer_params", None, "must be an object")
        if params.get(CLAIM_KEY) is None:
            return None
        return cls.from_wire(params[CLAIM_KEY])


# --------------------------------------------------------------------------------------------
# configuration probe (router -> connector through vLLM, and back)

PROBE = {"probe": True}  # kv_transfer_params["nexrt"] of a probe: answered, never claimed


def is_probe(params: Any) -> bool:
    """A router's configuration probe (exactly ``{"nexrt": {"probe": true}}``)."""
    return isinstance(params, dict) and params.get(CLAIM_KEY) == PROBE


@dataclass(frozen=True)
class ProbeReply(WireBody):
    """``kv_transfer_params["nexrt"]`` of vLLM's answer to a probe: the connector's configuration
    (``transport``, ``protocol_version``, ``layout_version``, ``model`` {name, architecture,
    num_hidden_layers, hidden_size, vocab_size}, ``dtype``, ``kv_cache_dtype``), compared by the
    router with each node's ``/capabilities``, and ``instance`` (an id of the vLLM process: the
    router warms every node again when it changes)."""

    connector: dict
    status: str = "probe"

    BODY = f"kv_transfer_params.{CLAIM_KEY}"

    def __post_init__(self):
        if self.status != "probe":
            raise ContractError(self.BODY, "status", f"must be 'probe', got {self.status!r}")
        if not isinstance(self.connector, dict):
            raise ContractError(self.BODY, "connector", "must be an object")

    def to_params(self) -> dict:
        return {CLAIM_KEY: self.to_wire()}

    @classmethod
    def from_params(cls, params: Any) -> "ProbeReply | None":
        """The probe's answer; ``None`` when the reply is no probe answer (an older connector)."""
        nexrt = params.get(CLAIM_KEY) if isinstance(params, dict) else None
        if not isinstance(nexrt, dict) or nexrt.get("status") != "probe":
            return None
        return cls.from_wire(nexrt)


# --------------------------------------------------------------------------------------------
# decode


@dataclass(frozen=True)
class Sampling(WireBody):
    """How each token is picked; sent identically to vLLM (first token) and the node (the rest).

    temperature 0 is greedy; top_k 0 or -1 and top_p 1 disable those filters; a stop token id
    always ends generation, EOS unless ignore_eos. The defaults are what the node uses for an
    absent (or null) field.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    BODY = "generate"

    def __post_init__(self):
        b = self.BODY

        def finite(v):
            return is_number(v) and math.isfinite(v)

        if not finite(self.temperature) or self.temperature < 0:
            raise ContractError(b, "temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ContractError(b, "top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        int_at_least(b, "top_k", self.top_k, -1, "an integer >= -1 (0 or -1 = off)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ContractError(b, "seed", f"must be null or an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ContractError(b, "ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, (list, tuple)) or not all(is_int(t) and t >= 0 for t in stops):
            raise ContractError(b, "stop_token_ids", f"must be a list of non-negative integers, got {stops!r}")
        self._set("stop_token_ids", tuple(stops))


_SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling))


@dataclass(frozen=True)
class GenerateRequest(WireBody):
    """``POST /v1/generate``: decode the admitted request after ``first_token`` (sampled by vLLM);
    the answer is an NDJSON stream of ``{"token": id}`` lines and one final ``{"finish_reason"}``."""

    rid: str
    first_token: int
    max_tokens: int  # counts first_token too
    generation: int | None = None  # when given, must be the admission's
    sampling: Sampling = field(default_factory=Sampling)
    logprobs: int | None = None  # per token: its logprob and this many top alternatives (0..20)
    structured: dict | None = None  # a grammar spec (or the one given at admit, when absent)

    BODY = "generate"

    def __post_init__(self):
        nonempty_str(self.BODY, "rid", self.rid)
        int_at_least(self.BODY, "first_token", self.first_token, 0, "a non-negative integer")
        int_at_least(self.BODY, "max_tokens", self.max_tokens, 1, "an integer >= 1")
        opt_int_at_least(self.BODY, "generation", self.generation, 0, "a non-negative integer")
        if not isinstance(self.sampling, Sampling):
            raise ContractError(self.BODY, "sampling", "must be a Sampling")
        try:
            check_logprobs(self.logprobs)
        except StructuredError as e:
            raise ContractError(self.BODY, "logprobs", str(e).removeprefix("logprobs ")) from None
        self._set("structured", _structured(self.BODY, self.structured))

    def to_wire(self) -> dict:
        out = {"rid": self.rid, "generation": self.generation, "first_token": self.first_token,
               "max_tokens": self.max_tokens, **self.sampling.to_wire()}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.structured is not None:
            out["structured"] = self.structured
        return out

    @classmethod
    def from_wire(cls, d: Any) -> "GenerateRequest":
        d = as_map(cls.BODY, d)
        unknown = sorted(set(d) - {"rid", "generation", "first_token", "max_tokens", "logprobs", "structured",
                                   *_SAMPLING_FIELDS})
        if unknown:
            raise ContractError(cls.BODY, None, f"has unsupported fields {unknown}")
        return cls(rid=d.get("rid"), first_token=d.get("first_token"), max_tokens=d.get("max_tokens"),
                   generation=d.get("generation"), sampling=Sampling.from_wire(d), logprobs=d.get("logprobs"),
                   structured=d.get("structured"))


# --------------------------------------------------------------------------------------------
# cancel


@dataclass(frozen=True)
class CancelRequest(WireBody):
    """``POST /v1/cancel``: stop ``rid`` at whatever stage it is and free the slot."""

    rid: str

    BODY = "cancel"

    def __post_init__(self):
        nonempty_str(self.BODY, "rid", self.rid)


@dataclass(frozen=True)
class CancelReply(WireBody):
    """The node's 200 answer to ``/v1/cancel``: ``state`` is where the request was."""

    rid: str
    cancelled: bool  # False: it had already finished
    state: AdmissionState

    BODY = "cancel_reply"

    def __post_init__(self):
        nonempty_str(self.BODY, "rid", self.rid)
        if not isinstance(self.cancelled, bool):
            raise ContractError(self.BODY, "cancelled", "must be a boolean")
        self._set("state", as_enum(self.BODY, "state", self.state, AdmissionState))


# --------------------------------------------------------------------------------------------
# refusals


class Refusal(Exception):
    """The node refused an HTTP request before acting on it. On the wire: status
    ``REFUSAL_STATUS[reason]`` and ``{"error": {"type": reason, "message": message}}``."""

    BODY = "error"

    def __init__(self, reason: Reason | str, message: str):
        reason = as_enum(self.BODY, "type", reason, Reason, f"{reason!r} is not a protocol reason")
        if reason not in REFUSAL_STATUS:
            raise ContractError(self.BODY, "type", f"{reason.value!r} is not an HTTP refusal")
        if not isinstance(message, str):
            raise ContractError(self.BODY, "message", "must be a string")
        super().__init__(message)
        self.reason, self.message = reason, message

    @property
    def status(self) -> int:
        return REFUSAL_STATUS[self.reason]

    def to_wire(self) -> dict:
        return {"error": {"type": self.reason.value, "message": self.message}}

    @classmethod
    def from_wire(cls, status: int, d: Any) -> "Refusal":
        """Decode a refusal answered with HTTP ``status``; the status must be the reason's."""
        err = as_map(cls.BODY, as_map("refusal", d).get("error"))
        r = cls(err.get("type"), err.get("message", ""))
        if r.status != status:
            raise ContractError(cls.BODY, "type", f"{r.reason.value!r} comes with HTTP {r.status}, not {status}")
        return r

    def __repr__(self) -> str:
        return f"Refusal({self.status} {self.reason.value}: {self.message})"


__all__ = ["CLAIM_KEY", "PROBE", "REFUSAL_STATUS", "AdmissionState", "AdmitReply", "AdmitRequest", "CancelReply",
           "CancelRequest", "Claim", "ContractError", "GenerateRequest", "HandoffReport", "HandoffStatus",
           "ProbeReply", "Refusal", "Sampling", "is_probe"]
