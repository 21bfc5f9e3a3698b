"""Scheduler-side half of NexRTConnector (runs in vLLM's engine core).

Claims requests whose ``kv_transfer_params`` carry ``"nexrt"``, tells the workers which blocks
each claimed request occupies every step (chunked prefill, preemption, abort), and keeps a
finished request's blocks until the workers report its hand-off ended (sent, failed or aborted).
Every other request is ignored by every hook.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from nexrt_vllm.connector.metadata import NexRTMetadata, NexRTWorkerMetadata, Outcome, ReqStep
from nexrt_vllm.handoff.contracts import Claim, ContractError, HandoffReport, HandoffStatus, ProbeReply, is_probe
from nexrt_vllm.handoff.prefix import pack_ids
from nexrt_vllm.handoff.protocol import Reason

logger = init_logger("vllm.nexrt_connector")  # under "vllm": inherits vLLM's log handler and level


@dataclass
class _Tracked:
    request: Any  # vllm.v1.request.Request
    claim: Claim | None  # None: the claim was malformed (error says why)
    error: str = ""
    in_worker: bool = False  # a worker has seen it: its blocks may be in flight
    finished: bool = False  # vLLM finished it; blocks held until finished_sending
    outcome: Outcome | None = None


class NexRTScheduler:
    def __init__(self, kv_cache_manager_getter, info: dict | None = None):
        self._kv_cache_manager = kv_cache_manager_getter
        self._info = info or {}  # the connector's configuration, the answer to a probe
        self._reqs: dict[str, _Tracked] = {}
        self._aborts: list[str] = []

    # -- claim ---------------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        if is_probe(request.kv_transfer_params):
            return  # answered in request_finished; nothing is claimed or sent
        try:
            claim = Claim.from_params(request.kv_transfer_params)
        except ContractError as e:
            logger.error("request %s: %s; it is prefilled but not handed off", request.request_id, e)
            self._reqs[request.request_id] = _Tracked(request, None, error=str(e))
            return
        if claim is not None:
            self._reqs[request.request_id] = _Tracked(request, claim)

    # -- per step ------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> NexRTMetadata:
        if not self._reqs:
            # Nothing claimed (an abort is only queued for a tracked request): an empty meta,
            # without looking at the batch (tests/connector/test_noop_cost.py counts this).
            return NexRTMetadata()
        meta = NexRTMetadata(aborted=self._aborts)
        self._aborts = []
        block_state = scheduler_output.kv_connector_block_state
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            t = self._reqs.get(req_id)
            if t is None or t.claim is None:
                continue
            req = t.request
            block_ids = block_state.get_block_ids(req_id) if block_state is not None else None
            if block_ids is None:
                block_ids = self._kv_cache_manager().get_block_ids(req_id)
            start = req.num_computed_tokens
            # the job's begin (its first step) gives the node the prompt's ids
            ids = pack_ids(req.prompt_token_ids) if not t.in_worker and req.prompt_token_ids is not None else None
            meta.steps.append(ReqStep(req_id, t.claim, req.num_prompt_tokens, start, start + n,
                                      tuple(list(b) for b in block_ids), ids))
            t.in_worker = True
        meta.preempted = [r for r in scheduler_output.preempted_req_ids or () if r in self._reqs]
        return meta

    def update_connector_output(self, output) -> None:
        wm = output.kv_connector_worker_meta
        if isinstance(wm, NexRTWorkerMetadata):
            for req_id, o in wm.outcomes.items():
                t = self._reqs.get(req_id)
                if t is not None:
                    t.outcome = o
                    if o.status != HandoffStatus.SENT:
                        logger.warning("hand-off of request %s (rid %s) %s: %s %s", req_id,
                                       t.claim.rid if t.claim else "?", o.status.value,
                                       o.reason.value if o.reason else "", o.error)
        for req_id in output.finished_sending or ():
            t = self._reqs.get(req_id)
            if t is not None and t.finished:
                del self._reqs[req_id]

    # -- finish --------------------------------------------------------------------------------
    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        t = self._reqs.get(request.request_id)
        if t is None:
            if is_probe(request.kv_transfer_params):
                return False, ProbeReply(self._info).to_params()
            return False, None
        if t.claim is None:
            del self._reqs[request.request_id]
            return False, HandoffReport(HandoffStatus.FAILED, reason=Reason.BAD_MESSAGE, error=t.error).to_params()
        c = t.claim
        info: dict[str, Any] = {"rid": c.rid, "generation": c.generation, "seq_len": request.num_prompt_tokens}
        if not t.in_worker:
            # Never scheduled (e.g. aborted while waiting): no block was ever read.
            del self._reqs[request.request_id]
            return False, HandoffReport(HandoffStatus.FAILED, **info, reason=Reason.CANCELLED,
                                        error="request finished before its prefill ran").to_params()
        if request.num_computed_tokens < request.num_prompt_tokens:
            # Aborted mid-prefill: tell the worker to stop and release; blocks held until it has.
            self._aborts.append(request.request_id)
        t.finished = True
        o = t.outcome
        if o is None:
            aborted = request.request_id in self._aborts
            report = HandoffReport(HandoffStatus.ABORTED if aborted else HandoffStatus.SENDING, **info)
        elif o.status == HandoffStatus.SENT:
            report = HandoffReport(o.status, **info)
        else:
            report = HandoffReport(o.status, **info, reason=o.reason, error=o.error)
        return True, report.to_params()

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping so get_finished can release held blocks once sends end.
        return bool(self._reqs) and any(t.finished for t in self._reqs.values())
