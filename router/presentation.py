"""The client's response to an interactive request, in the OpenAI envelope: tokens in (vLLM's
first, the node's or the standard path's rest) -> text (detokenized as vLLM does, stop strings
cut, tool calls and reasoning parsed) -> JSON or SSE, with one id for the whole response
whichever path produced it."""
from __future__ import annotations

import argparse
import json
import time
import uuid

from aiohttp import web

from . import params as P
from .chat_parser import ChatOptions, ChatParser
from .errors import APIError
from .fallback import DEGRADED_HEADER, Reason
from .logprobs import Logprobs
from .metrics import Metrics
from .models import Models
from .textstream import Detokenizer, StopStrings


class Output:
    """Renders one response in the OpenAI envelope (one id/created for all chunks)."""

    streams = False               # True: what text() sends reaches the client at once

    def __init__(self, request: web.Request, params: P.GenParams, model: str,
                 headers: dict[str, str] | None = None):
        self.request = request
        self.params = params
        self.model = model
        self.headers = dict(headers or {})
        self.chat = params.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.started = False
        self.parser: ChatParser | None = None
        self.usage_details = None     # () -> usage's completion_tokens_details (reasoning parser)
        self.lp: Logprobs | None = None

    def _usage(self, usage: dict) -> dict:
        if self.usage_details is not None:
            usage = {**usage, "completion_tokens_details": self.usage_details()}
        return usage


