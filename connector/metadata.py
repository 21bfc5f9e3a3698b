"""What the scheduler-side connector tells the workers each step, and what they report back."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from nexrt_vllm.handoff.contracts import Claim, HandoffStatus
from nexrt_vllm.handoff.protocol import Reason


@dataclass
class ReqStep:
    """One claimed request scheduled in this step."""

    req_id: str  # vLLM's request id
    claim: Claim
    prompt_len: int  # N: the node receives N tokens of state
    start: int  # tokens computed before this step
    end: int  # tokens computed after this step
    block_ids: tuple[list[int], ...]  # current blocks, one list per KV-cache group
    # the prompt's token ids (handoff.prefix.pack_ids), in the request's first step only: the node's
    # context cache may hold their leading tokens (begin.prompt)
    prompt_ids: bytes | None = None

    @property
    def completes_prefill(self) -> bool:
        return self.start < self.prompt_len <= self.end


@dataclass
class NexRTMetadata(KVConnectorMetadata):
    steps: list[ReqStep] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # claimed requests whose blocks were freed
    aborted: list[str] = field(default_factory=list)  # claimed requests finished before their prefill


@dataclass
class Outcome:
    """How a hand-off ended (sent, failed or aborted), as a worker saw it."""

    status: HandoffStatus
    reason: Reason | None = None  # why, when not sent
    error: str = ""

    def __post_init__(self):
        self.status = HandoffStatus(self.status)
        self.reason = Reason(self.reason) if self.reason else None


@dataclass
class NexRTWorkerMetadata(KVConnectorWorkerMetadata):
    """Terminal outcomes of hand-offs since the last step (req_id -> Outcome)."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "NexRTWorkerMetadata":
        assert isinstance(other, NexRTWorkerMetadata)
        merged = dict(self.outcomes)
        for rid, o in other.outcomes.items():
            # With several workers (TP) one failed rank fails the hand-off.
            if rid not in merged or o.status != HandoffStatus.SENT:
                merged[rid] = o
        return NexRTWorkerMetadata(merged)
