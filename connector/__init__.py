"""NexRT's vLLM KV connector, installed as ``nexrt_vllm.connector`` (docs/CONNECTOR.md)."""
from nexrt_vllm.connector.connector import NexRTConnector

__all__ = ["NexRTConnector"]
