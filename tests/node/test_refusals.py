"""Typed refusals: wrong protocol/layout version, another model's layout, seq_len over capacity,
unknown or duplicate rid, start for an unknown rid, malformed HTTP bodies. Each refusal leaves the
node free and is counted by reason in /metrics."""
import pytest

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sender import HandoffError, HandoffSender
from nexrt_vllm.testing.senders import layout_for
from nexrt_vllm.testing.node_process import NodeProcess, control_request

MAX_SEQ = 256


@pytest.fixture(scope="module")
def cfgs(qwen3_next_ckpt, qwen3_5_ckpt):
    from nexrt_vllm.engine import ModelConfig
    return ModelConfig.from_pretrained(qwen3_next_ckpt), ModelConfig.from_pretrained(qwen3_5_ckpt)


@pytest.fixture(scope="module")
def node(qwen3_next_ckpt):
    # 0.25 MiB receive buffers: the GDN state (~200 KB) plus ~120 bf16 tokens of KV
    n = NodeProcess(qwen3_next_ckpt, "mooncake", "--recv-buffer-mib", "0.25", max_seq_len=MAX_SEQ)
    yield n
    assert n.wait_free()["busy_slots"] == 0
    n.stop()


@pytest.fixture(scope="module")
def sender():
    s = HandoffSender("mooncake", control_timeout=5.0)
    yield s
    s.close()


def test_wrong_protocol_version(node, cfgs):
    rep = control_request(node.control_addr, {"type": "hello", "v": P.PROTOCOL_VERSION + 1,
                                              "layout": layout_for(cfgs[0]).to_wire()})
    assert (rep["type"], rep["reason"]) == ("refuse", "version_mismatch")
    assert node.metric("nexrt_refusals_total", 'reason="version_mismatch"') == 1


def test_garbage_control_message(node):
    rep = control_request(node.control_addr, b"\xc1not msgpack")
    assert (rep["type"], rep["reason"]) == ("refuse", "bad_message")


def test_wrong_layout_version(node, cfgs):
    wire = layout_for(cfgs[0]).to_wire()
    wire["version"] = L.LAYOUT_VERSION + 1
    rep = control_request(node.control_addr, {"type": "hello", "v": P.PROTOCOL_VERSION, "layout": wire})
    assert (rep["type"], rep["reason"]) == ("refuse", "layout_version")


def test_layout_of_another_model(node, cfgs, sender):
    with pytest.raises(HandoffError) as ei:
        sender.hello(node.control_addr, layout_for(cfgs[1]))
    assert ei.value.reason is P.Reason.LAYOUT_MISMATCH and "architecture" in ei.value.message


def test_fp8_kv_cache_refused_at_hello(node, cfgs, sender):
    """vLLM --kv-cache-dtype fp8: the node says so at hello instead of decoding scaled e4m3 pages."""
    before = node.metric("nexrt_refusals_total", 'reason="layout_mismatch"') or 0
    with pytest.raises(HandoffError) as ei:
        sender.hello(node.control_addr, layout_for(cfgs[0], kv_dtype="float8_e4m3fn"))
    assert ei.value.reason is P.Reason.LAYOUT_MISMATCH
    assert "KV cache pages in float8_e4m3fn" in ei.value.message and "kv_cache_dtype" in ei.value.message
    assert node.metric("nexrt_refusals_total", 'reason="layout_mismatch"') == before + 1
    assert node.health()["busy_slots"] == 0


def test_prompt_over_capacity_at_admit(node):
    status, body = node.call("POST", "/v1/admit", {"rid": "long-1", "prompt_len": MAX_SEQ})
    assert status == 413 and body["error"]["type"] == "too_long"
    assert node.health()["busy_slots"] == 0


def test_seq_len_over_capacity_at_begin(node, cfgs, sender):
    adm = node.admit("long-2")
    with pytest.raises(HandoffError) as ei:
        sender.begin(node.control_addr, layout_for(cfgs[0]), "long-2", adm["generation"], MAX_SEQ)
    assert ei.value.reason is P.Reason.TOO_LONG
    assert node.health()["busy_slots"] == 0  # the refused admission released the slot at once


def test_state_over_receive_buffer(node, cfgs, sender):
    adm = node.admit("big-kv")
    with pytest.raises(HandoffError) as ei:  # fp32 KV for 200 tokens does not fit, though 200 < max_seq_len
        sender.begin(node.control_addr, layout_for(cfgs[0], kv_dtype="float32"), "big-kv", adm["generation"], 200)
    assert ei.value.reason is P.Reason.TOO_LONG and "receive buffer holds 262144" in ei.value.message
    assert node.health()["busy_slots"] == 0


def test_begin_for_unknown_rid(node, cfgs, sender):
    with pytest.raises(HandoffError) as ei:
        sender.begin(node.control_addr, layout_for(cfgs[0]), "never-admitted", 1, 10)
    assert ei.value.reason is P.Reason.UNKNOWN_RID


def test_begin_with_stale_generation(node, cfgs, sender):
    adm = node.admit("gen-1")
    with pytest.raises(HandoffError) as ei:
        sender.begin(node.control_addr, layout_for(cfgs[0]), "gen-1", adm["generation"] - 1, 10)
    assert ei.value.reason is P.Reason.STALE_GENERATION
    assert node.call("POST", "/v1/cancel", {"rid": "gen-1"}) == (200, {"rid": "gen-1", "cancelled": True,
                                                                       "state": "reserved"})


def test_start_for_unknown_rid(node):
    status, body = node.call("POST", "/v1/generate", {"rid": "ghost", "generation": 1, "first_token": 5,
                                                      "max_tokens": 4})
    assert status == 404 and body["error"]["type"] == "unknown_rid"
    assert node.metric("nexrt_refusals_total", 'reason="unknown_rid"') >= 1


def test_duplicate_rid(node):
    node.admit("dup-1")
    status, body = node.call("POST", "/v1/admit", {"rid": "dup-1"})
    assert status == 409 and body["error"]["type"] == "duplicate"
    node.call("POST", "/v1/cancel", {"rid": "dup-1"})
    status, body = node.call("POST", "/v1/admit", {"rid": "dup-1"})  # a finished rid stays refused
    assert status == 409 and body["error"]["type"] == "duplicate"


@pytest.mark.parametrize("path,body,status", [
    ("/v1/admit", b"{not json", 400),
    ("/v1/admit", {"rid": 5}, 400),
    ("/v1/admit", {"rid": "x", "prompt_len": -1}, 400),
    ("/v1/generate", {"rid": "x", "first_token": 1}, 400),
    ("/v1/generate", {"rid": "x", "first_token": 1, "max_tokens": 0}, 400),
    ("/v1/generate", {"rid": "x", "first_token": 1, "max_tokens": 4, "temperature": -1}, 400),
    ("/v1/generate", {"rid": "x", "first_token": 1, "max_tokens": 4, "logprobs": 21}, 400),
    ("/v1/generate", {"rid": "x", "first_token": 1, "max_tokens": 4, "presence_penalty": 0.5}, 400),
    ("/v1/cancel", {"rid": "nobody"}, 404),
])
def test_malformed_http(node, path, body, status):
    got, rep = node.call("POST", path, body)
    assert got == status and "message" in rep["error"]
