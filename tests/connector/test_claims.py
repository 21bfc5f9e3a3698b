"""Claim rule and scheduler-side bookkeeping without an engine: only requests carrying a valid
"nexrt" entry are ours; ours keep their blocks past finish until the worker reports the send ended;
everything else sees no-ops; bad configuration fails at start with a clear message."""
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from nexrt_vllm.connector.config import ConnectorConfig, ConnectorConfigError
from nexrt_vllm.connector.metadata import NexRTWorkerMetadata, Outcome
from nexrt_vllm.connector.scheduler import NexRTScheduler
from nexrt_vllm.handoff.contracts import Claim, ContractError, HandoffStatus
from nexrt_vllm.handoff.prefix import pack_ids
from nexrt_vllm.handoff.protocol import Reason

GOOD = {"rid": "r1", "generation": 3, "control_addr": "tcp://10.0.0.2:5555", "node_url": "http://10.0.0.2:8200"}


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"nexrt_other": {}}])
def test_not_ours(params):
    assert Claim.from_params(params) is None


def test_ours():
    assert Claim.from_params({"nexrt": GOOD, "do_remote_decode": True}) == Claim("r1", 3, "tcp://10.0.0.2:5555",
                                                                          "http://10.0.0.2:8200")


@pytest.mark.parametrize("bad, msg", [
    ("x", "must be an object"),
    ({**GOOD, "rid": ""}, "rid"),
    ({**GOOD, "generation": True}, "generation"),
    ({**GOOD, "generation": -1}, "generation"),
    ({**GOOD, "control_addr": "http://x"}, "tcp://"),
    ({**GOOD, "node_url": 5}, "node_url"),
])
def test_malformed_claim(bad, msg):
    with pytest.raises(ContractError, match=msg):
        Claim.from_params({"nexrt": bad})


@pytest.mark.parametrize("extra, msg", [
    ({"transport": "rdma"}, "transport"),
    ({"control_timeout_s": 0}, "control_timeout_s"),
    ({"transfer_timeout_s": "5"}, "transfer_timeout_s"),
    ({"attn_kv_format": "NHD"}, "attn_kv_format"),
    ({"gdn_rec_layout": "KV"}, "gdn_rec_layout"),
    ({"staging": "sometimes"}, "staging"),
    ({"staging_mib": 0}, "staging_mib"),
    ({"transprt": "nixl"}, "unknown NexRTConnector option"),
])
def test_bad_config(extra, msg):
    with pytest.raises(ConnectorConfigError, match=msg):
        ConnectorConfig.from_extra(extra)


def test_config_defaults():
    cfg = ConnectorConfig.from_extra(None)
    assert (cfg.transport, cfg.control_timeout_s) == ("mooncake", 5.0)
    assert (cfg.attn_kv_format, cfg.gdn_rec_layout, cfg.staging) == (None, None, "auto")  # layouts are detected


@dataclass
class Req:
    request_id: str
    kv_transfer_params: dict | None
    num_prompt_tokens: int = 600
    num_computed_tokens: int = 0
    prompt_token_ids: list | None = field(default_factory=lambda: list(range(3, 603)))


@dataclass
class Out:
    kv_connector_worker_meta: object = None
    finished_sending: set = field(default_factory=set)


def _step(sched, *reqs, preempted=()):
    so = SimpleNamespace(num_scheduled_tokens={r.request_id: 512 for r in reqs},
                         kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: ([1], [2, 3])),
                         preempted_req_ids=set(preempted))
    meta = sched.build_connector_meta(so)
    for r in reqs:
        r.num_computed_tokens = min(r.num_prompt_tokens, r.num_computed_tokens + 512)
    return meta


