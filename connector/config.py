"""Connector configuration (``kv_connector_extra_config``) and the per-request claim.

Imports neither torch nor vLLM, so both are unit-testable on their own.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from nexrt_vllm.handoff.protocol import KV_FORMATS, REC_LAYOUTS

CLAIM_KEY = "nexrt"  # our only key in kv_transfer_params, in and out (MultiConnector-safe)
TRANSPORTS = ("mooncake", "nixl")
STAGING = ("auto", "always", "never")


class ConfigError(ValueError):
    """Bad ``kv_connector_extra_config``: raised at vLLM start, before any request."""


class ClaimError(ValueError):
    """A ``kv_transfer_params["nexrt"]`` entry that cannot be honoured (reported, never raised into vLLM)."""


@dataclass(frozen=True)
class ConnectorConfig:
    transport: str = "mooncake"  # transfer engine used to write into the node's buffers
    host: str = "127.0.0.1"  # address this side's transfer engine advertises (Mooncake)
    control_timeout_s: float = 5.0  # one control round trip (hello/begin/done/abort) with the node
    transfer_timeout_s: float = 30.0  # one batch of page writes
    drain_timeout_s: float = 60.0  # wait for in-flight writes before vLLM reuses their blocks
    # Page layouts are detected from what vLLM allocated (connector/layouts.py). These force a
    # reading only for a backend/platform not characterised; one contradicting a detection is an error.
    attn_kv_format: str | None = None
    gdn_rec_layout: str | None = None
    # GPU KV cache: "auto" sends straight from device memory where the transport can read it and
    # through a pinned host pool where it cannot; "always" / "never" force either.
    staging: str = "auto"
    staging_mib: int = 256

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "ConnectorConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown NexRTConnector option(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**extra)
        if cfg.transport not in TRANSPORTS:
            raise ConfigError(f"transport {cfg.transport!r} not one of {TRANSPORTS}")
        for name in ("control_timeout_s", "transfer_timeout_s", "drain_timeout_s"):
            v = getattr(cfg, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        if cfg.attn_kv_format is not None and cfg.attn_kv_format not in KV_FORMATS:
            raise ConfigError(f"attn_kv_format {cfg.attn_kv_format!r} not one of {KV_FORMATS}")
        if cfg.gdn_rec_layout is not None and cfg.gdn_rec_layout not in REC_LAYOUTS:
            raise ConfigError(f"gdn_rec_layout {cfg.gdn_rec_layout!r} not one of {REC_LAYOUTS}")
        if cfg.staging not in STAGING:
            raise ConfigError(f"staging {cfg.staging!r} not one of {STAGING}")
        if not isinstance(cfg.staging_mib, int) or isinstance(cfg.staging_mib, bool) or cfg.staging_mib <= 0:
            raise ConfigError(f"staging_mib must be a positive integer, got {cfg.staging_mib!r}")
        if not isinstance(cfg.host, str) or not cfg.host:
            raise ConfigError("host must be a non-empty string")
        return cfg


@dataclass(frozen=True)
class Claim:
    """``kv_transfer_params["nexrt"]`` as the router sends it (docs/ARCHITECTURE.md §2)."""

    rid: str
    generation: int
    control_addr: str
    node_url: str | None = None


PROBE = {"probe": True}  # kv_transfer_params.nexrt of a configuration probe (docs/CONNECTOR.md)


def is_probe(params: Any) -> bool:
    """A router's configuration probe: answered with the connector's configuration, never handed off."""
    return isinstance(params, dict) and params.get(CLAIM_KEY) == PROBE


def parse_claim(params: Any) -> Claim | None:
    """The request's claim, ``None`` if it is not ours; raises ClaimError if ours but malformed."""
    if not isinstance(params, dict) or CLAIM_KEY not in params:
        return None
    c = params[CLAIM_KEY]
    if not isinstance(c, dict):
        raise ClaimError(f"kv_transfer_params.{CLAIM_KEY} must be an object")
    rid, gen, addr, url = c.get("rid"), c.get("generation"), c.get("control_addr"), c.get("node_url")
    if not isinstance(rid, str) or not rid:
        raise ClaimError(f"kv_transfer_params.{CLAIM_KEY}.rid must be a non-empty string")
    if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
        raise ClaimError(f"kv_transfer_params.{CLAIM_KEY}.generation must be a non-negative integer")
    if not isinstance(addr, str) or not addr.startswith("tcp://"):
        raise ClaimError(f"kv_transfer_params.{CLAIM_KEY}.control_addr must be a tcp:// address")
    if url is not None and not isinstance(url, str):
        raise ClaimError(f"kv_transfer_params.{CLAIM_KEY}.node_url must be a string")
    return Claim(rid, gen, addr, url)
