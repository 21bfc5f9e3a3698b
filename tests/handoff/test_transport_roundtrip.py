"""Both transfer engines: bytes land exactly where asked, batches coalesce, out-of-bounds and dead
peers fail with TransferError."""
import numpy as np
import pytest

from nexrt_vllm.handoff.transport import TransferError, coalesce, make_receiver, make_sender


def test_coalesce_merges_only_contiguous_pairs():
    w = [(1000, 50, 10), (0, 0, 10), (10, 10, 10), (20, 30, 10), (1010, 60, 5), (7, 100, 0)]
    assert coalesce(w) == [(0, 0, 20), (20, 30, 10), (1000, 50, 15)]


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pair(request):
    recv, send = make_receiver(request.param), make_sender(request.param)
    rbuf = np.zeros(1 << 20, np.uint8)
    sbuf = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    recv.register(rbuf.ctypes.data, rbuf.nbytes)
    send.register(sbuf.ctypes.data, sbuf.nbytes)
    peer = send.connect(recv.peer_info())
    yield send, peer, rbuf, sbuf
    send.close()
    recv.close()


def test_batch_write_lands_exactly(pair):
    send, peer, rbuf, sbuf = pair
    rbuf[:] = 0
    s, r = sbuf.ctypes.data, rbuf.ctypes.data
    send.write(peer, [(s + 10, r + 100, 1000), (s + 5000, r + 9000, 3000), (s + 8000, r + 12000, 4096)], timeout=10)
    expect = np.zeros_like(rbuf)
    expect[100:1100] = sbuf[10:1010]
    expect[9000:12000] = sbuf[5000:8000]
    expect[12000:16096] = sbuf[8000:12096]
    assert np.array_equal(rbuf, expect)


def test_write_outside_registered_memory_fails(pair):
    send, peer, rbuf, sbuf = pair
    rbuf[:] = 0
    with pytest.raises(TransferError):
        send.write(peer, [(sbuf.ctypes.data, rbuf.ctypes.data + rbuf.nbytes - 10, 100)], timeout=10)
    assert not rbuf.any()


def test_unknown_peer_info_is_refused(pair):
    send = pair[0]
    with pytest.raises(TransferError):
        send.connect({"backend": "other"})


def test_mooncake_protocols_must_match(monkeypatch):
    """Both ends use NEXRT_MOONCAKE_PROTOCOL; a sender refuses a node on another protocol, and GPU-only
    protocols need the CUDA build (this machine's wheel is not one)."""
    from mooncake import engine

    recv = make_receiver("mooncake")
    send = make_sender("mooncake")
    try:
        info = recv.peer_info()
        assert info["protocol"] == "tcp" and send.connect(info) == info["target"]
        with pytest.raises(TransferError, match="node's mooncake protocol is 'nvlink_intra'"):
            send.connect({**info, "protocol": "nvlink_intra"})
        assert ("device" in send.memory_kinds) == bool(engine.SUPPORT_CUDA)
        if not engine.SUPPORT_CUDA:
            with pytest.raises(ValueError, match="cannot register 'device' memory"):
                send.register(1 << 20, 4096, "device")
    finally:
        send.close()
        recv.close()
    monkeypatch.setenv("NEXRT_MOONCAKE_PROTOCOL", "rdma2")
    with pytest.raises(TransferError, match="not one of"):
        make_sender("mooncake")
    if not engine.SUPPORT_CUDA:
        monkeypatch.setenv("NEXRT_MOONCAKE_PROTOCOL", "nvlink_intra")
        with pytest.raises(TransferError, match="needs the CUDA build"):
            make_sender("mooncake")
