"""The bytes each wire body puts on the wire, pinned: the control messages' msgpack and the HTTP /
claim bodies' JSON as the peers already speak them. A change here is a protocol change (bump
``PROTOCOL_VERSION`` for the control messages). Version 1 is what older peers speak, byte for byte;
version 2 is the same but for its version number, plus the context cache's fields (begin.prompt,
accept.held_tokens)."""
import json

import pytest

from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.prefix import pack_ids
from nexrt_vllm.handoff.contracts import (AdmissionState, AdmitReply, AdmitRequest, CancelReply, CancelRequest, Claim,
                                          GenerateRequest, HandoffReport, HandoffStatus, ProbeReply, Refusal, Sampling)
from nexrt_vllm.handoff.protocol import Reason

LAYOUT = {"version": 4, "model": {"num_hidden_layers": 1}, "block_size": 16, "layers": []}
REGIONS = [{"layer": 0, "kind": "attention", "offset": 0, "page_bytes": 4096, "num_pages": 3}]
SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=7, ignore_eos=True, stop_token_ids=(5, 9))
CHOICE = {"type": "choice", "value": ["a", "b"]}

MESSAGES = {
    "hello": P.Hello(LAYOUT),
    "hello_ok": P.HelloOk({"backend": "nixl", "metadata": b"\x00\xff"}, {"model": "m", "max_seq_len": 8}),
    "refuse": P.Refuse("busy", "node is busy"),
    "begin": P.Begin("r1", 3, 40, LAYOUT),
    "accept": P.Accept("r1", 3, {"base": 1 << 40, "size": 10}, REGIONS, 2.5),
    "reject": P.Reject("r1", "too_long", "m"),
    "done": P.Done("r1", 3, 40, 123),
    "done_part": P.Done("r1", 3, 40, 123, part=2),
    "abort": P.Abort("r1", 3, "sender error"),
    "abort_part": P.Abort("r1", 3, "x", part=1),
    "ack": P.Ack("r1", 3),
    "error": P.Error("r1", "duplicate_done", "done already received"),
}

# Version 2's new fields: the prompt's ids at begin, the tokens held at accept (always said in 2).
MESSAGES_V2 = {
    "begin_prompt": P.Begin("r1", 3, 40, LAYOUT, prompt=pack_ids([1, 2, 300])),
    "accept": MESSAGES["accept"],
    "accept_held": P.Accept("r1", 3, {"base": 1 << 40, "size": 10}, REGIONS, 2.5, held_tokens=32),
}
ACCEPT_V2 = (
    "88a3726964a27231aa67656e65726174696f6e03a662756666657282a462617365cf0000010000000000a473697a650aa7726567"
    "696f6e739185a56c6179657200a46b696e64a9617474656e74696f6ea66f666673657400aa706167655f6279746573cd1000a96e"
    "756d5f706167657303aa646561646c696e655f73cb4004000000000000a474797065a6616363657074ab68656c645f746f6b656e"
    "73{held}a17602"
)
MESSAGE_BYTES_V2 = {
    "begin_prompt": (
        "87a3726964a27231aa67656e65726174696f6e03a77365715f6c656e28a66c61796f757484a776657273696f6e04a56d6f64656c"
        "81b16e756d5f68696464656e5f6c617965727301aa626c6f636b5f73697a6510a66c617965727390a474797065a5626567696ea6"
        "70726f6d7074c40c01000000020000002c010000a17602"
    ),
    "accept": ACCEPT_V2.format(held="00"),
    "accept_held": ACCEPT_V2.format(held="20"),
}

