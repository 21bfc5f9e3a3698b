"""The context cache's contract (nexrt_vllm.handoff.prefix and the layout's page rule): the prompt's
ids on the wire, chained block keys rooted in the layout, the exact common prefix, held tokens in
whole pages; the regions and the sender's page slots of a partial hand-off."""
import random
import sys

import numpy as np
import pytest

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import prefix as X
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sender import HandoffError, HandoffSender
from nexrt_vllm.handoff.transport import make_receiver
from nexrt_vllm.testing.control_peer import ControlPeer


def test_ids_travel_as_little_endian_uint32():
    ids = [0, 1, 255, 256, 151_000, 2**32 - 1]
    packed = X.pack_ids(ids)
    assert packed == b"".join(i.to_bytes(4, "little") for i in ids)
    assert X.unpack_ids(packed) == ids and X.num_ids(packed) == len(ids)
    assert X.pack_ids([]) == b"" and X.unpack_ids(b"") == []
    with pytest.raises(ValueError, match="not whole 4-byte token ids"):
        X.unpack_ids(packed[:-1])
    with pytest.raises(OverflowError):
        X.pack_ids([2**32])
    assert sys.byteorder in ("little", "big")


def test_block_keys_are_chained_and_rooted_in_the_layout():
    rng = random.Random(0)
    ids = [rng.randrange(1000) for _ in range(100)]
    salt = X.layout_salt({"version": 4, "block_size": 16})
    keys = list(X.block_hashes(X.pack_ids(ids), 16, salt))
    assert len(keys) == 6 and all(len(k) == X.HASH_BYTES for k in keys)  # 100 // 16 whole blocks; the tail none
    assert len(set(keys)) == 6
    # a key names its whole prefix: change a token of block 3 and keys 3.. change, keys 0..2 do not
    changed = list(ids)
    changed[3 * 16 + 5] += 1
    keys2 = list(X.block_hashes(X.pack_ids(changed), 16, salt))
    assert keys2[:3] == keys[:3] and all(a != b for a, b in zip(keys2[3:], keys[3:]))
    # the same block after another prefix has another key (not a per-block hash)
    shifted = ids[16:32] + ids[16:32]
    k = list(X.block_hashes(X.pack_ids(shifted), 16, salt))
    assert k[0] != k[1]
    # another layout (salt) or block size: nothing in common
    other = X.layout_salt({"version": 4, "block_size": 32})
    assert other != salt and X.layout_salt({"version": 4, "block_size": 16}) == salt
    assert not set(X.block_hashes(X.pack_ids(ids), 16, other)) & set(keys)
    assert not set(X.block_hashes(X.pack_ids(ids), 32, salt)) & set(keys)
    # lazily: a generator, stopped at a miss by its consumer
    assert next(iter(X.block_hashes(X.pack_ids(ids), 16, salt))) == keys[0]


