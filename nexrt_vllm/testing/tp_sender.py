"""A fake prefill pool at TP = N for node tests: one process plays N vLLM TP ranks.

`ShardedPrefillSide` prefills with the (TP = 1) engine, cuts the state into the N parts vLLM
TP = N would ship (`nexrt_vllm.node.reshard.prefill_parts`: KV heads once, GDN heads, conv per
q|k|v segment), packs each part into its own vLLM-like paged cache and sends it with its own
`HandoffSender`, as every TP rank's connector worker does: begin, page writes and done per part.
`layout_for_part` is the descriptor of one part's pages.
"""
from __future__ import annotations

import torch

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.testing.node_process import NodeProcess


class ShardedPrefillSide:
    def __init__(self, model: str, transport: str, n: int, *, max_seq_len: int = 512, block_size: int = 16,
                 **layout_kw):
        from nexrt_vllm.engine import Engine
        from nexrt_vllm.handoff.sender import HandoffSender

        torch.set_num_threads(1)
        self.n, self.block_size, self.layout_kw = n, block_size, layout_kw
        self.engine = Engine.from_pretrained(model, max_seq_len=max_seq_len, progress=False)
        self.senders = [HandoffSender(transport, control_timeout=5.0, transfer_timeout=10.0) for _ in range(n)]
        self._caches = []  # every registered cache lives as long as its sender

    def prepare(self, prompt: list[int]) -> dict:
        """Prefill; returns the first token, seq_len and per part {"layout", "pages"}."""
        from nexrt_vllm.node.reshard import prefill_parts, split_state
        from nexrt_vllm.testing.senders import pack_state

        cfg = self.engine.config
        first = int(self.engine.prefill(prompt).argmax())
        seq_len, state = self.engine.export_state()
        shardings = prefill_parts(cfg, self.n)
        parts = []
        for r, (sh, st) in enumerate(zip(shardings, split_state(cfg, state, shardings))):
            layout = layout_for_part(cfg, sh, block_size=self.block_size, **self.layout_kw)
            cache, pages = pack_state(st, seq_len, layout, seed=r)
            self.senders[r].register(cache.data_ptr(), cache.numel())
            self._caches.append(cache)
            base = cache.data_ptr()
            parts.append({"layout": layout, "pages": {i: [base + o for o in offs] for i, offs in pages.items()}})
        return {"first": first, "seq_len": seq_len, "parts": parts}

    def begin(self, node: NodeProcess, rid: str, generation: int, prep: dict, r: int):
        """Part r's begin only (a Transfer: write_pages / done / abort it by hand)."""
        return self.senders[r].begin(node.control_addr, prep["parts"][r]["layout"], rid, generation, prep["seq_len"])

    def send(self, node: NodeProcess, rid: str, generation: int, prep: dict, ranks=None) -> list:
        """Every part (or those in `ranks`), one after the other: begin, pages, done."""
        out = []
        for r in range(self.n) if ranks is None else ranks:
            p = prep["parts"][r]
            out.append(self.senders[r].send(node.control_addr, p["layout"], rid, generation, prep["seq_len"],
                                            p["pages"]))
        return out

    def reference(self, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
        return self.engine.generate(prompt, max_new_tokens, **kw)

    def close(self) -> None:
        for s in self.senders:
            s.close()


def layout_for_part(cfg, sharding, **kw) -> L.Layout:
    """The descriptor of vLLM-like pages of one TP part (``testing.senders.layout_for`` at the part's head
    counts, attention layers only if it ships KV heads)."""
    from dataclasses import replace

    from nexrt_vllm.testing.senders import layout_for

    n = lambda r: 0 if r is None else r[1] - r[0]  # noqa: E731
    part_cfg = replace(cfg, num_kv_heads=n(sharding.kv_heads), linear_num_key_heads=n(sharding.k_heads),
                       linear_num_value_heads=n(sharding.v_heads))
    lay = layout_for(part_cfg, **kw)
    layers = tuple(x for x in lay.layers if x.kind != "attention" or sharding.kv_heads is not None)
    return replace(lay, layers=layers, sharding=sharding)
