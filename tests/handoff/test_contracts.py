"""Every HTTP / claim body round-trips through its one encoder and decoder, keeps the wire form the
peers already speak (same keys, same order, same JSON bytes), and malformed input — wrong types,
missing fields, negative numbers, unknown statuses or reasons — raises ContractError naming the
body and the field."""
import json

import pytest

from nexrt_vllm.handoff.contracts import (CLAIM_KEY, REFUSAL_STATUS, AdmissionState, AdmitReply, AdmitRequest,
                                          CancelReply, CancelRequest, Claim, ContractError, GenerateRequest,
                                          HandoffReport, HandoffStatus, Refusal, Sampling)
from nexrt_vllm.handoff.protocol import Reason

SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=7, ignore_eos=True, stop_token_ids=(5, 9))

BODIES = [
    AdmitRequest("r1"),
    AdmitRequest("r1", prompt_len=1000),
    AdmitReply("r1", 3, "tcp://10.0.0.2:5555", 30.0),
    Claim("r1", 3, "tcp://10.0.0.2:5555", "http://10.0.0.2:8200"),
    Claim("r1", 0, "tcp://10.0.0.2:5555"),
    HandoffReport(HandoffStatus.SENDING, "r1", 3, 600),
    HandoffReport(HandoffStatus.FAILED, "r1", 3, 600, Reason.BUSY, "node busy"),
    HandoffReport(HandoffStatus.ABORTED, "r1", 3, 600),
    HandoffReport(HandoffStatus.FAILED, reason=Reason.BAD_MESSAGE, error="kv_transfer_params.nexrt.rid ..."),
    GenerateRequest("r1", 17, 64),
    GenerateRequest("r1", 17, 64, generation=3, sampling=SAMPLING),
    CancelRequest("r1"),
    CancelReply("r1", True, AdmissionState.RECEIVING),
    CancelReply("r1", False, AdmissionState.FINISHED),
    AdmitRequest("r1", 600, structured={"type": "json_schema", "value": {"type": "object"}}),
    GenerateRequest("r1", 17, 64, generation=3, logprobs=5, structured={"type": "choice", "value": ["a", "b"]}),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_round_trip_through_json(body):
    wire = json.loads(json.dumps(body.to_wire()))
    assert type(body).from_wire(wire) == body


def test_claim_and_report_travel_under_the_nexrt_key():
    c = BODIES[3]
    assert c.to_params() == {"nexrt": c.to_wire()} and CLAIM_KEY == "nexrt"
    assert Claim.from_params({**c.to_params(), "do_remote_decode": True}) == c   # other connectors' keys
    for not_ours in (None, {}, {"do_remote_decode": True}, {"nexrt_other": {}}):
        assert Claim.from_params(not_ours) is None
    r = BODIES[6]
    assert HandoffReport.from_params(r.to_params()) == r
    assert HandoffReport.from_params(None) is None and HandoffReport.from_params({"other": 1}) is None


def test_wire_form_is_the_one_the_peers_speak():
    """Key order and JSON bytes as the router, node and connector sent them before the contracts."""
    g = GenerateRequest("r1", 17, 64, generation=3, sampling=Sampling(1.0, 1.0, 0, None, False, ()))
    assert json.dumps(g.to_wire()) == ('{"rid": "r1", "generation": 3, "first_token": 17, "max_tokens": 64, '
                                       '"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": null, '
                                       '"ignore_eos": false, "stop_token_ids": []}')
    assert list(BODIES[3].to_wire()) == ["rid", "generation", "control_addr", "node_url"]
    assert BODIES[5].to_wire() == {"rid": "r1", "generation": 3, "seq_len": 600, "status": "sending"}
    assert list(BODIES[6].to_wire()) == ["rid", "generation", "seq_len", "status", "reason", "error"]
    assert BODIES[8].to_wire() == {"status": "failed", "reason": "bad_message",
                                   "error": "kv_transfer_params.nexrt.rid ..."}
    assert AdmitRequest("r1").to_wire() == {"rid": "r1"}
    assert BODIES[2].to_wire() == {"rid": "r1", "generation": 3, "control_addr": "tcp://10.0.0.2:5555",
                                   "admit_timeout_s": 30.0}
    assert CancelReply("r1", True, "decoding").to_wire() == {"rid": "r1", "cancelled": True, "state": "decoding"}
    # the output options travel only when set, in handoff/structured's form (a schema's JSON text parsed)
    g = GenerateRequest("r1", 17, 64, logprobs=0, structured={"type": "json_schema", "value": '{"type": "string"}'})
    assert list(g.to_wire())[-2:] == ["logprobs", "structured"]
    assert g.to_wire()["structured"] == {"type": "json_schema", "value": {"type": "string"}}
    assert AdmitRequest("r1", structured={"type": "json_object"}).to_wire() == {"rid": "r1",
                                                                                 "structured": {"type": "json_object"}}


def test_generate_defaults_are_the_nodes_for_absent_or_null_fields():
    g = GenerateRequest.from_wire({"rid": "r1", "first_token": 1, "max_tokens": 4, "seed": None, "top_k": None})
    assert g.generation is None and g.sampling == Sampling() and g.sampling.temperature == 0.0


@pytest.mark.parametrize("reason, status", [(Reason.BUSY, 409), (Reason.DUPLICATE, 409), (Reason.CANCELLING, 409),
                                            (Reason.STALE_GENERATION, 409), (Reason.TOO_LONG, 413),
                                            (Reason.UNKNOWN_RID, 404), (Reason.BAD_MESSAGE, 400),
                                            (Reason.UNSUPPORTED, 400)])
def test_refusal_round_trip_and_status(reason, status):
    r = Refusal(reason, "why")
    assert r.status == status == REFUSAL_STATUS[reason]
    assert r.to_wire() == {"error": {"type": reason.value, "message": "why"}}
    back = Refusal.from_wire(status, json.loads(json.dumps(r.to_wire())))
    assert (back.reason, back.message, back.status) == (reason, "why", status)


GOOD_GEN = {"rid": "r1", "first_token": 1, "max_tokens": 4}
GOOD_CLAIM = {"rid": "r1", "generation": 3, "control_addr": "tcp://h:1", "node_url": "http://h:2"}
GOOD_REPLY = {"rid": "r1", "generation": 3, "control_addr": "tcp://h:1", "admit_timeout_s": 30.0}

MALFORMED = [
    # (contract, wire, body name, field)
    (AdmitRequest, "x", "admit", None),
    (AdmitRequest, {}, "admit", "rid"),
    (AdmitRequest, {"rid": 5}, "admit", "rid"),
    (AdmitRequest, {"rid": ""}, "admit", "rid"),
    (AdmitRequest, {"rid": "r", "prompt_len": -1}, "admit", "prompt_len"),
    (AdmitRequest, {"rid": "r", "prompt_len": True}, "admit", "prompt_len"),
    (AdmitRequest, {"rid": "r", "prompt_len": 2.5}, "admit", "prompt_len"),
    (AdmitReply, {**GOOD_REPLY, "generation": None}, "admit_reply", "generation"),
    (AdmitReply, {k: v for k, v in GOOD_REPLY.items() if k != "control_addr"}, "admit_reply", "control_addr"),
    (AdmitReply, {**GOOD_REPLY, "generation": -1}, "admit_reply", "generation"),
    (AdmitReply, {**GOOD_REPLY, "generation": "3"}, "admit_reply", "generation"),
    (AdmitReply, {**GOOD_REPLY, "control_addr": "http://h:1"}, "admit_reply", "control_addr"),
    (AdmitReply, {**GOOD_REPLY, "admit_timeout_s": 0}, "admit_reply", "admit_timeout_s"),
    (Claim, [], "kv_transfer_params.nexrt", None),
    (Claim, {**GOOD_CLAIM, "rid": ""}, "kv_transfer_params.nexrt", "rid"),
    (Claim, {**GOOD_CLAIM, "generation": True}, "kv_transfer_params.nexrt", "generation"),
    (Claim, {**GOOD_CLAIM, "generation": -1}, "kv_transfer_params.nexrt", "generation"),
    (Claim, {k: v for k, v in GOOD_CLAIM.items() if k != "generation"}, "kv_transfer_params.nexrt", "generation"),
    (Claim, {**GOOD_CLAIM, "control_addr": "http://x"}, "kv_transfer_params.nexrt", "control_addr"),
    (Claim, {**GOOD_CLAIM, "node_url": 5}, "kv_transfer_params.nexrt", "node_url"),
    (HandoffReport, {"rid": "r1"}, "kv_transfer_params.nexrt", "status"),
    (HandoffReport, {"status": "done"}, "kv_transfer_params.nexrt", "status"),
    (HandoffReport, {"status": "failed", "reason": "refused"}, "kv_transfer_params.nexrt", "reason"),
    (HandoffReport, {"status": "sending", "seq_len": -5}, "kv_transfer_params.nexrt", "seq_len"),
    (HandoffReport, {"status": "sending", "generation": "3"}, "kv_transfer_params.nexrt", "generation"),
    (HandoffReport, {"status": "failed", "error": 3}, "kv_transfer_params.nexrt", "error"),
    (GenerateRequest, None, "generate", None),
    (GenerateRequest, {"rid": "r1", "first_token": 1}, "generate", "max_tokens"),
    (GenerateRequest, {"rid": "r1", "max_tokens": 4}, "generate", "first_token"),
    (GenerateRequest, {**GOOD_GEN, "rid": 7}, "generate", "rid"),
    (GenerateRequest, {**GOOD_GEN, "max_tokens": 0}, "generate", "max_tokens"),
    (GenerateRequest, {**GOOD_GEN, "max_tokens": "4"}, "generate", "max_tokens"),
    (GenerateRequest, {**GOOD_GEN, "first_token": -1}, "generate", "first_token"),
    (GenerateRequest, {**GOOD_GEN, "generation": -2}, "generate", "generation"),
    (GenerateRequest, {**GOOD_GEN, "temperature": -1}, "generate", "temperature"),
    (GenerateRequest, {**GOOD_GEN, "temperature": float("inf")}, "generate", "temperature"),
    (GenerateRequest, {**GOOD_GEN, "temperature": "hot"}, "generate", "temperature"),
    (GenerateRequest, {**GOOD_GEN, "top_p": 0}, "generate", "top_p"),
    (GenerateRequest, {**GOOD_GEN, "top_p": 1.5}, "generate", "top_p"),
    (GenerateRequest, {**GOOD_GEN, "top_k": -2}, "generate", "top_k"),
    (GenerateRequest, {**GOOD_GEN, "seed": -1}, "generate", "seed"),
    (GenerateRequest, {**GOOD_GEN, "seed": 2**63}, "generate", "seed"),
    (GenerateRequest, {**GOOD_GEN, "ignore_eos": "no"}, "generate", "ignore_eos"),
    (GenerateRequest, {**GOOD_GEN, "stop_token_ids": [-1]}, "generate", "stop_token_ids"),
    (GenerateRequest, {**GOOD_GEN, "stop_token_ids": "5"}, "generate", "stop_token_ids"),
    (GenerateRequest, {**GOOD_GEN, "presence_penalty": 0.5}, "generate", None),   # unknown field refused
    (GenerateRequest, {**GOOD_GEN, "logprobs": 21}, "generate", "logprobs"),
    (GenerateRequest, {**GOOD_GEN, "logprobs": True}, "generate", "logprobs"),
    (GenerateRequest, {**GOOD_GEN, "structured": {"type": "yaml"}}, "generate", "structured"),
    (GenerateRequest, {**GOOD_GEN, "structured": {"type": "choice", "value": []}}, "generate", "structured"),
    (AdmitRequest, {"rid": "r1", "structured": {"type": "regex"}}, "admit", "structured"),
    (CancelRequest, {"rid": 5}, "cancel", "rid"),
    (CancelRequest, {}, "cancel", "rid"),
    (CancelReply, {"rid": "r1", "cancelled": True, "state": "gone"}, "cancel_reply", "state"),
    (CancelReply, {"rid": "r1", "cancelled": "yes", "state": "ready"}, "cancel_reply", "cancelled"),
    (CancelReply, {"rid": "r1", "state": "ready"}, "cancel_reply", "cancelled"),
]


@pytest.mark.parametrize("contract, wire, body, field", MALFORMED,
                         ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(MALFORMED)])
