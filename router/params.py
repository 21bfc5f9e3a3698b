"""Validation of interactive requests and the body of the vLLM prefill leg.

The interactive tier decodes one sequence with temperature/top-p/top-k sampling, optionally
with logprobs and under a grammar (structured output). What is malformed, or what vLLM also
refuses, is a 400 (APIError); what vLLM serves but the tier does not is `Unsupported` (the
standard path serves it, or with `--fallback error` its 400/501 is the answer), never silently
ignored. Sampling defaults are resolved here once and sent identically to vLLM and the
node, so both legs sample the same way (vLLM would otherwise apply the model's
generation_config defaults to the first token only).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nexrt_vllm.handoff.contracts import Claim, ContractError, Sampling
from nexrt_vllm.handoff.structured import LOGPROBS_MAX, StructuredError, StructuredSpec

from .errors import APIError
from .fallback import Reason

# field -> predicate that is True when the value is the no-op default the tier can accept.
_UNSUPPORTED = {
    "n": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "prompt_logprobs": lambda v: v is None,
    "logprob_token_ids": lambda v: not v,
    "return_tokens_as_token_ids": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: not v,
    "min_p": lambda v: v in (None, 0, 0.0),
    "min_tokens": lambda v: v in (None, 0),
    "use_beam_search": lambda v: not v,
    "functions": lambda v: not v,
    "echo": lambda v: not v,
    "suffix": lambda v: v is None,
    "bad_words": lambda v: not v,
    "allowed_token_ids": lambda v: v is None,
    "include_stop_str_in_output": lambda v: not v,
    "skip_special_tokens": lambda v: v in (None, True),
}

# Fields the router owns on the prefill leg (replaced or handled router-side).
_ROUTER_FIELDS = ("stream", "stream_options", "max_tokens", "max_completion_tokens", "stop",
                  "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids",
                  "return_token_ids", "kv_transfer_params")

MAX_STOP_STRINGS = 16

# Chat's tools, tool_choice, parallel_tool_calls, chat_template_kwargs, reasoning_effort and
# include_reasoning go unchanged to the prefill leg (vLLM renders them with the chat template);
# the router parses the output (router/chat_parser.py).
_AUTO_TOOLS_MSG = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                   "to be set")
# vLLM turns these into a grammar over the tools' JSON schemas and parses its JSON output as the
# calls (per tool parser); the router does neither for tools.
_CONSTRAINED = ("needs constrained decoding to the tools' JSON schema, which the interactive tier "
                "does not do for tools (send the request as class 'standard' instead)")


class Unsupported(APIError):
    """A request vLLM serves that the interactive tier cannot: `reason` is the degrade reason;
    status and message are the answer under `--fallback error`."""

    def __init__(self, reason: Reason, status: int, message: str, *, param: str | None = None):
        super().__init__(status, message, param=param)
        self.reason = Reason(reason)


@dataclass
class GenParams:
    kind: str                      # "chat" | "completion"
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None         # None: up to the context limit
    stop: list[str] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)   # sent identically to both legs
    return_token_ids: bool = False  # non-streaming only: completion token ids in the choice
    logprobs: int | None = None    # top alternatives per token (chat top_logprobs); None: off
    structured: StructuredSpec | None = None   # the grammar both legs decode under

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.sampling.stop_token_ids


def _bad(msg: str, param: str | None = None) -> APIError:
    return APIError(400, msg, param=param)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# vLLM 0.32 dropped the guided_* fields (it ignores them with a warning): refuse rather than
# decode unconstrained.
_LEGACY_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
                  "guided_decoding_backend")
# structured_outputs options the node's grammar compiler does not take (it compiles as vLLM's
# defaults): accepted only at their defaults.
_SO_OPTIONS = {"disable_any_whitespace": False, "disable_additional_properties": False,
               "whitespace_pattern": None, "structural_tag": None}
_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object"}


def _logprobs(body: dict, kind: str) -> int | None:
    """The number of top alternatives per token the request asks for (vLLM's rules), or None."""
    if kind == "chat":
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp not in (None, True, False):
            raise _bad("'logprobs' must be a boolean", "logprobs")
        if top is not None and not _is_int(top):
            raise _bad("`top_logprobs` must be an integer.", "top_logprobs")
        if top is not None and top < 0 and top != -1:
            raise _bad("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if top not in (None, 0) and not lp:
            raise _bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        k, name = (top or 0) if lp else None, "top_logprobs"
    else:
        k, name = body.get("logprobs"), "logprobs"
        if k is not None and not _is_int(k):
            raise _bad("`logprobs` must be an integer.", "logprobs")
    if k is not None and not 0 <= k <= LOGPROBS_MAX:
        raise Unsupported(Reason.LOGPROBS, 400, f"'{name}'={k}: the interactive tier returns at most "
                          f"{LOGPROBS_MAX} logprobs per token (vLLM's default max_logprobs); -1 (the "
                          f"whole vocabulary) is not supported", param=name)
    return k


def _structured(body: dict) -> StructuredSpec | None:
    """The grammar of response_format / structured_outputs (vLLM's precedence: response_format
    overrides), or None; 400 for a malformed one, Unsupported for what the node does not enforce
    as vLLM would."""
    for name in _LEGACY_GUIDED:
        if body.get(name) is not None:
            raise Unsupported(Reason.GRAMMAR, 400, f"'{name}' is not supported (vLLM 0.32 ignores it); "
                              f"use 'structured_outputs' or 'response_format'", param=name)
    spec = None
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("'structured_outputs' must be an object", "structured_outputs")
        for k, default in _SO_OPTIONS.items():
            if so.get(k, default) not in (default, None):
                raise Unsupported(Reason.GRAMMAR, 400, f"'structured_outputs.{k}' is not supported on the "
                                  f"interactive tier (the node compiles grammars with vLLM's defaults)",
                                  param="structured_outputs")
        unknown = sorted(set(so) - set(_SO_KINDS) - set(_SO_OPTIONS))
        if unknown:
            raise Unsupported(Reason.GRAMMAR, 400, f"'structured_outputs' has unknown fields {unknown}",
                              param="structured_outputs")
        kinds = [k for k in _SO_KINDS if so.get(k) is not None]
        if len(kinds) != 1:
            raise _bad("'structured_outputs' must set exactly one of json, regex, choice, grammar, "
                       f"json_object (got {kinds or 'none'})", "structured_outputs")
        kind = kinds[0]
        if kind == "json_object" and so[kind] is not True:
            raise _bad("'structured_outputs.json_object' must be true", "structured_outputs")
        spec = _spec(_SO_KINDS[kind], None if kind == "json_object" else so[kind], "structured_outputs")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise _bad("'response_format' must be an object with a 'type'", "response_format")
        t = rf["type"]
        if t == "json_object":
            spec = _spec("json_object", None, "response_format")
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or js.get("schema") is None:
                raise _bad("When response_format type is 'json_schema', the 'json_schema' field with its "
                           "'schema' must be provided.", "response_format")
            spec = _spec("json_schema", js["schema"], "response_format")
        elif t != "text":
            msg = (f"response_format type {t!r} is not supported on the interactive tier "
                   f"(supported: text, json_object, json_schema)")
            if t == "structural_tag":      # vLLM's; any other type vLLM refuses too
                raise Unsupported(Reason.GRAMMAR, 400, msg, param="response_format")
            raise _bad(msg, "response_format")
    return spec


def _spec(kind: str, value, param: str) -> StructuredSpec:
    try:
        spec = StructuredSpec(kind, value)
    except StructuredError as e:
        raise _bad(f"'{param}': {e}", param) from None
    why = spec.unsupported()
    if why:
        # vLLM's `auto` backend would switch to another library for these
        raise Unsupported(Reason.GRAMMAR, 400, f"'{param}': {why} on the interactive tier", param=param)
    return spec


def _check_tools(body: dict, auto_tools: bool) -> None:
    """vLLM's own 400s for tool fields; Unsupported where the router has no tool parser or vLLM
    would constrain decoding."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools == []:
        raise _bad("`tools` must not be an empty array. Either provide at least one tool or omit "
                   "the field entirely.", "tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise _bad("'tools' must be a list of tool objects", "tools")
    if choice is None and tools:
        choice = "auto"
    if choice is None or choice == "none":
        return
    if tools is None:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise _bad(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", "
                   f"\"auto\" or \"required\" are supported.", "tool_choice")
    if choice == "auto" and not auto_tools:
        raise Unsupported(Reason.TOOL_PARSER, 400, _AUTO_TOOLS_MSG, param="tool_choice")
    if choice == "required":
        raise Unsupported(Reason.TOOL_CHOICE_REQUIRED, 400, f"tool_choice 'required' {_CONSTRAINED}",
                          param="tool_choice")
    if isinstance(choice, dict):
        raise Unsupported(Reason.TOOL_CHOICE_NAMED, 400, f"tool_choice a named function {_CONSTRAINED}",
                          param="tool_choice")
    if any(isinstance(t.get("function"), dict) and t["function"].get("strict") for t in tools):
        raise Unsupported(Reason.STRICT_TOOLS, 400, f"a tool with \"strict\": true {_CONSTRAINED}",
                          param="tools")
    if body.get("parallel_tool_calls") is False:
        raise Unsupported(Reason.PARALLEL_TOOL_CALLS, 400,
                          f"'parallel_tool_calls': false with tools {_CONSTRAINED}",
                          param="parallel_tool_calls")


def asks_for_reasoning(body: dict) -> bool:
    """The chat request asks for reasoning (which vLLM with --reasoning-parser splits out)."""
    kwargs = body.get("chat_template_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    return bool(body.get("reasoning_effort") not in (None, "none") or body.get("include_reasoning")
                or kwargs.get("enable_thinking") or kwargs.get("thinking"))


def parse(body, kind: str, max_model_len: int | None, auto_tools: bool = False,
          reasoning: bool = False) -> GenParams:
    """Validate a chat/completions body for the interactive tier; raise APIError for what is
    malformed (or vLLM refuses too), Unsupported for what only the standard path serves.

    `auto_tools`: the router parses tool calls (--enable-auto-tool-choice --tool-call-parser);
    `reasoning`: it splits reasoning out of chat output (--reasoning-parser)."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise _bad("'messages' must be a non-empty list of message objects", "messages")
    else:
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            if len(p) > 1:
                raise Unsupported(Reason.BATCHED_PROMPT, 501, "batched prompts are not supported on the "
                                  "interactive tier; send one prompt per request", param="prompt")
            p = p[0]
        # token ids: ints, not bools (the type itself: one C-level pass over an agent's 64K ids, not 64K calls)
        ids_ok = isinstance(p, list) and set(map(type, p)) <= {int}
        if not p or not (isinstance(p, str) or ids_ok):
            raise _bad("'prompt' must be a non-empty string or list of token ids", "prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")

    if kind == "chat":
        _check_tools(body, auto_tools)
    else:
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, "none", []):
                raise Unsupported(Reason.COMPLETION_TOOLS, 501, f"'{name}'={body[name]!r} is not "
                                  f"supported on the interactive tier (send the request as class "
                                  f"'standard' instead)", param=name)
    for name, ok in _UNSUPPORTED.items():
        if name in body and not ok(body[name]):
            raise Unsupported(Reason.REQUEST_OPTION, 501, f"'{name}'={body[name]!r} is not supported "
                              f"on the interactive tier (send the request as class 'standard' "
                              f"instead)", param=name)

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(so, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        include_usage = so.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")

    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",):
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v):
            raise _bad(f"'{name}' must be an integer", name)
        if v < 1:
            raise _bad(f"'{name}' must be at least 1, got {v}", name)
        if max_model_len is not None and v > max_model_len:
            raise _bad(f"'{name}'={v} exceeds the model's maximum context length "
                       f"({max_model_len} tokens)", name)
        max_tokens = v
        break

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")

    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(_is_int(t) and t >= 0 for t in stop_ids)):
        raise _bad("'stop_token_ids' must be a list of non-negative integers", "stop_token_ids")

    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not _is_num(temperature) or temperature < 0:
        raise _bad("'temperature' must be a number >= 0", "temperature")
    top_p = body.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise _bad("'top_p' must be a number in (0, 1]", "top_p")
    top_k = body.get("top_k")
    top_k = 0 if top_k in (None, -1) else top_k
    if not _is_int(top_k) or top_k < 0:
        raise _bad("'top_k' must be an integer: 0 or -1 (disabled) or >= 1", "top_k")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("'seed' must be an integer", "seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
    try:
        # the node's contract is stricter in corners (finite numbers, seed range) than vLLM's
        sampling = Sampling(temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed,
                            ignore_eos=ignore_eos, stop_token_ids=tuple(stop_ids))
    except ContractError as e:
        raise Unsupported(Reason.REQUEST_OPTION, 400, f"'{e.field}' {e.problem}", param=e.field) from None

    return_ids = body.get("return_token_ids", False)
    if return_ids not in (None, False, True):
        raise _bad("'return_token_ids' must be a boolean", "return_token_ids")
    if return_ids and stream:
        raise Unsupported(Reason.REQUEST_OPTION, 501, "'return_token_ids' is supported without "
                          "streaming only on the interactive tier", param="return_token_ids")

    logprobs = _logprobs(body, kind)
    structured = _structured(body)
    if structured is not None and reasoning and kind == "chat":
        # vLLM enforces the grammar only after the reasoning ends; the node enforces it from the
        # first token on.
        raise Unsupported(Reason.REASONING_GRAMMAR, 400, "structured output together with a reasoning "
                          "parser is not supported on the interactive tier (the grammar would apply "
                          "to the reasoning too)", param="response_format"
                          if body.get("response_format") is not None else "structured_outputs")

    return GenParams(kind=kind, model=model, stream=stream, include_usage=include_usage,
                     max_tokens=max_tokens, stop=stop, sampling=sampling,
                     return_token_ids=bool(return_ids), logprobs=logprobs, structured=structured)


def prefill_body(body: dict, params: GenParams, model: str, claim: Claim) -> dict:
    """The client's body rewritten for the vLLM leg: one token, non-streaming, token ids back."""
    out = {k: v for k, v in body.items() if k not in _ROUTER_FIELDS}
    out.update(params.sampling.to_wire())
    out.update(model=model, max_tokens=1, stream=False, return_token_ids=True,
               kv_transfer_params=claim.to_params())
    return out


def _standard_common(params: GenParams, max_tokens: int | None) -> dict:
    out = params.sampling.to_wire()
    out.update(stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    if params.stop:
        out["stop"] = list(params.stop)  # vLLM stops early; the router's own cut stays authoritative
    return out


def standard_body(body: dict, params: GenParams, model: str) -> dict:
    """The client's request for the standard path (nothing prefilled yet): the same prompt, the
    sampling the fast path would have used, streamed with token ids so the router renders it."""
    out = {k: v for k, v in body.items() if k not in _ROUTER_FIELDS}
    out.update(_standard_common(params, params.max_tokens), model=model)
    return out


def continuation_body(params: GenParams, model: str, token_ids: list[int], max_tokens: int) -> dict:
    """The standard path continuing a request whose first tokens exist (vLLM's first token, maybe
    some of the node's): prompt ids + those tokens as a token prompt; vLLM's prefix cache makes
    the re-prefill cheap and the continuation is what vLLM alone would have generated next."""
    out = _standard_common(params, max_tokens)
    out.update(model=model, prompt=list(token_ids))
    return out
