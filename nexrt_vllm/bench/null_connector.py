"""A vLLM KV connector whose every hook does nothing: the control of benchmarks/connector_overhead.py
(what vLLM itself charges for having *a* connector). vLLM loads it by module path:
`{"kv_connector": "NullConnector", "kv_connector_module_path": "nexrt_vllm.bench.null_connector"}`."""
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    """Control: a connector that claims nothing and does nothing in every hook."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return

    def build_connector_meta(self, scheduler_output):
        return _NullMeta()

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        return

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        return


class _NullMeta(KVConnectorMetadata):
    pass
