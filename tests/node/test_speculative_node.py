"""`nexrt-decode --speculative mtp`: a real node decodes a handed-off request with the checkpoint's
MTP head (no MTP context shipped: the head starts at the node's first position) and streams the
prefill engine's own greedy tokens; /metrics has the acceptance-length histogram, /capabilities the
method and the draft vocabulary (here a --draft-token-map, which only the CUDA graph path's round
reads); the flags are refused clearly without an MTP head, with --tp > 1, on the CUDA graph path
with --graph eager, and with a draft token map that is unreadable or does not fit the vocabulary."""
import json
import subprocess
import sys

import pytest
import torch

from nexrt_vllm.testing.connector_harness import TRAINED_MTP, period_continuation, periodic_prompt
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen3_next", "bfloat16", **TRAINED_MTP["qwen3_next"])


MAP = list(range(379, 2, -1))  # the periodic prompts' ids (connector_harness.periodic_prompt), any order


@pytest.fixture(scope="module")
def node(ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("map") / "map.json"
    path.write_text(json.dumps({"source": "test", "coverage": {"heldout": None}, "token_ids": MAP}))
    # the head drafts in fp8 (its projections and lm_head copy quantized at load): exact tokens all the same
    n = NodeProcess(ckpt, "mooncake", "--speculative", "mtp", "--num-speculative-tokens", "3",
                    "--draft-token-map", str(path), "--draft-weights", "fp8", max_seq_len=512)
    yield n
    assert n.wait_free()["busy_slots"] == 0
    n.stop()


@pytest.fixture(scope="module")
def side(ckpt):
    s = PrefillSide(ckpt, "mooncake", max_seq_len=512)
    yield s
    s.close()


def _request(node, side, rid, prompt, max_tokens, **sampling):
    prep = side.prepare(prompt)
    adm = node.admit(rid)
    side.send(node, rid, adm["generation"], prep)
    return prep["first"], node.generate(rid, adm["generation"], prep["first"], max_tokens, **sampling)


def test_greedy_tokens_and_acceptance_histogram(node, side):
    caps = node.call("GET", "/capabilities")[1]
    assert caps["speculative"] == {"method": "mtp", "num_speculative_tokens": 3, "draft_weights": "fp8",
                                   "synthetic_acceptance": None, "draft_vocab": {"kind": "map", "size": len(MAP)}}
    assert node.metric("nexrt_spec_synthetic_acceptance_length") == 0
    assert node.metric("nexrt_speculative", 'method="mtp",num_speculative_tokens="3"') == 1
    def hist():
        return (node.metric("nexrt_spec_acceptance_length_count"), node.metric("nexrt_spec_acceptance_length_sum"),
                [node.metric("nexrt_spec_acceptance_length_bucket", f'le="{k}.0"') for k in range(1, 5)])

    count0, sum0, b0 = hist()
    prompt = periodic_prompt(60, seed=4)
    first, (tokens, end) = _request(node, side, "spec-greedy", prompt, 257, ignore_eos=True)
    assert end["finish_reason"] == "length"
    want = side.reference(prompt, 257)  # the prefill engine's own one-token loop
    assert [first, *tokens] == want == period_continuation(prompt, 257)
    count, total, b = hist()
    rounds, emitted, b = count - count0, total - sum0, [x - y for x, y in zip(b, b0)]
    assert rounds > 0 and emitted / rounds > 1.5, (rounds, emitted)
    # one plain step first (no MTP context), then verify rounds (the last may be cut by max_tokens)
    assert len(tokens) <= emitted + 1 <= len(tokens) + 4
    # buckets le=1..4: cumulative, the last holds every round
    assert b == sorted(b) and b[-1] == rounds


def test_sampled_request_is_reproducible(node, side):
    prompt = periodic_prompt(30, seed=9)
    runs = [_request(node, side, f"spec-sample-{i}", prompt, 40, temperature=3.0, top_k=4, seed=123, ignore_eos=True)
            for i in range(2)]
    (f1, (t1, e1)), (f2, (t2, e2)) = runs
    assert len(t1) == 39 and e1["finish_reason"] == "length"
    assert (f1, t1) == (f2, t2)  # same seed, same tokens
    other = _request(node, side, "spec-sample-x", prompt, 40, temperature=3.0, top_k=4, seed=124, ignore_eos=True)
    assert other[1][0] != t1


def _start(model, *flags):
    return subprocess.run([sys.executable, "-m", "nexrt_vllm.node.server", "--model", model, "--port", "0",
                           "--max-seq-len", "64", *flags], capture_output=True, text=True, timeout=120)


def test_refusals(ckpt_factory, ckpt, tmp_path):
    r = _start(ckpt_factory("qwen3_5", "bfloat16"), "--speculative", "mtp")
    assert r.returncode == 1 and "--speculative mtp: the checkpoint has no MTP head" in r.stderr, r.stderr[-2000:]
    r = _start(ckpt, "--speculative", "mtp", "--tp", "2")
    assert r.returncode == 2 and "--speculative mtp with --tp > 1 is not built" in r.stderr
    r = _start(ckpt, "--speculative", "mtp", "--device", "cuda", "--graph", "eager")
    assert r.returncode == 2 and "runs the fused kernels (--graph fused or auto), not --graph eager" in r.stderr
    r = _start(ckpt, "--speculative", "mtp", "--draft-vocab", "0")
    assert r.returncode == 1 and "draft_vocab must be an int in [1, " in r.stderr, r.stderr[-2000:]
    maps = {"dup.json": {"token_ids": [4, 9, 4]}, "range.json": {"token_ids": [1, 10 ** 6]},
            "list.json": [1, 2, 3], "missing.json": None}
    for name, body in maps.items():
        if body is not None:
            (tmp_path / name).write_text(json.dumps(body))
    for name, why in (("dup.json", "ids must be distinct, repeated: [4]"), ("range.json", "ids must be in [0, "),
                      ("list.json", 'expected a JSON object with "token_ids"'), ("missing.json", "cannot read the map")):
        r = _start(ckpt, "--speculative", "mtp", "--draft-token-map", str(tmp_path / name))
        assert r.returncode == 1 and f"--draft-token-map {tmp_path / name}: " in r.stderr and why in r.stderr, \
            r.stderr[-2000:]
    r = _start(ckpt, "--speculative", "mtp", "--draft-vocab", "64", "--draft-token-map", str(tmp_path / "dup.json"))
    assert r.returncode == 2 and "give --draft-vocab or --draft-token-map, not both" in r.stderr
    r = _start(ckpt, "--draft-token-map", str(tmp_path / "dup.json"))
    assert r.returncode == 2 and "--draft-vocab / --draft-token-map need --speculative mtp" in r.stderr
    r = _start(ckpt, "--draft-weights", "fp8")
    assert r.returncode == 2 and "--draft-weights needs --speculative mtp" in r.stderr
    r = _start(ckpt, "--speculative", "mtp", "--draft-weights", "int4")
    assert r.returncode == 2 and "--draft-weights: invalid choice: 'int4'" in r.stderr
    r = _start(ckpt, "--speculative", "mtp", "--num-speculative-tokens", "0")
    assert r.returncode == 2 and "--num-speculative-tokens must be in [1, 15]" in r.stderr
    r = _start(ckpt, "--speculative-synthetic-acceptance", "3.39")
    assert r.returncode == 2 and "need --speculative mtp" in r.stderr
    r = _start(ckpt, "--speculative", "mtp", "--speculative-synthetic-acceptance", "4.5")
    assert r.returncode == 2 and "must be in [1, 4]" in r.stderr
    r = _start(ckpt, "--speculative", "mtp", "--speculative-synthetic-rates", "0.5,0.9,0")
    assert r.returncode == 2 and "non-increasing" in r.stderr
    r = _start(ckpt, "--speculative", "mtp", "--speculative-synthetic-rates", "1,1,0.4",
               "--speculative-synthetic-acceptance", "3.4")
    assert r.returncode == 2 and "not both" in r.stderr
