"""HTTP clients for the two upstream legs: the vLLM prefill server and the decode nodes
(contract: docs/ARCHITECTURE.md §2). Every call has a timeout; failures become typed errors."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp

from nexrt_vllm.handoff.contracts import (AdmitReply, AdmitRequest, CancelRequest, ContractError, GenerateRequest,
                                          HandoffReport, Refusal)

from . import fastjson
from .errors import APIError


class NodeError(Exception):
    """The node is unreachable or misbehaved (transport-level): eject it."""


class NodeBusy(Exception):
    """The node refused admission (409): it holds a request this router does not own."""


class NodeRefused(Exception):
    """The node answered a generate with a typed 4xx refusal (unknown_rid, stale_generation, ...):
    it is alive and says the admission cannot be decoded. Not a reason to eject it."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class NodeClient:
    def __init__(self, session: aiohttp.ClientSession, admit_timeout: float, read_timeout: float):
        self.session = session
        self.admit_timeout = aiohttp.ClientTimeout(total=admit_timeout)
        # The first line may take a whole KV hand-off; later lines one decode step each.
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=admit_timeout,
                                                    sock_read=read_timeout)

    async def admit(self, url: str, rid: str, structured: dict | None = None) -> AdmitReply:
        """Reserve the node's slot; `structured` (a grammar spec) is compiled while vLLM prefills.
        A 400 refusal (the node cannot enforce that grammar) is NodeRefused: the node is fine."""
        try:
            async with self.session.post(f"{url}/v1/admit", json=AdmitRequest(rid, structured=structured).to_wire(),
                                         timeout=self.admit_timeout) as r:
                body = await r.json(content_type=None)
                if r.status == 200:
                    return AdmitReply.from_wire(body)
                try:
                    refusal = Refusal.from_wire(r.status, body)
                except ContractError:
                    refusal = None
                if r.status == 409:
                    raise NodeBusy(refusal.reason.value if refusal else "busy")
                if r.status == 400 and refusal is not None and structured is not None:
                    raise NodeRefused(400, refusal.reason.value, refusal.message)
                raise NodeError(f"admit answered {r.status}: {refusal.message if refusal else body}")
        except ContractError as e:
            raise NodeError(f"admit answered a malformed body: {e}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            raise NodeError(f"admit failed: {type(e).__name__}: {e}") from None

    async def generate(self, url: str, req: GenerateRequest) -> AsyncIterator[dict]:
        """Yields the node's NDJSON lines; raises NodeError if the stream breaks off."""
        try:
            async with self.session.post(f"{url}/v1/generate", json=req.to_wire(),
                                         timeout=self.stream_timeout) as r:
                if r.status != 200:
                    text = await r.text()
                    refusal = _refusal(r.status, text)
                    if refusal is not None:
                        raise refusal
                    raise NodeError(f"generate answered {r.status}: {text[:500]}")
                while True:
                    line = await r.content.readline()
                    if not line:
                        raise NodeError("decode stream ended without a final line")
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    yield msg
                    if "finish_reason" in msg:
                        return
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            raise NodeError(f"decode stream failed: {type(e).__name__}: {e}") from None

    async def cancel(self, url: str, rid: str) -> None:
        try:
            async with self.session.post(f"{url}/v1/cancel", json=CancelRequest(rid).to_wire(),
                                         timeout=self.admit_timeout) as r:
                await r.read()
                # 404: the node already forgot the rid (finished or aged out): nothing to cancel.
                if r.status not in (200, 404):
                    raise NodeError(f"cancel answered {r.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise NodeError(f"cancel failed: {type(e).__name__}: {e}") from None

    async def wait_free(self, url: str, rid: str, timeout: float) -> None:
        """After a cancel: wait (bounded) until the node no longer holds `rid`, so its slot is free
        before the router hands it out again (the node's own cleanup may take a step)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                async with self.session.get(f"{url}/health",
                                            timeout=self.admit_timeout) as r:
                    held = {q.get("rid") for q in (await r.json(content_type=None))["requests"]}
                    if rid not in held:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError,
                    AttributeError, TypeError, KeyError) as e:
                raise NodeError(f"health after cancel failed: {type(e).__name__}: {e}") from None
            if asyncio.get_running_loop().time() > deadline:
                raise NodeError(f"still holds {rid} {timeout:g}s after cancel")
            await asyncio.sleep(0.05)

    async def probe(self, url: str, timeout: float) -> tuple[dict, dict]:
        """GET /health then /capabilities; returns both bodies (the health one {} if not JSON)."""
        t = aiohttp.ClientTimeout(total=timeout)
        async with self.session.get(f"{url}/health", timeout=t) as r:
            raw = await r.read()
            if r.status != 200:
                raise NodeError(f"/health answered {r.status}")
        try:
            health = json.loads(raw)
        except ValueError:
            health = {}
        async with self.session.get(f"{url}/capabilities", timeout=t) as r:
            if r.status != 200:
                raise NodeError(f"/capabilities answered {r.status}")
            return (health if isinstance(health, dict) else {}), await r.json(content_type=None)


def _refusal(status: int, text: str) -> NodeRefused | None:
    """The node's typed 4xx refusal (contracts.Refusal), or None for anything else."""
    try:
        r = Refusal.from_wire(status, json.loads(text))
    except (ValueError, ContractError):
        return None
    return NodeRefused(r.status, r.reason.value, r.message)


async def vllm_prefill(session: aiohttp.ClientSession, url: str, body: dict,
                       timeout: float) -> dict:
    """The one-token vLLM leg. Upstream 4xx are passed through with vLLM's own message."""
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            data = await r.json(content_type=None, loads=fastjson.loads)
    except asyncio.TimeoutError:
        raise APIError(504, f"vLLM prefill timed out after {timeout:g}s") from None
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        raise APIError(502, f"vLLM prefill failed: {type(e).__name__}: {e}") from None
    if r.status != 200:
        msg = data.get("error", {}).get("message") if isinstance(data, dict) else None
        status = r.status if 400 <= r.status < 500 else 502
        raise APIError(status, f"vLLM: {msg or data}")
    try:
        choice = data["choices"][0]
        first = int(choice["token_ids"][0])
        out = {"first_token": first, "finish_reason": choice.get("finish_reason"),
               # vLLM puts them top-level for chat and in the choice for completions.
               "prompt_token_ids": list(data.get("prompt_token_ids")
                                        or choice.get("prompt_token_ids") or []),
               "prompt_tokens": int(data["usage"]["prompt_tokens"]),
               "logprobs": choice.get("logprobs")}   # the first token's, in vLLM's own format
    except (KeyError, IndexError, TypeError, ValueError):
        raise APIError(502, "vLLM prefill response lacks token ids (is it vLLM >= 0.10 with "
                            "return_token_ids support?)") from None
    try:
        out["handoff"] = HandoffReport.from_params(data.get("kv_transfer_params"))
    except ContractError as e:
        raise APIError(502, f"vLLM's hand-off report is malformed (is the NexRT connector loaded?): "
                            f"{e}") from None
    return out
