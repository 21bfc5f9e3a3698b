"""The standard path as the router drives it when the fast tier cannot serve a request: one
streamed vLLM request (`return_token_ids`, no `kv_transfer_params`), read chunk by chunk so the
router renders it in the client's own envelope (one response, whichever path served it)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp


class StandardError(Exception):
    """The standard path refused (`status` 4xx: vLLM's message) or failed (5xx, broken stream)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Chunk:
    token_ids: list[int]
    prompt_token_ids: list[int] | None
    finish_reason: str | None
    stop_reason: object = None     # str: a stop string; int: a stop token id; None: EOS/length


async def stream(session: aiohttp.ClientSession, url: str, body: dict, connect_timeout: float,
                 read_timeout: float) -> AsyncIterator[Chunk]:
    """Yields the chunks of one streamed vLLM completion until (and including) the one with a
    finish_reason. Raises StandardError before the first chunk for a refusal, and if the stream
    breaks off. Closing the generator closes the request (vLLM aborts it)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
    try:
        async with session.post(url, json=body, timeout=timeout) as r:
            if r.status != 200:
                raw = await r.read()
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:300].decode(errors="replace")
                raise StandardError(r.status if 400 <= r.status < 500 else 502, f"vLLM: {msg}")
            while True:
                line = await r.content.readline()
                if not line:
                    raise StandardError(502, "the standard path's stream ended without a finish")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    raise StandardError(502, "the standard path's stream ended without a finish")
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    raise StandardError(502, f"vLLM: {err.get('message') if isinstance(err, dict) else err}")
                if not obj.get("choices"):
                    continue           # usage-only chunk
                c = obj["choices"][0]
                yield Chunk(list(c.get("token_ids") or ()),
                            obj.get("prompt_token_ids") or c.get("prompt_token_ids"),
                            c.get("finish_reason"), c.get("stop_reason"))
                if c.get("finish_reason"):
                    return
    except asyncio.TimeoutError:
        raise StandardError(504, f"the standard path gave nothing for {read_timeout:g}s") from None
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
        raise StandardError(502, f"the standard path failed: {type(e).__name__}: {e}") from None