MESSAGE_BYTES = {
    "hello": (
        "83a66c61796f757484a776657273696f6e04a56d6f64656c81b16e756d5f68696464656e5f6c617965727301aa626c6f636b5f73"
        "697a6510a66c617965727390a474797065a568656c6c6fa17601"
    ),
    "hello_ok": (
        "84a97472616e73706f727482a76261636b656e64a46e69786ca86d65746164617461c40200ffa46e6f646582a56d6f64656ca16d"
        "ab6d61785f7365715f6c656e08a474797065a868656c6c6f5f6f6ba17601"
    ),
    "refuse": "84a6726561736f6ea462757379a76d657373616765ac6e6f64652069732062757379a474797065a6726566757365a17601",
    "begin": (
        "86a3726964a27231aa67656e65726174696f6e03a77365715f6c656e28a66c61796f757484a776657273696f6e04a56d6f64656c"
        "81b16e756d5f68696464656e5f6c617965727301aa626c6f636b5f73697a6510a66c617965727390a474797065a5626567696ea1"
        "7601"
    ),
    "accept": (
        "87a3726964a27231aa67656e65726174696f6e03a662756666657282a462617365cf0000010000000000a473697a650aa7726567"
        "696f6e739185a56c6179657200a46b696e64a9617474656e74696f6ea66f666673657400aa706167655f6279746573cd1000a96e"
        "756d5f706167657303aa646561646c696e655f73cb4004000000000000a474797065a6616363657074a17601"
    ),
    "reject": "85a3726964a27231a6726561736f6ea8746f6f5f6c6f6e67a76d657373616765a16da474797065a672656a656374a17601",
    "done": (
        "87a3726964a27231aa67656e65726174696f6e03a77365715f6c656e28a66e62797465737ba474797065a4646f6e65a470617274"
        "00a17601"
    ),
    "done_part": (
        "87a3726964a27231aa67656e65726174696f6e03a77365715f6c656e28a66e62797465737ba474797065a4646f6e65a470617274"
        "02a17601"
    ),
    "abort": (
        "86a3726964a27231aa67656e65726174696f6e03a6726561736f6eac73656e646572206572726f72a474797065a561626f7274a4"
        "7061727400a17601"
    ),
    "abort_part": (
        "86a3726964a27231aa67656e65726174696f6e03a6726561736f6ea178a474797065a561626f7274a47061727401a17601"
    ),
    "ack": "84a3726964a27231aa67656e65726174696f6e03a474797065a361636ba17601",
    "error": (
        "85a3726964a27231a6726561736f6eae6475706c69636174655f646f6e65a76d657373616765b5646f6e6520616c726561647920"
        "7265636569766564a474797065a56572726f72a17601"
    ),
}

BODIES = [
    (AdmitRequest("r1"),
     '{"rid": "r1"}'),
    (AdmitRequest("r1", 600, structured={"type": "json_schema", "value": {"type": "object"}}),
     '{"rid": "r1", "prompt_len": 600, "structured": {"type": "json_schema", "value": {"type": "object"}}}'),
    (AdmitReply("r1", 3, "tcp://10.0.0.2:5555", 30.0),
     '{"rid": "r1", "generation": 3, "control_addr": "tcp://10.0.0.2:5555", "admit_timeout_s": 30.0}'),
    (Claim("r1", 3, "tcp://10.0.0.2:5555", "http://10.0.0.2:8200"),
     '{"rid": "r1", "generation": 3, "control_addr": "tcp://10.0.0.2:5555", '
     '"node_url": "http://10.0.0.2:8200"}'),
    (Claim("r1", 0, "tcp://10.0.0.2:5555"),
     '{"rid": "r1", "generation": 0, "control_addr": "tcp://10.0.0.2:5555", "node_url": null}'),
    (HandoffReport(HandoffStatus.SENDING, "r1", 3, 600),
     '{"rid": "r1", "generation": 3, "seq_len": 600, "status": "sending"}'),
    (HandoffReport(HandoffStatus.FAILED, "r1", 3, 600, Reason.BUSY, "node busy"),
     '{"rid": "r1", "generation": 3, "seq_len": 600, "status": "failed", "reason": "busy", '
     '"error": "node busy"}'),
    (HandoffReport(HandoffStatus.FAILED, reason=Reason.BAD_MESSAGE, error="bad claim"),
     '{"status": "failed", "reason": "bad_message", "error": "bad claim"}'),
    (ProbeReply({"transport": "mooncake", "protocol_version": 1}),
     '{"connector": {"transport": "mooncake", "protocol_version": 1}, "status": "probe"}'),
    (GenerateRequest("r1", 17, 64),
     '{"rid": "r1", "generation": null, "first_token": 17, "max_tokens": 64, "temperature": 0.0, '
     '"top_p": 1.0, "top_k": 0, "seed": null, "ignore_eos": false, "stop_token_ids": []}'),
    (GenerateRequest("r1", 17, 64, generation=3, sampling=SAMPLING, logprobs=5, structured=CHOICE),
     '{"rid": "r1", "generation": 3, "first_token": 17, "max_tokens": 64, "temperature": 0.7, '
     '"top_p": 0.9, "top_k": 40, "seed": 7, "ignore_eos": true, "stop_token_ids": [5, 9], "logprobs": 5, '
     '"structured": {"type": "choice", "value": ["a", "b"]}}'),
    (CancelRequest("r1"),
     '{"rid": "r1"}'),
    (CancelReply("r1", True, AdmissionState.RECEIVING),
     '{"rid": "r1", "cancelled": true, "state": "receiving"}'),
    (Refusal(Reason.BUSY, "node is busy"),
     '{"error": {"type": "busy", "message": "node is busy"}}'),
]


