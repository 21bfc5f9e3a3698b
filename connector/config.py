"""Connector configuration (``kv_connector_extra_config``); the per-request claim it honours is
``nexrt_vllm.handoff.contracts.Claim``.

Imports neither torch nor vLLM, so it is unit-testable on its own.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from nexrt_vllm.handoff.layout import KV_FORMATS, REC_LAYOUTS
from nexrt_vllm.handoff.transport import TRANSPORTS

STAGING = ("auto", "always", "never")


class ConnectorConfigError(ValueError):
    """Bad ``kv_connector_extra_config`` or an unsupported vLLM setup: raised at vLLM start, before any request."""


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
            raise ConnectorConfigError(f"unknown NexRTConnector option(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**extra)
        if cfg.transport not in TRANSPORTS:
            raise ConnectorConfigError(f"transport {cfg.transport!r} not one of {TRANSPORTS}")
        for name in ("control_timeout_s", "transfer_timeout_s", "drain_timeout_s"):
            v = getattr(cfg, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConnectorConfigError(f"{name} must be a positive number, got {v!r}")
        if cfg.attn_kv_format is not None and cfg.attn_kv_format not in KV_FORMATS:
            raise ConnectorConfigError(f"attn_kv_format {cfg.attn_kv_format!r} not one of {KV_FORMATS}")
        if cfg.gdn_rec_layout is not None and cfg.gdn_rec_layout not in REC_LAYOUTS:
            raise ConnectorConfigError(f"gdn_rec_layout {cfg.gdn_rec_layout!r} not one of {REC_LAYOUTS}")
        if cfg.staging not in STAGING:
            raise ConnectorConfigError(f"staging {cfg.staging!r} not one of {STAGING}")
        if not isinstance(cfg.staging_mib, int) or isinstance(cfg.staging_mib, bool) or cfg.staging_mib <= 0:
            raise ConnectorConfigError(f"staging_mib must be a positive integer, got {cfg.staging_mib!r}")
        if not isinstance(cfg.host, str) or not cfg.host:
            raise ConnectorConfigError("host must be a non-empty string")
        return cfg