def test_malformed_input_is_a_typed_error_naming_the_field(contract, wire, body, field):
    with pytest.raises(ContractError) as e:
        contract.from_wire(wire)
    assert isinstance(e.value, ValueError)
    assert (e.value.body, e.value.field) == (body, field)
    assert str(e.value).startswith(f"{body}.{field} " if field else f"{body} ")


def test_constructors_apply_the_same_rules():
    with pytest.raises(ContractError, match=r"^generate\.seed "):
        Sampling(seed=-1)
    with pytest.raises(ContractError, match=r"^kv_transfer_params\.nexrt\.status "):
        HandoffReport("done")
    with pytest.raises(ContractError, match=r"^kv_transfer_params\.nexrt\.control_addr "):
        Claim("r1", 1, "10.0.0.2:5555")


@pytest.mark.parametrize("status, wire, field", [
    (409, {"error": {"type": "exploded", "message": "m"}}, "type"),             # not a protocol reason
    (409, {"error": {"type": "timeout", "message": "m"}}, "type"),              # a reason, not an HTTP refusal
    (404, {"error": {"type": "busy", "message": "m"}}, "type"),                 # busy comes with 409
    (409, {"error": {"type": "busy", "message": 5}}, "message"),
    (409, {"error": "busy"}, None),
    (502, "<html>bad gateway</html>", None),
])
def test_malformed_refusal(status, wire, field):
    with pytest.raises(ContractError) as e:
        Refusal.from_wire(status, wire)
    assert e.value.field == field


def test_handoff_status_failed_means_no_state_reaches_the_node():
    assert [s.value for s in HandoffStatus if s.failed] == ["failed", "aborted"]


def test_probe_and_its_reply():
    from nexrt_vllm.handoff.contracts import PROBE, ContractError, ProbeReply, is_probe

    assert is_probe({CLAIM_KEY: PROBE}) and not is_probe({CLAIM_KEY: {**PROBE, "rid": "x"}}) and not is_probe(None)
    info = {"transport": "nixl", "dtype": "bfloat16", "model": {"num_hidden_layers": 4}}
    params = json.loads(json.dumps(ProbeReply(info).to_params()))
    assert params == {CLAIM_KEY: {"connector": info, "status": "probe"}}
    assert ProbeReply.from_params(params).connector == info
    # An ordinary hand-off report, or none, is no probe answer (an older connector).
    assert ProbeReply.from_params({CLAIM_KEY: {"status": "failed", "reason": "bad_message"}}) is None
    assert ProbeReply.from_params(None) is None
    with pytest.raises(ContractError, match="connector"):
        ProbeReply.from_params({CLAIM_KEY: {"status": "probe", "connector": "nixl"}})