@pytest.mark.parametrize("name", MESSAGE_BYTES)
def test_control_message_bytes(name):
    """Version 1, as older peers speak it; version 2 differs only in its number, but for accept."""
    assert P.PROTOCOL_VERSIONS == (1, 2) and P.PROTOCOL_VERSION == 2
    assert P.encode(MESSAGES[name], 1).hex() == MESSAGE_BYTES[name]
    assert P.decode_versioned(bytes.fromhex(MESSAGE_BYTES[name])) == (MESSAGES[name], 1)
    if name != "accept":
        assert MESSAGE_BYTES[name].endswith("a17601")
        assert P.encode(MESSAGES[name]).hex() == MESSAGE_BYTES[name][:-2] + "02"


@pytest.mark.parametrize("name", MESSAGE_BYTES_V2)
def test_context_cache_fields_bytes(name):
    assert P.encode(MESSAGES_V2[name]).hex() == MESSAGE_BYTES_V2[name]
    assert P.decode_versioned(bytes.fromhex(MESSAGE_BYTES_V2[name])) == (MESSAGES_V2[name], 2)


def test_version_1_leaves_the_new_fields_out():
    """A version-1 peer reads a version-1 accept as it always did (no held tokens: a full hand-off);
    held tokens cannot be said to it, nor a prompt."""
    assert P.encode(MESSAGES_V2["accept"], 1).hex() == MESSAGE_BYTES["accept"]
    assert P.decode(bytes.fromhex(MESSAGE_BYTES["accept"])).held_tokens == 0
    assert P.decode(bytes.fromhex(MESSAGE_BYTES["begin"])).prompt is None
    for name in ("accept_held", "begin_prompt"):
        with pytest.raises(ValueError, match="cannot be said in protocol version 1"):
            P.encode(MESSAGES_V2[name], 1)


@pytest.mark.parametrize("body,text", BODIES, ids=[type(b).__name__ for b, _ in BODIES])
def test_http_body_json(body, text):
    assert json.dumps(body.to_wire()) == text


def test_refusal_reasons_are_typed():
    """A refusal's reason decodes to a ``Reason``; one the protocol does not name is a bad message."""
    assert P.decode(P.encode(P.Reject("r1", "busy", "m"))).reason is Reason.BUSY
    raw = bytes.fromhex(MESSAGE_BYTES["refuse"]).replace(b"\xa4busy", b"\xa4gone")
    with pytest.raises(P.ProtocolError, match=r"^refuse\.reason 'gone' is not a protocol reason") as ei:
        P.decode(raw)
    assert ei.value.reason is Reason.BAD_MESSAGE
