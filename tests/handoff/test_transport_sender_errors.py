"""The sender helper (nexrt_vllm.handoff) against a scripted control peer (a double of the node;
the real node is exercised in tests/node/): silent node -> TIMEOUT, refusals keep their
reason, out-of-bounds writes never leave the sender and abort the admission, adjacent pages
coalesce into one descriptor."""
import time

import numpy as np
import pytest

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sender import HandoffError, HandoffSender
from nexrt_vllm.handoff.transport import make_receiver
from nexrt_vllm.testing.control_peer import ControlPeer

LAYOUT = L.Layout(model={"num_hidden_layers": 1}, block_size=4,
                  layers=(L.AttentionLayout(0, "bfloat16", (1, 4, 8), (32, 8, 1)),))  # 64-byte pages


@pytest.fixture(scope="module")
def receiver():
    recv = make_receiver("mooncake")
    buf = np.zeros(4096, np.uint8)
    recv.register(buf.ctypes.data, buf.nbytes)
    yield recv, buf
    recv.close()


@pytest.fixture(scope="module")
def sender():
    s = HandoffSender("mooncake", control_timeout=0.5)
    src = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    s.register(src.ctypes.data, src.nbytes)
    yield s, src
    s.close()


@pytest.fixture
def make_node(receiver):
    """make_node(**over): a scripted node accepting into ``receiver``'s buffer, ``over`` replacing
    replies by message type; closed after the test, also when it fails."""
    recv, buf = receiver
    made = []

    def make(**over):
        replies = {
            "hello": lambda m: P.HelloOk(recv.peer_info(), {"max_seq_len": 64}),
            "begin": lambda m: P.Accept(m.rid, m.generation, {"base": buf.ctypes.data, "size": 1024},
                                        P.region_dicts(LAYOUT.regions(m.seq_len)), 5.0),
            "done": lambda m: P.Ack(m.rid, m.generation),
            "abort": lambda m: P.Ack(m.rid, m.generation),
        }
        replies.update(over)
        made.append(ControlPeer(replies))
        return made[-1]

    yield make
    for node in made:
        node.close()


def test_silent_node_times_out(sender, make_node):
    node = make_node(hello=None)
    t0 = time.monotonic()
    with pytest.raises(HandoffError) as ei:
        sender[0].begin(node.addr, LAYOUT, "r", 1, 8)
    assert ei.value.reason is P.Reason.TIMEOUT and time.monotonic() - t0 < 2.0


def test_refusal_keeps_the_node_reason(sender, make_node):
    node = make_node(begin=lambda m: P.Reject(m.rid, "busy", "node is busy"))
    with pytest.raises(HandoffError) as ei:
        sender[0].begin(node.addr, LAYOUT, "r", 1, 8)
    assert ei.value.reason is P.Reason.BUSY and "node is busy" in str(ei.value)


def test_out_of_bounds_write_is_stopped_and_aborted(receiver, sender, make_node):
    s, src = sender
    node = make_node()
    t = s.begin(node.addr, LAYOUT, "oob", 3, 8)
    receiver[1][:] = 0
    with pytest.raises(HandoffError) as ei:
        t.write([(src.ctypes.data, 1000, 64)])  # the buffer is 1024 bytes
    assert ei.value.reason is P.Reason.BAD_MESSAGE
    assert not receiver[1].any()
    assert [m.type for m in node.got][-1] == "abort"


def test_adjacent_pages_coalesce(receiver, sender, make_node):
    s, src = sender
    node = make_node()
    receiver[1][:] = 0
    base = src.ctypes.data
    t = s.send(node.addr, LAYOUT, "pages", 4, 12, {0: [base + 128, base + 192, base + 0]})  # 3 pages
    assert t.nbytes == 192 and t.descriptors == 2  # pages 0,1 adjacent on both ends; page 2 not
    assert np.array_equal(receiver[1][:128], src[128:256]) and np.array_equal(receiver[1][128:192], src[:64])
    done = [m for m in node.got if m.type == "done"][-1]
    assert (done.rid, done.generation, done.seq_len, done.nbytes) == ("pages", 4, 12, 192)


@pytest.mark.parametrize("hello", [
    lambda m: P.Refuse("layout_mismatch", "model num_hidden_layers=4, node serves 8"),
    lambda m: P.HelloOk({"backend": "nixl", "agent": "x", "metadata": b""}, {}),  # foreign transport
], ids=["refused", "foreign_transport"])
def test_failed_hello_aborts_the_admission(sender, make_node, hello):
    """A node that answers but cannot be served is told at once (abort with the reason), so its
    admission ends now instead of at its begin deadline."""
    node = make_node(hello=hello)
    with pytest.raises(HandoffError) as ei:
        sender[0].begin(node.addr, LAYOUT, "r-hello", 7, 8)
    assert ei.value.reason in (P.Reason.LAYOUT_MISMATCH, P.Reason.TRANSFER_FAILED)
    deadline = time.monotonic() + 2
    while len(node.got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    hello_msg, abort = node.got[-2:]
    assert (hello_msg.type, abort.type, abort.rid, abort.generation) == ("hello", "abort", "r-hello", 7)
    assert ei.value.reason.value in abort.reason
    assert [m.type for m in node.got].count("begin") == 0
