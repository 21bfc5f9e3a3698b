"""NexRTConnector: vLLM V1 KV connector that hands claimed requests to a NexRT decode node.

Load it with::

    --kv-transfer-config '{"kv_connector": "NexRTConnector",
                           "kv_connector_module_path": "nexrt_vllm.connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"transport": "mooncake"}}'

A request is ours only if its ``kv_transfer_params`` carry ``"nexrt"``; for any other request
every hook is a no-op, so the connector composes with vLLM's MultiConnector. See
docs/CONNECTOR.md for the options, the protocol and what overlaps with prefill.
"""
from __future__ import annotations

import uuid
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from nexrt_vllm.connector.config import ConnectorConfig, ConnectorConfigError
from nexrt_vllm.connector.metadata import NexRTMetadata


def probe_info(cfg: ConnectorConfig, vllm_config) -> dict:
    """What a configuration probe is told: the connector's transport and versions, the model vLLM
    serves (identity fields as the node's /capabilities names them, compute dtype), and an id of
    this vLLM process (a new one after a restart: its senders hold no connection to any node)."""
    from nexrt_vllm.handoff import layout as L
    from nexrt_vllm.handoff import protocol as P

    mc = vllm_config.model_config
    hf = mc.hf_text_config
    archs = getattr(mc.hf_config, "architectures", None) or [None]
    return {"transport": cfg.transport, "protocol_version": P.PROTOCOL_VERSION,
            "protocol_versions": list(P.PROTOCOL_VERSIONS), "layout_version": L.LAYOUT_VERSION,
            "model": {"name": mc.model, "architecture": archs[0],
                      "num_hidden_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size,
                      "vocab_size": hf.vocab_size},
            "dtype": str(mc.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype), "instance": uuid.uuid4().hex}


class NexRTConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if not ktc.is_kv_producer:
            raise ConnectorConfigError("NexRTConnector only sends: use kv_role 'kv_producer' (or 'kv_both')")
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            # Under TP every rank's worker ships its shard as one part of the hand-off; PP stages
            # would each hold some layers of every head: not a shape the node's parts describe.
            raise ConnectorConfigError("NexRTConnector supports pipeline parallel size 1 only")
        self._cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from nexrt_vllm.connector.scheduler import NexRTScheduler

            self._scheduler = NexRTScheduler(lambda: self._kv_cache_manager, probe_info(self._cfg, vllm_config))
        else:
            from nexrt_vllm.connector.worker import NexRTWorker

            self._worker = NexRTWorker(self._cfg, vllm_config, kv_cache_config)

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # a producer loads nothing

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return  # block ids are read each step in build_connector_meta

    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---------------- worker side ----------------
    @property
    def layout(self):
        """The page layout this worker ships (``handoff.layout.Layout``), once its KV cache is registered."""
        return self._worker.layout if self._worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, NexRTMetadata)
            self._worker.on_metadata(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, NexRTMetadata)
        self._worker.on_metadata(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
