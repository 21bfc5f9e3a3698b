"""A real `nexrt-decode --context-cache-gib` against this process playing the prefill side (engine
prefill, vLLM-like pages, HandoffSender with the prompt's ids): a conversation's turns ship only
the pages the node lacks and decode the prefill engine's own greedy tokens, with the one-token step,
with MTP speculative decoding (whose verify rounds leave the same rows) and on a node of two slots
(a turn's rows kept from one slot fill another's); a sender that speaks
protocol version 1 gets a full hand-off and the same tokens, and the node stays usable."""
import pytest
import torch

from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

torch.set_num_threads(1)
BS = 16
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen3_next", "bfloat16", **TRAINED_MTP["qwen3_next"])


@pytest.fixture(scope="module")
def side(ckpt):
    s = PrefillSide(ckpt, "mooncake", max_seq_len=1024, block_size=BS)
    yield s
    s.close()


@pytest.fixture(scope="module", params=["one-token", "mtp", "batch"])
def node(request, ckpt):
    extra = {"one-token": (), "mtp": ("--speculative", "mtp", "--num-speculative-tokens", "3"),
             # slots are handed out in turn: a turn's rows are kept from one slot and filled into another
             "batch": ("--max-batch", "2")}[request.param]
    n = NodeProcess(ckpt, "mooncake", "--context-cache-gib", "0.01", *extra, max_seq_len=1024)
    yield n
    assert n.wait_free()["busy_slots"] == 0
    n.stop()


def turn(node, side, rid, prompt):
    """-> (the request's tokens, bytes the node received, tokens it held); the tokens are checked
    against the prefill engine's own greedy generation."""
    b0, h0 = node.metric("nexrt_transfer_bytes_total"), node.metric("nexrt_context_cache_held_tokens_total")
    prep = side.prepare(prompt)
    adm = node.admit(rid, prompt_len=len(prompt))
    t = side.send(node, rid, adm["generation"], prep)
    tokens, end = node.generate(rid, adm["generation"], prep["first"], MAX_TOKENS, ignore_eos=True)
    got = [prep["first"], *tokens]
    assert end["finish_reason"] == "length" and got == side.reference(prompt, MAX_TOKENS)
    sent = node.metric("nexrt_transfer_bytes_total") - b0
    assert sent == t.nbytes
    return got, sent, node.metric("nexrt_context_cache_held_tokens_total") - h0, t


def full_bytes(prep_layout, seq_len):
    return sum(r.nbytes for r in prep_layout.regions(seq_len))


def test_turns_ship_only_what_the_node_lacks(node, side):
    p1 = periodic_prompt(70, seed=21)
    out1, sent1, held1, t1 = turn(node, side, "t1", p1)
    assert held1 == 0 and t1.held_tokens == 0
    p2 = p1 + out1 + periodic_prompt(40, seed=7)
    out2, sent2, held2, t2 = turn(node, side, "t2", p2)
    known = len(p1) + MAX_TOKENS - 1  # the prompt, vLLM's token and every decoded token but the last
    assert held2 == t2.held_tokens == known // BS * BS
    att = [x for x in t2.layout.layers if x.kind == "attention"]
    full = full_bytes(t2.layout, len(p2))
    assert sent2 == full - held2 // BS * sum(x.page_bytes for x in att) < full


def test_a_version_1_sender_gets_a_full_hand_off(node, side, monkeypatch):
    p1 = periodic_prompt(70, seed=33)
    out1, _, _, _ = turn(node, side, "v1-a", p1)
    p2 = p1 + out1 + periodic_prompt(40, seed=34)
    monkeypatch.setattr(P, "PROTOCOL_VERSION", 1)  # what an older connector speaks (no prompt, no held tokens)
    side.sender._peers.clear()
    out2, sent, held, t = turn(node, side, "v1-b", p2)
    assert held == 0 and t.version == 1 and sent == full_bytes(t.layout, len(p2))
    monkeypatch.undo()
    side.sender._peers.clear()
    p3 = p2 + out2 + periodic_prompt(20, seed=35)
    _, _, held, t = turn(node, side, "v1-c", p3)
    # the version-1 turn kept nothing (its ids were not given): turn v1-a's context is what is held
    assert t.version == 2 and held == (len(p1) + MAX_TOKENS - 1) // BS * BS
