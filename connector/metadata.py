"""What the scheduler-side connector tells the workers each step, and what they report back."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from nexrt_vllm.connector.config import Claim


@dataclass
class ReqStep:
    """One claimed request scheduled in this step."""

    req_id: str  # vLLM's request id
    claim: Claim
    prompt_len: int  # N: the node receives N tokens of state
    start: int  # tokens computed before this step
    end: int  # tokens computed after this step
    block_ids: tuple[list[int], ...]  # current blocks, one list per KV-cache group

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
    status: str  # "sent" | "failed" | "aborted"
    reason: str = ""  # protocol.Reason value on failure
    error: str = ""


@dataclass
class NexRTWorkerMetadata(KVConnectorWorkerMetadata):
    """Terminal outcomes of hand-offs since the last step (req_id -> Outcome)."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "NexRTWorkerMetadata":
        assert isinstance(other, NexRTWorkerMetadata)
        merged = dict(self.outcomes)
        for rid, o in other.outcomes.items():
            # With several workers (TP) one failed rank fails the hand-off.
            if rid not in merged or o.status != "sent":
                merged[rid] = o
        return NexRTWorkerMetadata(merged)
