"""Text-only port of vLLM's declarative parser engine (`vllm/parser/engine/`, vLLM 0.32).

vLLM parses Qwen3 / Qwen3.5 output (`<think>` reasoning and `<tool_call><function=…>` calls) with
one state machine: an incremental lexer turns text into terminals (holding back any suffix that may
still become a terminal), a transition table turns terminals into semantic events, and
`EngineParser` turns events into OpenAI deltas. The router must produce the same deltas without
importing vLLM, so this package follows vLLM's code path for path, including its quirks (content
after a tool call is held until a delta without tool-call fragments; whitespace-only content waits
until it is followed by text); tests/router/test_tool_parsers.py and test_reasoning_parser.py check
every output against vLLM's own parsers.

`lexer` (text → terminals), `engine` (terminals → events), `deltas` (events → deltas and calls),
`arguments` (schema typing, safe streaming prefix), `qwen3` (the Qwen3 / Qwen3.5 grammar).

Not ported: vLLM's token-id scanner. The router feeds per-token text; vLLM additionally refuses to
treat a marker as markup when the model spelled it out of several tokens (a streaming-only
difference: vLLM's non-streaming path is text-only too).
"""