def test_scheduler_tracks_only_claimed_and_holds_until_sent():
    sched = NexRTScheduler(lambda: None)
    ours, other = Req("a", {"nexrt": GOOD}), Req("b", {"do_remote_decode": True})
    sched.on_new_request(ours)
    sched.on_new_request(other)
    m1 = _step(sched, ours, other)
    assert [(s.req_id, s.start, s.end, s.completes_prefill) for s in m1.steps] == [("a", 0, 512, False)]
    assert m1.steps[0].prompt_ids == pack_ids(ours.prompt_token_ids)  # the job's first step: for the node's cache
    m2 = _step(sched, ours, other)
    assert [(s.start, s.end, s.completes_prefill, s.block_ids) for s in m2.steps] == [(512, 1024, True, ([1], [2, 3]))]
    assert m2.steps[0].prompt_ids is None
    assert sched.request_finished(other) == (False, None)
    held, params = sched.request_finished(ours)
    assert held and params == {"nexrt": {"rid": "r1", "generation": 3, "seq_len": 600, "status": "sending"}}
    assert sched.has_pending_push_work()
    sched.update_connector_output(Out(NexRTWorkerMetadata({"a": Outcome(HandoffStatus.SENT)}), {"a", "b"}))
    assert not sched.has_pending_push_work()


def test_scheduler_reports_known_failure_and_aborts_unfinished_prefill():
    sched = NexRTScheduler(lambda: None)
    failed, aborted = Req("f", {"nexrt": GOOD}), Req("x", {"nexrt": {**GOOD, "rid": "r2"}}, num_prompt_tokens=2000)
    for r in (failed, aborted):
        sched.on_new_request(r)
    _step(sched, failed, aborted)
    sched.update_connector_output(Out(NexRTWorkerMetadata({"f": Outcome(HandoffStatus.FAILED, Reason.BUSY, "node busy")})))
    _step(sched, failed, aborted)
    assert sched.request_finished(failed)[1]["nexrt"] == {"rid": "r1", "generation": 3, "seq_len": 600,
                                                          "status": "failed", "reason": "busy", "error": "node busy"}
    held, params = sched.request_finished(aborted)  # 1024 of 2000 tokens computed
    assert held and params["nexrt"]["status"] == "aborted"
    assert _step(sched).aborted == ["x"]


def test_scheduler_never_scheduled_and_malformed_release_at_once():
    sched = NexRTScheduler(lambda: None)
    waiting, bad = Req("w", {"nexrt": GOOD}), Req("m", {"nexrt": {"rid": 1}})
    sched.on_new_request(waiting)
    sched.on_new_request(bad)
    assert _step(sched, bad).steps == []  # a malformed claim is never handed off
    held, params = sched.request_finished(waiting)
    assert not held and params["nexrt"]["reason"] == "cancelled"
    held, params = sched.request_finished(bad)
    assert not held and params["nexrt"]["reason"] == "bad_message"
    assert not sched.has_pending_push_work()


@pytest.mark.parametrize("producer, pp, msg", [(False, 1, "kv_producer"), (True, 2, "pipeline parallel size 1")])
def test_connector_refuses_unsupported_setups(producer, pp, msg):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from nexrt_vllm.connector import NexRTConnector

    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=producer, kv_connector_extra_config={}),
                          parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=pp))
    with pytest.raises(ConnectorConfigError, match=msg):
        NexRTConnector(cfg, KVConnectorRole.SCHEDULER, None)


def test_probe_is_answered_with_the_configuration_and_never_claimed():
    info = {"transport": "nixl", "dtype": "bfloat16", "model": {"num_hidden_layers": 4}}
    sched = NexRTScheduler(lambda: None, info)
    probe = Req("p", {"nexrt": {"probe": True}})
    sched.on_new_request(probe)
    assert _step(sched, probe).steps == [] and not sched.has_pending_push_work()
    assert sched.request_finished(probe) == (False, {"nexrt": {"status": "probe", "connector": info}})
    # Only exactly {"probe": true} is a probe; anything else under "nexrt" is a (malformed) claim.
    sched.on_new_request(Req("q", {"nexrt": {"probe": True, "rid": "x"}}))
    assert sched.request_finished(Req("q", None))[1]["nexrt"]["reason"] == "bad_message"
