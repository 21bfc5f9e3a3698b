"""The connector under vLLM tensor parallelism, pinned on CPU: every TP rank's KV cache is
allocated by vLLM's own code at that rank's head counts (tests/connector/test_gpu_layouts.py
`Cache`), holds the rank's shard of the engine's prefill state as the kernels write it, and the
connector's `detect` gives each rank's layout its sharding (KV heads once: a replica ships no
attention layers); the node takes the N rank layouts as the N parts of one hand-off (check_part,
every head once, regions in one buffer) and `load_parts` rebuilds the engine's state from them
for a node at TP = 1, bit for bit, and re-shards them for a node at TP = 2."""
import types

import pytest
import torch

from nexrt_vllm.connector.layouts import LayoutError, detect
from nexrt_vllm.engine import Engine
from nexrt_vllm.engine.tp import local_config
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.node.parts import PartSet, check_part, load_parts
from nexrt_vllm.node.reshard import node_shards, prefill_parts, split_state
from test_gpu_layouts import Cache, _blocks, _hf  # vLLM's allocation of a KV cache, the kernels' writes

torch.set_num_threads(1)
SHAPE = dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
F32 = {"kv": torch.float32, "conv": torch.float32, "rec": torch.float32}


@pytest.fixture(scope="module")
def model(ckpt_factory):
    path = ckpt_factory("qwen3_next", "bfloat16", **SHAPE)
    eng = Engine.from_pretrained(path, dtype="float32", max_seq_len=256, progress=False)
    prompt = [(5 * i + 2) % 300 + 3 for i in range(150)]
    eng.prefill(prompt)
    n, state = eng.export_state()
    return eng.config, n, state


def _global_hf(cfg):
    return types.SimpleNamespace(**vars(_hf(cfg)), num_key_value_heads=cfg.num_kv_heads)


def _rank_parts(cfg, n, state, tp, backend="FLASH_ATTN", kv_layout="LBNHC"):
    """Each rank: its cache (vLLM's allocation at its head counts), its shard written in, `detect`."""
    held = split_state(cfg, state, node_shards(cfg, tp))  # what each rank's cache holds (replicas too)
    out = []
    for r in range(tp):
        cache = Cache(local_config(cfg, tp), kv_layout, backend, "SD", torch.float32, kv_dtype=torch.float32)
        cache.vllm_config.model_config.hf_text_config = _global_hf(cfg)
        blocks = _blocks(cache, n)
        cache.write(held[r], n, blocks)
        found = detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="cuda",
                       backend_of=lambda name: (backend, None), tp=(r, tp))
        out.append((cache, blocks, found))
    return out


def _to_node(cfg, n, ranks):
    """The node's side: every rank's layout as a part, planned into one buffer; the pages shipped there."""
    parts = PartSet(len(ranks), n)
    planned = []
    for cache, blocks, found in ranks:
        check_part(found.layout, cfg)
        planned.append(parts.plan(found.layout, n, 1 << 30))
    parts.check_cover(cfg)
    buf = torch.zeros(P.align_up(parts.end), dtype=torch.uint8)
    for (cache, blocks, found), part in zip(ranks, planned):
        one, regions = cache.ship(found, n, blocks)
        for reg, mine in zip(regions, part.regions):  # the same layers, at the part's offsets
            buf[mine.offset: mine.offset + mine.nbytes] = one[reg.offset: reg.offset + reg.nbytes]
        part.done = True
    assert parts.complete
    return buf, parts


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_layouts_are_the_parts_of_one_handoff(model, tp):
    cfg, n, state = model
    ranks = _rank_parts(cfg, n, state, tp)
    shardings = [found.layout.sharding for _, _, found in ranks]
    assert shardings == prefill_parts(cfg, tp)
    for (_, _, found), sh in zip(ranks, shardings):
        kinds = {lay.kind for lay in found.layout.layers}
        assert kinds == ({"attention", "gdn"} if sh.kv_heads is not None else {"gdn"})
        assert all(lay.shape[0] == 2 // min(tp, 2) for lay in found.layout.layers if lay.kind == "attention")
    buf, parts = _to_node(cfg, n, ranks)

    class One:  # a node at TP = 1
        config, tp = cfg, 1

        def import_state(self, seq_len, tensors):
            self.got = (seq_len, tensors)

    node = One()
    load_parts(node, buf, parts, F32)
    seq_len, got = node.got
    assert seq_len == n and set(got) == set(state)
    for name, want in state.items():
        want = want if not name.endswith(".conv") else want.to(torch.bfloat16).float()  # conv pages are bf16
        assert torch.equal(got[name][:, :n] if name.endswith((".k", ".v")) else got[name], want), name

    class Two(One):  # a node at TP = 2 gets each rank's shard
        tp = 2

        def import_shards(self, seq_len, shards):
            self.got = (seq_len, shards)

    node = Two()
    load_parts(node, buf, parts, F32)
    _, shards = node.got
    ref = split_state(cfg, got, node_shards(cfg, 2))
    for mine, exp in zip(shards, ref):
        assert set(mine) == set(exp) and all(torch.equal(mine[k], exp[k]) for k in exp)


def test_a_rank_cache_at_full_heads_is_refused(model):
    cfg, n, state = model
    cache = Cache(cfg, "LBNHC", "FLASH_ATTN", "SD", torch.float32)
    cache.vllm_config.model_config.hf_text_config = _global_hf(cfg)
    with pytest.raises(LayoutError):  # GDN state of the whole model where a rank holds half the heads
        detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="cuda",
               backend_of=lambda name: ("FLASH_ATTN", None), tp=(0, 2))
    with pytest.raises(LayoutError, match="tensor parallel size 3"):
        detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="cuda",
               backend_of=lambda name: ("FLASH_ATTN", None), tp=(0, 3))


def test_part_conv_must_match_its_heads(model):
    """vLLM's own per-rank conv (its weight loader splits q, k and v separately) is what a rank ships;
    the connector never slices channels. A part whose conv width is not that of the heads it names
    is refused at hello/begin."""
    cfg, n, state = model
    (_, _, found), _ = _rank_parts(cfg, n, state, 2)[:2]
    lay = found.layout
    wrong = L.Layout(lay.model, lay.block_size, tuple(
        x if x.kind != "gdn" else L.GDNLayout(x.index, x.conv_layout, x.conv_dtype, (x.conv_shape[0], cfg.conv_dim),
                                               (cfg.conv_dim, 1), x.rec_layout, x.rec_dtype, x.rec_shape,
                                               x.rec_strides)
        for x in lay.layers), sharding=lay.sharding)
    with pytest.raises(P.ProtocolError, match="q\\|k\\|v of 2 key and 4 value heads"):
        check_part(wrong, cfg)