@pytest.mark.parametrize("seed", range(20))
def test_common_prefix_is_exact(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    a = rng.integers(0, 2**32, n, dtype=np.uint64).tolist()
    cut = int(rng.integers(0, n + 1))
    b = a[:cut] + rng.integers(0, 2**32, int(rng.integers(0, 50)), dtype=np.uint64).tolist()
    want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert X.common_prefix(X.pack_ids(a), X.pack_ids(b)) == want
    assert X.common_prefix(X.pack_ids(b), X.pack_ids(a)) == want


def test_common_prefix_counts_ids_not_bytes():
    # ids 256 and 512 share their first byte (0): one id in common, not a partial one
    assert X.common_prefix(X.pack_ids([7, 256]), X.pack_ids([7, 512])) == 1
    assert X.common_prefix(X.pack_ids([1, 2, 3]), X.pack_ids([1, 2, 3])) == 3
    assert X.common_prefix(b"", X.pack_ids([1])) == 0


def test_held_tokens_are_whole_pages_within_the_prompt():
    assert X.held_tokens(633, 900, 256) == 512
    assert X.held_tokens(255, 900, 256) == 0
    assert X.held_tokens(2000, 768, 256) == 768  # the whole prompt held: only the GDN state travels
    assert X.held_tokens(2000, 700, 256) == 512
    assert X.held_tokens(0, 10, 16) == 0


LAYOUT = L.Layout(model={"num_hidden_layers": 4}, block_size=16, layers=(
    L.GDNLayout(0, "SD", "bfloat16", (3, 96), (96, 1), "HVK", "float32", (4, 8, 16), (128, 16, 1)),
    L.AttentionLayout(3, "bfloat16", (1, 16, 8), (128, 8, 1)),   # 256-byte pages
    L.AttentionLayout(4, "bfloat16", (1, 16, 8), (128, 8, 1))))  # the MTP drafter's layer (version 4)


def test_regions_of_a_partial_hand_off():
    """The model's attention layers skip the held pages; the GDN state and the drafter's layer travel whole."""
    full = LAYOUT.regions(100)
    part = LAYOUT.regions(100, held=64)
    assert [r.num_pages for r in full] == [1, 7, 7]
    assert [r.num_pages for r in part] == [1, 3, 7]
    assert [LAYOUT.first_page(layer, 64) for layer in LAYOUT.layers] == [0, 4, 0]
    assert sum(r.nbytes for r in full) - sum(r.nbytes for r in part) == 4 * 256
    assert [r.num_pages for r in LAYOUT.regions(96, held=96)] == [1, 0, 6]  # all held: no attention page
    for bad in (8, 112, -16):
        with pytest.raises(P.ProtocolError, match="held_tokens") as ei:
            LAYOUT.regions(100, held=bad)
        assert ei.value.reason is P.Reason.BAD_MESSAGE


@pytest.fixture
def rig():
    """A receive buffer, a sender over a source of 64 pages, and make(held, versions) -> a scripted node."""
    recv = make_receiver("mooncake")
    dst = np.zeros(1 << 16, np.uint8)
    recv.register(dst.ctypes.data, dst.nbytes)
    s = HandoffSender("mooncake", control_timeout=2.0)
    src = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    s.register(src.ctypes.data, src.nbytes)
    peers = []

    def make(held=0, versions=P.PROTOCOL_VERSIONS):
        def begin(m):
            h = held if m.prompt is not None else 0
            return P.Accept(m.rid, m.generation, {"base": dst.ctypes.data, "size": dst.nbytes},
                            P.region_dicts(L.Layout.from_wire(m.layout).regions(m.seq_len, held=h)), 5.0,
                            held_tokens=h)
        peers.append(ControlPeer({"hello": lambda m: P.HelloOk(recv.peer_info(), {}), "begin": begin,
                                  "done": lambda m: P.Ack(m.rid, m.generation),
                                  "abort": lambda m: P.Ack(m.rid, m.generation)}, versions))
        return peers[-1]

    yield s, src, dst, make
    for p in peers:
        p.close()
    s.close()
    recv.close()


def _pages(src):
    """Page addresses of a 100-token request under LAYOUT: 7 per attention layer, 1 GDN page."""
    base, pb = src.ctypes.data, 256
    return {0: [base], 3: [base + pb * (1 + i) for i in range(7)], 4: [base + pb * (10 + i) for i in range(7)]}


def test_sender_skips_the_held_pages(rig):
    s, src, dst, make = rig
    node = make(held=64)
    prompt = X.pack_ids(range(100))
    t = s.begin(node.addr, LAYOUT, "r", 1, 100, prompt=prompt)
    assert t.held_tokens == 64 and node.got[-1].prompt == prompt and node.versions_seen == [2, 2]
    assert [t.slot(3, i) for i in range(7)] == [None] * 4 + [0, 1, 2]
    assert [t.slot(4, i) for i in range(7)] == list(range(7)) and t.slot(0, 0) == 0
    t.write_pages(_pages(src))
    gdn = LAYOUT.layers[0].page_bytes
    assert t.nbytes == gdn + 3 * 256 + 7 * 256
    regs = t.regions
    got = dst[regs[3].offset: regs[3].offset + regs[3].nbytes]
    assert np.array_equal(got, src[256 * 5: 256 * 8])  # pages 4..6 of layer 3
    t.done()


def test_an_old_node_gets_a_full_hand_off(rig):
    """A node that speaks only protocol version 1 refuses hello in 2: the sender says it again in
    1, sends no prompt and writes every page."""
    s, src, dst, make = rig
    node = make(held=64, versions=(1,))
    t = s.begin(node.addr, LAYOUT, "r", 1, 100, prompt=X.pack_ids(range(100)))
    assert t.held_tokens == 0 and node.got[-1].prompt is None and node.versions_seen == [1, 1]
    t.write_pages(_pages(src))
    assert t.nbytes == LAYOUT.layers[0].page_bytes + 14 * 256
    t.done()
    assert node.versions_seen == [1, 1, 1]


def test_held_tokens_without_a_prompt_or_off_pages_are_refused(rig):
    s, src, dst, make = rig
    for held, prompt, needle in ((64, None, "not given"), (8, X.pack_ids(range(100)), "whole 16-token pages")):
        node = make()
        node.replies["begin"] = lambda m, h=held: P.Accept(m.rid, m.generation, {"base": dst.ctypes.data,
                                                                                 "size": dst.nbytes},
                                                           P.region_dicts(LAYOUT.regions(m.seq_len)), 5.0,
                                                           held_tokens=h)
        with pytest.raises(HandoffError, match=needle) as ei:
            s.begin(node.addr, LAYOUT, "r", 1, 100, prompt=prompt)
        assert ei.value.reason is P.Reason.BAD_MESSAGE
        assert node.got[-1].type == "abort"  # the node frees the admission at once
