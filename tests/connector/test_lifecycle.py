"""A hand-off's lifecycle off the happy path: refused by the node, node killed, transfer error,
malformed claim, request aborted mid-prefill, request preempted mid-prefill. vLLM keeps serving,
the node never decodes from an incomplete state, a preempted request still hands off a correct
state, and every held block comes back: vLLM's free block count returns to its starting value."""
import pytest

from nexrt_vllm.testing.connector_harness import (TRAINED, NodeProc, RecordingReceiver, VLLMProc, assert_vllm_greedy, continue_on_node,
                               nexrt_kv_config, periodic_prompt)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def env(ckpt_factory, tmp_path_factory):
    ckpt = ckpt_factory("qwen3_next", "bfloat16", **TRAINED)
    d = tmp_path_factory.mktemp("lifecycle")
    procs = []
    try:
        live = NodeProc(ckpt, "mooncake", str(d / "live.log"), str(d), extra_args=("--dtype", "float32"))
        procs.append(live)
        doomed = NodeProc(ckpt, "mooncake", str(d / "doomed.log"), str(d))
        procs.append(doomed)
        vllm = VLLMProc({"model": ckpt, "max_num_batched_tokens": 512,
                         "kv_transfer_config": nexrt_kv_config("mooncake", control_timeout_s=2.0,
                                                               transfer_timeout_s=5.0)},
                        str(d / "vllm.log"))
        procs.append(vllm)
        yield {"vllm": vllm, "live": live, "doomed": doomed, "start_free": vllm.ready["free_blocks"],
               "vllm_log": str(d / "vllm.log")}
    finally:
        for p in reversed(procs):
            p.close()


def _gen_error(node, claim):
    status, toks, last = node.generate(claim, 7, 8)
    assert toks == [], "the node decoded from a hand-off that never completed"
    return status, last


def test_refused_handoff(env):
    vllm, live = env["vllm"], env["live"]
    claim = live.admit("refused-real", 2000)
    bogus = {"nexrt": {**claim["nexrt"], "rid": "never-admitted"}}
    # 2000 tokens prefill in 4 steps; the refusal (one local round trip) is known long before the end
    (out,) = vllm.generate([{"prompt_token_ids": periodic_prompt(2000, 1), "max_tokens": 1,
                             "kv_transfer_params": bogus}])
    assert len(out["token_ids"]) == 1  # vLLM still answers, and says the hand-off failed
    assert out["kv_transfer_params"]["nexrt"] == {"rid": "never-admitted", "generation": claim["nexrt"]["generation"],
                                                  "seq_len": 2000, "status": "failed", "reason": "unknown_rid",
                                                  "error": "rid 'never-admitted' was not admitted"}
    status, last = _gen_error(live, bogus)
    assert status >= 400, (status, last)
    live.post("/v1/cancel", {"rid": "refused-real"})


def test_killed_node(env):
    vllm, doomed = env["vllm"], env["doomed"]
    claim = doomed.admit("dead", 700)
    doomed.kill()
    (out,) = vllm.generate([{"prompt_token_ids": periodic_prompt(700, 2), "max_tokens": 1, "kv_transfer_params": claim}],
                           timeout=120)
    assert len(out["token_ids"]) == 1
    settled = vllm.call({"op": "settle", "timeout": 30})
    assert not settled["pending"], "blocks of the dead node's request still held"


def test_transfer_error(env):
    rx = RecordingReceiver(unregistered=True)  # accepts, but every page write is refused by the engine
    try:
        claim = {"nexrt": {"rid": "xfer", "generation": 1, "control_addr": rx.addr}}
        (out,) = env["vllm"].generate([{"prompt_token_ids": periodic_prompt(2000, 9), "max_tokens": 1,
                                        "kv_transfer_params": claim}])
        assert out["kv_transfer_params"]["nexrt"]["status"] == "failed"
        assert out["kv_transfer_params"]["nexrt"]["reason"] == "transfer_failed"
        assert not env["vllm"].call({"op": "settle", "timeout": 30})["pending"]
        assert "xfer" in rx.aborted and "xfer" not in rx.done  # told the node; never claimed success
    finally:
        rx.close()


def test_malformed_claim(env):
    (out,) = env["vllm"].generate([{"prompt_token_ids": periodic_prompt(20, 3), "max_tokens": 2,
                                    "kv_transfer_params": {"nexrt": {"rid": 5}}}])
    assert len(out["token_ids"]) == 2
    assert out["kv_transfer_params"] == {"nexrt": {"status": "failed", "reason": "bad_message",
                                                   "error": "kv_transfer_params.nexrt.rid must be a non-empty string"}}


def test_abort_mid_prefill(env):
    vllm, live = env["vllm"], env["live"]
    claim = live.admit("aborted", 1100)
    vllm.call({"op": "abort_midway", "request_id": "abort-1", "steps": 1,
               "request": {"prompt_token_ids": periodic_prompt(1100, 4), "max_tokens": 1, "kv_transfer_params": claim}})
    settled = vllm.call({"op": "settle", "timeout": 30})
    assert not settled["pending"]
    status, last = _gen_error(live, claim)
    assert status >= 400 or last.get("finish_reason") in ("error", "cancelled"), (status, last)


def test_preempted_mid_prefill_still_correct(env):
    vllm, live = env["vllm"], env["live"]
    prompt = periodic_prompt(1500, 6)
    claim = live.admit("preempted", len(prompt))
    out = vllm.call({"op": "preempt_midway", "request_id": "preempt-1", "steps": 2,
                     "request": {"prompt_token_ids": prompt, "max_tokens": 1, "kv_transfer_params": claim}})
    # pages written before the preemption are rewritten from the recomputed blocks
    assert_vllm_greedy(vllm, prompt, continue_on_node(live, claim, out, 33))
    assert "preempted: its hand-off restarts" in open(env["vllm_log"]).read()


def test_unclaimed_after_failures_and_no_block_leak(env):
    vllm = env["vllm"]
    (out,) = vllm.generate([{"prompt_token_ids": periodic_prompt(50, 5), "max_tokens": 4}])
    assert len(out["token_ids"]) == 4 and out["kv_transfer_params"] is None
    settled = vllm.call({"op": "settle", "timeout": 30})
    assert settled == {"free_blocks": env["start_free"], "pending": False}
