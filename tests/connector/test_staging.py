"""The staged path (pages -> pinned pool -> transport) with the real Mooncake engine on host memory:
every byte lands where the node asked, batches larger than the pool go in pieces, concurrent
hand-offs never share pool bytes, and a full pool is a bounded wait."""
import threading

import pytest
import torch

from nexrt_vllm.connector.staging import PinnedStager, StagingTimeout, _Ranges
from nexrt_vllm.handoff.transport import make_receiver, make_sender

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def link():
    recv, send = make_receiver("mooncake"), make_sender("mooncake")
    rbuf = torch.zeros(1 << 20, dtype=torch.uint8)
    recv.register(rbuf.data_ptr(), rbuf.numel())
    peer = send.connect(recv.peer_info())
    yield recv, send, peer, rbuf
    send.close()
    recv.close()


class _Transfer:
    """The part of handoff.Transfer the stager uses: write (local, remote offset, n) triples."""

    def __init__(self, send, peer, rbuf):
        self.send, self.peer, self.base, self.batches = send, peer, rbuf.data_ptr(), []

    def write(self, writes):
        self.batches.append(sum(w[2] for w in writes))
        self.send.write(self.peer, [(loc, self.base + off, n) for loc, off, n in writes], timeout=10)


def test_staged_pages_land_exactly(link):
    recv, send, peer, rbuf = link
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    stager = PinnedStager([src.untyped_storage()], send, 4096, timeout=5)
    base = src.data_ptr()
    pages = [(base + off, 1000 + 3000 * i, 3000) for i, off in enumerate([40000, 3000, 21000, 9000, 50000])]
    big = (base + 7, 200000, 10000)  # more than the whole pool
    t = _Transfer(send, peer, rbuf)
    rbuf.zero_()
    stager.write(t, pages + [big], None)
    for loc, off, n in pages + [big]:
        assert torch.equal(rbuf[off: off + n], src[loc - base: loc - base + n])
    assert max(t.batches) <= 4096 and sum(t.batches) == 5 * 3000 + 10000
    assert stager._ranges._free == [(0, 4096)]  # every range given back
    with pytest.raises(ValueError, match="outside vLLM's registered KV cache"):
        stager.write(t, [(base + (1 << 16) - 10, 0, 20)], None)


def test_concurrent_hand_offs_share_no_pool_bytes(link):
    recv, send, peer, rbuf = link
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    stager = PinnedStager([src.untyped_storage()], send, 8192, timeout=10)
    base = src.data_ptr()
    rbuf.zero_()
    jobs = [[(base + 2048 * (8 * j + i), 300000 * j + 2048 * i, 2048) for i in range(8)] for j in range(3)]
    errors = []

    def run(w):
        try:
            stager.write(_Transfer(send, peer, rbuf), w, None)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    for w in jobs:
        for loc, off, n in w:
            assert torch.equal(rbuf[off: off + n], src[loc - base: loc - base + n])


def test_a_full_pool_is_a_bounded_wait():
    r = _Ranges(100)
    a = r.take(60, 1)
    with pytest.raises(StagingTimeout):
        r.take(60, 0.2)
    r.give(a, 60)
    assert r.take(100, 1) == 0
