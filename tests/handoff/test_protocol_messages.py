"""Wire messages and layout descriptors: round trips and typed refusals for bad input."""
import msgpack
import pytest

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P


def _layout(**over):
    return L.Layout(
        model={"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100},
        block_size=16,
        layers=(L.GDNLayout(0, "SD", "bfloat16", (3, 96), (96, 1), "HVK", "float32", (4, 8, 16), (128, 16, 1)),
                L.AttentionLayout(3, "bfloat16", (2, 16, 64), (1024, 64, 1))),
        **over)


def test_every_message_round_trips():
    lay = _layout().to_wire()
    msgs = [P.Hello(lay), P.HelloOk({"backend": "nixl", "metadata": b"\x00\xff"}, {"max_seq_len": 8}),
            P.Refuse("busy", "m"), P.Begin("r1", 3, 40, lay),
            P.Accept("r1", 3, {"base": 1 << 40, "size": 10}, P.region_dicts(_layout().regions(40)), 2.5),
            P.Reject("r1", "too_long", "m"), P.Done("r1", 3, 40, 123), P.Abort("r1", 3, "x"), P.Ack("r1", 3),
            P.Error("r1", "duplicate_done", "m")]
    for m in msgs:
        assert P.decode(P.encode(m)) == m
    assert L.Layout.from_wire(lay) == _layout()


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_wide_conv_allocation_rec_offset(conv_layout):
    """A conv allocation wider than kernel-1 (vLLM with 3 speculative tokens: 6 positions, the state
    in the first 3): the layout names the first 3 with strides over all 6 and where the recurrent
    state starts; it round-trips (a version-2 wire without the field is still taken) and the node's
    conversion reads both states back from pages packed that way."""
    import torch

    from nexrt_vllm.engine.state import GDNState
    from nexrt_vllm.node.convert import unpack_state
    from nexrt_vllm.testing.senders import pack_state

    dim, width, alloc = 96, 3, 6
    shape, strides = ((width, dim), (dim, 1)) if conv_layout == "SD" else ((dim, width), (alloc, 1))
    gdn = L.GDNLayout(0, conv_layout, "bfloat16", shape, strides, "HKV", "float32", (4, 16, 8), (128, 8, 1),
                      rec_offset=alloc * dim * 2)
    lay = L.Layout({"num_hidden_layers": 1, "hidden_size": 64, "vocab_size": 100}, 16, (gdn,))
    assert gdn.page_bytes == alloc * dim * 2 + 4 * 16 * 8 * 4 > gdn.conv_bytes + gdn.rec_bytes
    wire = lay.to_wire()
    assert L.Layout.from_wire(wire) == lay
    old = {**wire, "version": 2, "layers": [{k: v for k, v in wire["layers"][0].items() if k != "rec_offset"}]}
    assert L.Layout.from_wire(old).layers[0].rec_start == gdn.conv_bytes
    bad = {**wire, "layers": [{**wire["layers"][0], "rec_offset": 8}]}
    with pytest.raises(P.ProtocolError, match="rec_offset 8 inside the conv state"):
        L.Layout.from_wire(bad)
    want = GDNState(conv=torch.randn(dim, width).to(torch.bfloat16), rec=torch.randn(4, 16, 8))
    cache, pages = pack_state(want.named(0), 5, lay)
    (reg,) = lay.regions(5)
    buf = torch.zeros(P.align_up(reg.offset + reg.nbytes), dtype=torch.uint8)
    buf[reg.offset: reg.offset + reg.page_bytes] = cache[pages[0][0]: pages[0][0] + reg.page_bytes]
    got = GDNState.from_named(unpack_state(buf, lay, (reg,), 5, {"conv": torch.bfloat16, "rec": torch.float32}), 0)
    assert torch.equal(got.conv, want.conv) and torch.equal(got.rec, want.rec)


def test_sharded_layouts_and_parts_round_trip():
    from nexrt_vllm.handoff.sharding import Sharding

    lay = _layout(sharding=Sharding(4, 3, None, (3, 4), (6, 8)))
    wire = lay.to_wire()
    assert wire["version"] == L.LAYOUT_VERSION == 4 and wire["sharding"]["kv_heads"] is None
    assert L.Layout.from_wire(wire) == lay
    unsharded = _layout().to_wire()
    assert "sharding" not in unsharded
    assert L.Layout.from_wire({**unsharded, "version": 1}).sharding is None  # version 1 still taken
    for m in (P.Done("r", 1, 40, 9, part=3), P.Abort("r", 1, "x", part=2)):
        assert P.decode(P.encode(m)) == m
    # a sender that names no part: part 0 (an unsharded hand-off)
    raw = msgpack.packb({"type": "done", "v": P.PROTOCOL_VERSION, "rid": "r", "generation": 1, "seq_len": 3,
                         "nbytes": 1})
    assert P.decode(raw).part == 0
    with pytest.raises(P.ProtocolError):
        P.decode(msgpack.packb({"type": "done", "v": P.PROTOCOL_VERSION, "rid": "r", "generation": 1,
                                "seq_len": 3, "nbytes": 1, "part": "0"}))
    regs = lay.regions(33, base=1000)
    assert regs[0].offset == P.align_up(1000)


def test_regions_are_aligned_and_sized():
    lay = _layout()
    regs = lay.regions(33)  # 3 pages of 16 tokens
    gdn, attn = regs
    assert gdn.num_pages == 1 and gdn.page_bytes == 3 * 96 * 2 + 4 * 8 * 16 * 4
    assert attn.num_pages == 3 and attn.page_bytes == 2 * 16 * 64 * 2
    assert attn.offset % P.REGION_ALIGN == 0 and attn.offset >= gdn.offset + gdn.nbytes
    assert lay.layers[0].rec_dims == (4, 16, 8)  # HVK shape (4, 8, 16): dv=8, dk=16


@pytest.mark.parametrize("raw,reason", [
    (b"\xc1", P.Reason.BAD_MESSAGE),
    (msgpack.packb([1, 2]), P.Reason.BAD_MESSAGE),
    (msgpack.packb({"type": "hello", "v": 99, "layout": {}}), P.Reason.VERSION_MISMATCH),
    (msgpack.packb({"type": "nope", "v": P.PROTOCOL_VERSION}), P.Reason.BAD_MESSAGE),
    (msgpack.packb({"type": "done", "v": P.PROTOCOL_VERSION, "rid": "r", "generation": 1, "seq_len": 3}),
     P.Reason.BAD_MESSAGE),
    (msgpack.packb({"type": "done", "v": P.PROTOCOL_VERSION, "rid": "r", "generation": True, "seq_len": 3,
                    "nbytes": 1}), P.Reason.BAD_MESSAGE),
])
def test_bad_messages_are_typed_refusals(raw, reason):
    with pytest.raises(P.ProtocolError) as ei:
        P.decode(raw)
    assert ei.value.reason is reason


@pytest.mark.parametrize("mutate,reason", [
    (lambda d: d.update(version=L.LAYOUT_VERSION + 1), P.Reason.LAYOUT_VERSION),
    (lambda d: d.update(version=True), P.Reason.LAYOUT_VERSION),
    (lambda d: d.update(sharding={"tp_size": 2, "tp_rank": 2, "kv_heads": None, "k_heads": [0, 1],
                                  "v_heads": [0, 2]}), P.Reason.BAD_MESSAGE),
    (lambda d: d.update(sharding={"tp_size": 2, "tp_rank": 0, "k_heads": [1, 0], "v_heads": [0, 2]}),
     P.Reason.BAD_MESSAGE),
    (lambda d: d.update(sharding={"tp_size": 2, "tp_rank": 0, "v_heads": [0, 2]}), P.Reason.BAD_MESSAGE),
    (lambda d: d.update(version=1, sharding={"tp_size": 2, "tp_rank": 0, "kv_heads": [0, 1], "k_heads": [0, 1],
                                             "v_heads": [0, 2]}), P.Reason.BAD_MESSAGE),
    (lambda d: d["layers"][0].update(conv_layout="XY"), P.Reason.BAD_MESSAGE),
    (lambda d: d["layers"][1].update(dtype="float64"), P.Reason.BAD_MESSAGE),
    (lambda d: d["layers"][1].update(kind="mamba"), P.Reason.BAD_MESSAGE),
    (lambda d: d["layers"][1].update(shape=[2, 16]), P.Reason.BAD_MESSAGE),
    (lambda d: d["layers"][1].update(index=0), P.Reason.BAD_MESSAGE),
    (lambda d: d.pop("block_size"), P.Reason.BAD_MESSAGE),
])
def test_bad_layouts_are_typed_refusals(mutate, reason):
    d = _layout().to_wire()
    mutate(d)
    with pytest.raises(P.ProtocolError) as ei:
        L.Layout.from_wire(d)
    assert ei.value.reason is reason
