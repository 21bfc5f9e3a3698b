"""vLLM-CPU's attention page interiors, pinned against vLLM's own cache-write kernel for every CPU
ISA: K/V written by `cpu_attn_reshape_and_cache` into scattered blocks, shipped page by page as the
connector does, and read back by the node's `unpack_state` with the format the connector names.
vLLM's kernels refuse "amx" on a host without AMX tiles (vLLM never picks it there): that case runs
where vLLM would pick it, and `test_pack_state_is_the_inverse` covers the format on every host."""
import pytest
import torch

from nexrt_vllm.connector.layouts import CPU_ISA_FORMATS
from nexrt_vllm.engine.state import AttentionState
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.node.convert import unpack_state


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("isa", sorted(CPU_ISA_FORMATS))
def test_page_interior_matches_vllm_kernel(isa, head_dim):
    from vllm import _custom_ops as ops

    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this host has no AMX tiles: vLLM's amx cache-write kernel refuses to run")
    torch.manual_seed(0)
    heads, bs, seq_len = 2, 64, 150
    blocks = [5, 1, 3]  # sequence pages live in scattered blocks
    cache = torch.zeros(8, heads, bs, 2 * head_dim, dtype=torch.bfloat16)
    k_cache, v_cache = cache.view(8, heads, 2 * bs, head_dim).chunk(2, dim=2)
    k = torch.randn(seq_len, heads, head_dim).to(torch.bfloat16)
    v = torch.randn(seq_len, heads, head_dim).to(torch.bfloat16)
    slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(seq_len)])
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    layer = L.AttentionLayout(0, "bfloat16", tuple(cache.shape[1:]), tuple(cache.stride()[1:]),
                              kv_format=CPU_ISA_FORMATS[isa])
    layout = L.Layout({"num_hidden_layers": 1}, bs, (layer,))
    regions = layout.regions(seq_len)
    buf = torch.zeros(P.align_up(regions[0].offset + regions[0].nbytes), dtype=torch.uint8)
    for slot, b in enumerate(blocks):  # what the connector writes: page `slot` from block `b`
        off = regions[0].offset + slot * regions[0].page_bytes
        buf[off: off + regions[0].page_bytes] = cache[b].contiguous().view(torch.uint8).reshape(-1)
    got = unpack_state(buf, layout, regions, seq_len, {"kv": torch.bfloat16})
    native = AttentionState.from_named(got, 0)
    assert torch.equal(native.k, k.transpose(0, 1))
    assert torch.equal(native.v, v.transpose(0, 1))


@pytest.mark.parametrize("fmt", ["packed", "cpu_vec", "cpu_amx"])
def test_pack_state_is_the_inverse(fmt):
    """`pack_state` (the benchmark's/tests' stand-in sender) writes the same interiors."""
    from nexrt_vllm.testing.senders import pack_state

    heads, bs, d, seq_len = 2, 32, 64, 70
    shape = (heads, bs, 2 * d)
    layout = L.Layout({"num_hidden_layers": 1}, bs, (L.AttentionLayout(0, "bfloat16", shape, (bs * 2 * d, 2 * d, 1),
                                                                      kv_format=fmt),))
    want = AttentionState(k=torch.randn(heads, seq_len, d).to(torch.bfloat16),
                          v=torch.randn(heads, seq_len, d).to(torch.bfloat16))
    state = want.named(0)
    cache, pages = pack_state(state, seq_len, layout)
    (reg,) = layout.regions(seq_len)
    buf = torch.zeros(P.align_up(reg.offset + reg.nbytes), dtype=torch.uint8)
    for slot, off in enumerate(pages[0]):
        buf[reg.offset + slot * reg.page_bytes: reg.offset + (slot + 1) * reg.page_bytes] = \
            cache[off: off + reg.page_bytes]
    got = unpack_state(buf, layout, [reg], seq_len, {"kv": torch.bfloat16})
    native = AttentionState.from_named(got, 0)
    assert torch.equal(native.k, want.k) and torch.equal(native.v, want.v)
