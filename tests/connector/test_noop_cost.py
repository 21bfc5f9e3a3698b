"""Unclaimed requests cost nothing: with no claimed request in flight, every per-step hook of
NexRTConnector (scheduler and worker side, in the order vLLM calls them) does a fixed, small amount
of work that does not grow with the batch, starts no thread, takes no lock, never touches the
transport and logs nothing. Asserted by counting function calls, not by timing.

benchmarks/connector_overhead.py measures the same in vLLM (docs/CONNECTOR.md, "Cost when nothing
is claimed").
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import nexrt_vllm.connector.worker as worker_mod
from nexrt_vllm.connector import NexRTConnector
from nexrt_vllm.connector.metadata import NexRTMetadata

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
# Modules whose appearance in an unclaimed step means real work (threads, locks, I/O, logging).
FORBIDDEN = ("threading", "logging", "nexrt_vllm/handoff", "zmq", "/queue.py")
CALL_BUDGET = 40  # Python + C calls per step inside the connector (4 layers); 37 when written


@dataclass
class Req:
    request_id: str
    kv_transfer_params: dict | None
    num_prompt_tokens: int = 64
    num_computed_tokens: int = 0
    prompt_token_ids: list | None = None


class Untouchable:
    """Stands in for the transport sender: any use is recorded."""

    def __init__(self):
        self.used: list[str] = []

    def __getattr__(self, name):
        self.used.append(name)
        raise AssertionError(f"transport used for an unclaimed batch: {name}")


class CountingLock:
    def __init__(self):
        self.acquired = 0

    def __enter__(self):
        self.acquired += 1

    def __exit__(self, *exc):
        return False


def _connector(role):
    hf = SimpleNamespace(num_hidden_layers=4, hidden_size=128, vocab_size=384, architectures=["Qwen3NextForCausalLM"])
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=True, kv_connector_extra_config={}),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                          model_config=SimpleNamespace(model="tiny", hf_config=hf, hf_text_config=hf, dtype="bfloat16"),
                          cache_config=SimpleNamespace(cache_dtype="auto"))
    return NexRTConnector(cfg, role, None)


@pytest.fixture
def pair(monkeypatch):
    jobs = []
    monkeypatch.setattr(worker_mod, "_Job", lambda *a, **k: jobs.append(a) or pytest.fail("a job was started"))
    sched = _connector(KVConnectorRole.SCHEDULER)
    sched._kv_cache_manager = Untouchable()  # block ids of an unclaimed request are never read
    wk = _connector(KVConnectorRole.WORKER)
    w = wk._worker
    # What register_kv_caches would set up: a sender and the attention layers save_kv_layer looks up.
    w._sender = Untouchable()
    w._lock = CountingLock()
    w._attn_by_name = {n: object() for n in LAYERS}
    return sched, wk, jobs


def _step(sched, wk, reqs, finished: set[str]):
    """One engine step as vLLM drives the connector (scheduler, then worker, then scheduler)."""
    so = SimpleNamespace(num_scheduled_tokens={r.request_id: 1 for r in reqs}, kv_connector_block_state=None,
                         preempted_req_ids=set())
    meta = sched.build_connector_meta(so)
    wk.handle_preemptions(meta)
    wk.bind_connector_metadata(meta)
    wk.start_load_kv(None)
    for name in LAYERS:
        wk.wait_for_layer_load(name)
        wk.save_kv_layer(name, None, None)
    wk.wait_for_save()
    sending, recving = wk.get_finished(finished)
    worker_meta = wk.build_connector_worker_meta()
    wk.clear_connector_metadata()
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker_meta, finished_sending=sending,
                                                  finished_recving=recving))
    assert not sched.has_pending_push_work()
    return meta, sending, worker_meta


def _profiled_step(sched, wk, reqs, finished):
    calls: list[str] = []

    def prof(frame, event, arg):
        if frame.f_code.co_filename == __file__ and event == "c_call" or arg is sys.setprofile:
            return  # the harness's own calls
        if event == "call" and frame.f_code.co_filename != __file__:
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
        elif event == "c_call":
            calls.append(f"{getattr(arg, '__module__', None)}:{arg.__qualname__}")

    sys.setprofile(prof)
    try:
        out = _step(sched, wk, reqs, finished)
    finally:
        sys.setprofile(None)
    return calls, out


@pytest.mark.parametrize("params", [None, {"do_remote_decode": True, "remote_host": "h"}])
def test_unclaimed_steps_do_no_work(pair, params):
    sched, wk, jobs = pair
    counts = {}
    for batch in (1, 256):
        reqs = [Req(f"b{batch}-{i}", params) for i in range(batch)]
        for r in reqs:
            sched.on_new_request(r)
        _step(sched, wk, reqs, set())  # first step after admission, not counted
        calls, (meta, sending, worker_meta) = _profiled_step(sched, wk, reqs, {r.request_id for r in reqs[:8]})
        assert (meta.steps, meta.preempted, meta.aborted) == ([], [], [])
        assert sending is None and worker_meta is None
        for r in reqs:
            assert sched.request_finished_all_groups(r, ([],)) == (False, None)
        bad = [c for c in calls if any(f in c for f in FORBIDDEN)]
        assert not bad, f"unclaimed step did real work: {bad}"
        counts[batch] = len(calls)
    # O(1) per step: 256 unclaimed requests cost exactly what one does.
    assert counts[1] == counts[256], counts
    assert counts[1] <= CALL_BUDGET, f"{counts[1]} calls per unclaimed step (budget {CALL_BUDGET})"
    assert jobs == [] and wk._worker._lock.acquired == 0
    assert wk._worker._sender.used == [] and sched._kv_cache_manager.used == []
    # Nothing is tracked for unclaimed requests, so nothing accumulates step after step.
    assert (sched._scheduler._reqs, sched._scheduler._aborts) == ({}, [])
    w = wk._worker
    assert (w._jobs, w._ended, w._vllm_finished, w._steps) == ({}, {}, set(), {})


def test_claimed_request_leaves_the_fast_path(pair, monkeypatch):
    """The counting above would be vacuous if the hooks ignored claims too: one claimed request in
    the batch reaches the block lookup and starts a job."""
    sched, wk, jobs = pair
    lookups = []
    sched._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: lookups.append(rid) or ([1], [2]))
    ours = Req("ours", {"nexrt": {"rid": "r", "generation": 0, "control_addr": "tcp://127.0.0.1:1"}})
    sched.on_new_request(ours)
    started = []
    monkeypatch.setattr(worker_mod, "_Job", lambda step, *a: started.append(step.req_id) or SimpleNamespace(
        ended=False, final_queued=False, queued_pages={}, write=lambda pages: None, finish=lambda: None))
    wk._worker._layout = SimpleNamespace(block_size=16)
    so = SimpleNamespace(num_scheduled_tokens={"ours": 64, "other": 1}, kv_connector_block_state=None,
                         preempted_req_ids=set())
    meta = sched.build_connector_meta(so)
    assert isinstance(meta, NexRTMetadata) and [s.req_id for s in meta.steps] == ["ours"]
    wk.bind_connector_metadata(meta)
    assert lookups == ["ours"] and started == ["ours"] and jobs == []
