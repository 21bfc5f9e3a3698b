"""NexRT router: the OpenAI-compatible front of the fast-decode tier (`nexrt-router`).

Interactive requests go vLLM prefill (max_tokens=1, KV handed to a decode node) → NexRT decode node;
standard requests are proxied unchanged to an ordinary OpenAI server. This package never imports
torch or vLLM, so it runs on a small CPU-only front host.
"""