class JSONOutput(Output):
    def __init__(self, *a):
        super().__init__(*a)
        self.parts: list[str] = []

    async def start(self) -> None:
        self.started = True

    async def text(self, delta: str) -> None:
        if delta:
            self.parts.append(delta)

    async def fail(self, status: int, message: str) -> web.Response:
        return APIError(status, message).response()

    async def finish(self, reason: str, usage: dict, timing: dict,
                     ids: list[int]) -> web.Response:
        text = "".join(self.parts)
        if self.chat and self.parser is not None:
            reasoning, content, calls = self.parser.parse(text)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]
                reason = "tool_calls"
            message["reasoning"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            usage = self._usage(usage)
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.lp is not None:
            choice["logprobs"] = self.lp.whole()
        if self.params.return_token_ids:
            choice["token_ids"] = ids
        return web.json_response({
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [choice], "usage": usage,
            "nexrt_timing": timing}, headers=self.headers)


class SSEOutput(Output):
    streams = True

    async def start(self) -> None:
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                "Cache-Control": "no-cache", **self.headers})
        await self.resp.prepare(self.request)
        self.started = True
        if self.chat:
            await self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None})

    async def _send(self, obj) -> None:
        await self.resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    async def _chunk(self, choice: dict | None, **extra) -> None:
        if choice is not None and self.lp is not None:
            # the tokens since the last chunk (a token without text of its own rides on the next)
            choice["logprobs"] = self.lp.pending()
        await self._send({"id": self.id,
                          "object": "chat.completion.chunk" if self.chat else "text_completion",
                          "created": self.created, "model": self.model,
                          "choices": [choice] if choice else [], **extra})

    def _choice(self, text: str, reason: str | None) -> dict:
        if self.chat:
            return {"index": 0, "delta": {"content": text} if text or not reason else {},
                    "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    async def text(self, delta: str) -> None:
        if delta:
            await self._chunk(self._choice(delta, None))

    async def delta(self, delta: dict) -> None:
        """A parsed chat delta (content / reasoning / tool_calls), as vLLM's DeltaMessage."""
        await self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    async def fail(self, status: int, message: str) -> web.StreamResponse:
        # Fail closed: an explicit error event, then the terminator; never a silent truncation.
        await self._send(APIError(status, message).body())
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp

    async def finish(self, reason: str, usage: dict, timing: dict,
                     ids: list[int]) -> web.StreamResponse:
        # A degraded stream says so even without a usage chunk (its headers may predate it).
        extra = ({"nexrt_timing": timing} if "degraded" in timing and not self.params.include_usage
                 else {})
        if self.parser is not None:
            usage = self._usage(usage)
            if reason == "stop" and self.parser.tools_streamed:
                reason = "tool_calls"
        await self._chunk(self._choice("", reason), **extra)
        if self.params.include_usage:
            await self._chunk(None, usage=usage, nexrt_timing=timing)
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp


class Gen:
    """The response being produced for one interactive request, whichever leg produces it."""

    def __init__(self, out: Output, tokenizer, params: P.GenParams, prompt_ids: list[int],
                 prompt_len: int, max_tokens: int | None, parser: ChatParser | None = None,
                 special_ids: frozenset[int] = frozenset()):
        self.out = out
        self.parser = out.parser = parser
        self.detok = Detokenizer(tokenizer, prompt_ids, skip_special_tokens=(
            parser is None or parser.skip_special_tokens))
        self.special_ids = special_ids
        self.texts: list[str] = []          # per-token text (the parsed path's token counts)
        self._held: tuple[str, bool, bool] | None = None   # (text, special, from_node)
        self.stopper = StopStrings(params.stop)
        self.stop_ids = set(params.stop_token_ids)
        self.prompt_ids = list(prompt_ids)
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.ids: list[int] = []
        self.finish: str | None = None
        self.node_tokens = 0
        self.node_text_sent = False   # a stream already carries text the node produced
        self.lp: Logprobs | None = None   # the response's logprobs, when asked for

    async def push(self, tok: int, *, render: bool = True, from_node: bool = False) -> bool:
        """Append one token and send its text (stop ids and hidden tokens render nothing);
        True once a stop string completed."""
        self.ids.append(tok)
        self.node_tokens += from_node
        if self.parser is not None:
            return await self._push_parsed(tok, render, from_node)
        if render and tok not in self.stop_ids:
            text = self.stopper.push(self.detok.step(tok))
            if text:
                await self.out.text(text)
                self.node_text_sent |= from_node and self.out.streams
            if self.stopper.stopped:
                self.finish = "stop"
        return self.finish == "stop"

    async def _push_parsed(self, tok: int, render: bool, from_node: bool) -> bool:
        """The parser gets each token's text (after stop strings) with `finished` set on the last
        one. Whether a token is the last is known on arrival, except for a special token (EOS
        ends the node's stream with nothing after it): that one waits for the next message."""
        text = ""
        if render and tok not in self.stop_ids:
            text = self.stopper.push(self.detok.step(tok))
            if self.stopper.stopped:
                self.finish = "stop"
        self.texts.append(text)
        await self._release()
        final = (self.finish == "stop" or not render or tok in self.stop_ids
                 or (self.max_tokens is not None and len(self.ids) >= self.max_tokens))
        if final or tok in self.special_ids:
            self._held = (text, tok in self.special_ids, from_node)
        else:
            await self._emit(text, False, 1, from_node)
        return self.finish == "stop"

    async def _release(self) -> None:
        if self._held is not None:
            (text, _special, from_node), self._held = self._held, None
            await self._emit(text, False, 1, from_node)

    async def _emit(self, text: str, finished: bool, count: int, from_node: bool) -> None:
        if not self.out.streams:
            await self.out.text(text)
            return
        d = self.parser.feed(text, finished=finished, token_count=count,
                             prompt_ids=self.prompt_ids)
        if d is not None:
            await self.out.delta(d)
            self.node_text_sent |= from_node

    async def close_text(self) -> None:
        """End of generation: what stop strings held back, and the parser's final feed."""
        tail = self.stopper.flush()
        if self.parser is None:
            await self.out.text(tail)
            return
        text, count, from_node = tail, 0, False
        if self._held is not None:
            (held, special, from_node), self._held = self._held, None
            count = 1
            # A special token that ended the stream with "stop" is EOS: vLLM shows no text for it.
            text = ("" if special and self.finish == "stop" else held) + tail
        await self._emit(text, True, count, from_node)


class Renderer:
    """Builds each interactive request's response (a Gen over the right Output) and finishes it;
    the same for the fast path and the standard path."""

    def __init__(self, args: argparse.Namespace, models: Models, metrics: Metrics):
        self.args, self.models, self.metrics = args, models, metrics

    def new_gen(self, rq, prompt_ids, prompt_len: int, max_tokens: int | None,
                degraded: Reason | None) -> Gen:
        headers = {DEGRADED_HEADER: degraded.value} if degraded is not None else {}
        out = (SSEOutput if rq.params.stream else JSONOutput)(rq.request, rq.params, rq.model, headers)
        parser = self.chat_parser(rq)
        special_ids = self.models.special_tokens()[1] if parser is not None else frozenset()
        gen = Gen(out, self.models.tokenizer, rq.params, prompt_ids, prompt_len, max_tokens,
                  parser, special_ids)
        if rq.params.logprobs is not None:
            gen.lp = out.lp = Logprobs(self.models.texts, rq.params.kind == "chat", rq.params.logprobs)
        return gen

    def chat_parser(self, rq) -> ChatParser | None:
        """vLLM's composed output parser for a chat request (None: the text is the content)."""
        a = self.args
        tool_parser = a.tool_call_parser if a.enable_auto_tool_choice else None
        if rq.kind != "chat" or (a.reasoning_parser is None and tool_parser is None):
            return None
        special, _ = self.models.special_tokens()
        return ChatParser(ChatOptions.from_request(rq.body, a.default_chat_template_kwargs),
                          reasoning_parser=a.reasoning_parser, tool_parser=tool_parser,
                          drop_tokens=special, token_id=self.models.tokenizer.token_to_id)

    async def finish(self, rq) -> web.StreamResponse:
        gen = rq.gen
        await gen.close_text()
        self.metrics.tokens.inc(len(gen.ids))
        usage = {"prompt_tokens": gen.prompt_len, "completion_tokens": len(gen.ids),
                 "total_tokens": gen.prompt_len + len(gen.ids)}
        if gen.parser is not None and gen.parser.reasoning is not None:
            gen.out.usage_details = lambda: {"reasoning_tokens": gen.parser.count_reasoning_tokens(
                gen.ids, gen.texts)}
        rq.timing["total_s"] = time.monotonic() - rq.t_recv
        return await gen.out.finish(gen.finish, usage, rq.timing, gen.ids)
