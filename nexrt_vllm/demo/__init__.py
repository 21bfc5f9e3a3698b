"""``nexrt-vllm demo``: the whole stack (vLLM + connector, a decode node, the router) on one machine."""
