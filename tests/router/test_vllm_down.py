"""vLLM unreachable: a clear 5xx error, the node reservation is cancelled, no slot leaks."""
import requests

from nexrt_vllm.testing import make_tokenizer
from nexrt_vllm.testing.router_fakes import Stack


def test_vllm_down(tmp_path):
    make_tokenizer(str(tmp_path))
    s = Stack(str(tmp_path), n_nodes=1, router_args=("--default-class", "interactive"))
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        assert requests.post(s.url + "/v1/completions", json=body, timeout=10).status_code == 200
        s.loop.stop_app(s.vllm_url)
        for stream in (False, True):
            r = requests.post(s.url + "/v1/completions", json={**body, "stream": stream},
                              timeout=10)
            assert r.status_code == 502, r.text
            assert "vLLM prefill failed" in r.json()["error"]["message"]
        assert s.idle()
        assert s.nodes[0].rid is None and len(s.nodes[0].cancels) == 2
        assert s.health()["nodes"][0]["healthy"]          # vLLM's failure is not the node's
        # /v1/models is proxied to vLLM: also a clear error.
        r = requests.get(s.url + "/v1/models", timeout=10)
        assert r.status_code == 502 and "error" in r.json()
    finally:
        s.close()


def test_vllm_down_at_first_request(tmp_path):
    make_tokenizer(str(tmp_path))
    s = Stack(str(tmp_path), n_nodes=1, router_args=("--default-class", "interactive"))
    try:
        s.loop.stop_app(s.vllm_url)                       # before the router saw its model list
        r = requests.post(s.url + "/v1/chat/completions", timeout=10, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
        assert s.nodes[0].admits == 0 and s.idle()
    finally:
        s.close()
