"""Misconfiguration found before a request meets it: what vLLM's NexRTConnector says about itself
(a configuration probe, below) against each decode node's `/capabilities`.

The probe is one ordinary one-token vLLM completion whose `kv_transfer_params` are
`{"nexrt": {"probe": true}}`: the connector claims nothing and answers, in the response's
`kv_transfer_params.nexrt`, `{"status": "probe", "connector": {transport, protocol_version,
protocol_versions, layout_version, model: {name, architecture, num_hidden_layers, hidden_size, vocab_size}, dtype,
kv_cache_dtype, instance}}` (connector/connector.py `probe_info`). A reply without `kv_transfer_params`
means vLLM runs no NexRTConnector at all.
"""
from __future__ import annotations

import asyncio
import json
import os

import aiohttp

from nexrt_vllm.handoff.contracts import CLAIM_KEY, PROBE, ContractError, ProbeReply

PROBE_CLAIM = {CLAIM_KEY: PROBE}
_IDENTITY = ("num_hidden_layers", "hidden_size", "vocab_size")
ABSENT = {"absent": True}       # vLLM answered without kv_transfer_params: no connector
# vLLM cache_config.cache_dtype values whose pages a node takes ("auto": the model dtype)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")


async def probe(session: aiohttp.ClientSession, vllm_url: str, timeout: float) -> tuple[str, dict | None]:
    """("ok", the connector's configuration) | ("absent", ABSENT): vLLM runs no NexRTConnector |
    ("unsupported", None): its connector predates probes | ("unreachable", None): ask again later."""
    t = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(f"{vllm_url}/v1/models", timeout=t) as r:
            models = (await r.json(content_type=None))["data"]
        body = {"model": models[0]["id"], "prompt": [0], "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": PROBE_CLAIM}
        async with session.post(f"{vllm_url}/v1/completions", json=body, timeout=t) as r:
            if r.status != 200:
                return "unreachable", None
            data = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError, IndexError,
            TypeError, ValueError):
        return "unreachable", None
    ktp = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not ktp:
        return "absent", ABSENT
    try:
        reply = ProbeReply.from_params(ktp)
    except ContractError:
        reply = None
    return ("ok", reply.connector) if reply is not None else ("unsupported", None)


def mismatches(connector: dict | None, caps: dict) -> list[str]:
    """Why this node cannot take hand-offs from this vLLM (empty: nothing contradicts). Only
    fields both sides report are compared."""
    if connector is None:
        return []
    if connector is ABSENT or connector.get("absent"):
        return ["vLLM runs no NexRTConnector (its reply carries no kv_transfer_params): "
                "start it with --kv-transfer-config naming NexRTConnector"]
    out = []
    sent = connector.get("transport")
    got = (caps.get("transport") or {}).get("backend") if isinstance(caps.get("transport"), dict) else None
    if sent and got and sent != got:
        out.append(f"transport: the connector sends with {sent}, the node receives with {got} "
                   f"(kv_connector_extra_config.transport vs nexrt-decode --transport)")
    a, b = _protocols(connector), _protocols(caps)
    if a and b and not a & b:
        out.append(f"protocol_version: the connector speaks {sorted(a)}, the node {sorted(b)}")
    a, b = connector.get("layout_version"), caps.get("layout_version")
    if a is not None and b is not None and a != b:
        out.append(f"layout_version: the connector speaks {a}, the node {b}")
    model = connector.get("model") or {}
    diff = [f"{k}={model[k]} vs {caps[k]}" for k in _IDENTITY
            if model.get(k) is not None and caps.get(k) is not None and model[k] != caps[k]]
    if diff:
        out.append(f"model: vLLM serves {model.get('name')!r}, the node {caps.get('model')!r} "
                   f"({', '.join(diff)})")
    kv = connector.get("kv_cache_dtype")
    if kv and kv not in KV_CACHE_DTYPES:
        out.append(f"kv_cache_dtype: vLLM keeps its KV cache in {kv} (--kv-cache-dtype); NexRT nodes take "
                   f"unquantized KV pages and refuse these at hello: start vLLM with --kv-cache-dtype auto")
    dt, nd = connector.get("dtype"), caps.get("dtype")
    # The node may compute in float32 (more precise than vLLM); anything else must be vLLM's dtype.
    if dt and nd and nd != dt and nd != "float32":
        out.append(f"dtype: vLLM computes in {dt}, the node in {nd}")
    return out


def _protocols(d: dict) -> set | None:
    """The protocol versions a side speaks: its `protocol_versions`, else its one `protocol_version`
    (older peers); a connector and a node agree on the highest they share."""
    vs = d.get("protocol_versions")
    if isinstance(vs, list) and vs:
        return set(vs)
    return {d["protocol_version"]} if d.get("protocol_version") is not None else None


def name_differs(connector: dict | None, caps: dict) -> bool:
    """The checkpoint names differ (vLLM's path/repo basename vs the node's): worth a log line,
    not an ejection (one checkpoint may sit at different paths)."""
    name = ((connector or {}).get("model") or {}).get("name")
    node = caps.get("model")
    if not name or not node:
        return False
    return os.path.basename(str(name).rstrip("/")) != os.path.basename(str(node).rstrip("/"))
