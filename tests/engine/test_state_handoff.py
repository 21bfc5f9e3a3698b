"""export_state / import_state: a fresh engine continues a request exactly like generate; imports
are validated against the native layout before anything is written."""
import pytest
import torch

from nexrt_vllm.engine import Engine, Sampler, SamplingParams, StateError
from nexrt_vllm.engine.state import AttentionState, GDNState

PROMPT = [9, 8, 200, 31, 77, 5, 123, 64, 3, 301, 44]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def pair(request, ckpt_factory):
    path = ckpt_factory(request.param, "bfloat16")
    return (Engine.from_pretrained(path, max_seq_len=64, progress=False),
            Engine.from_pretrained(path, max_seq_len=64, progress=False))


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_k=40, top_p=0.9, seed=1234)])
def test_stream_after_import_continues_like_generate(pair, sampling):
    src, dst = pair
    want = src.generate(PROMPT, max_new_tokens=20, ignore_eos=True, **sampling)
    params = SamplingParams(max_tokens=20, ignore_eos=True, **sampling)
    # the prefill side: prompt + first token (vLLM's role in a hand-off)
    first = Sampler(params)(src.prefill(PROMPT))
    assert first == want[0]
    dst.prefill([1, 2, 3])  # stale state on the receiver must not leak into the request
    dst.import_state(*src.export_state())
    assert dst.state.seq_len == len(PROMPT)
    assert list(dst.stream(first, params)) == want[1:]
    assert dst.finish_reason == "length"


def test_export_is_a_trimmed_copy(pair):
    src, _ = pair
    src.prefill(PROMPT)
    n, tensors = src.export_state()
    assert n == len(PROMPT)
    layout, live = src.state.layout(), src.state.named()
    assert set(tensors) == set(layout) == set(live)
    for name, t in tensors.items():
        shape, dtype = layout[name]
        want = (shape[0], n, shape[2]) if name.endswith((".k", ".v")) else shape
        assert tuple(t.shape) == want and t.dtype == dtype
        assert t.data_ptr() != live[name].data_ptr()
    # the names address the typed per-layer records
    i, j = src.config.gdn_layers[0], src.config.attention_layers[0]
    gdn, kv = GDNState.from_named(tensors, i), AttentionState.from_named(tensors, j)
    assert torch.equal(gdn.conv, src.state.gdn(i).conv) and torch.equal(gdn.rec, src.state.gdn(i).rec)
    assert torch.equal(kv.k, src.state.attention(j).k[:, :n]) and torch.equal(kv.v, src.state.attention(j).v[:, :n])
    gdn.conv.add_(1)
    assert not torch.equal(gdn.conv, src.state.gdn(i).conv)


def test_layer_accessors_name_the_wrong_kind(pair):
    src, _ = pair
    i, j = src.config.gdn_layers[0], src.config.attention_layers[0]
    with pytest.raises(StateError, match=f"layer {i} holds GDNState, not AttentionState"):
        src.state.attention(i)
    with pytest.raises(StateError, match=f"layer {j} holds AttentionState, not GDNState"):
        src.state.gdn(j)


def test_import_takes_full_size_kv_buffers(pair):
    src, dst = pair
    logits = src.prefill(PROMPT)
    full = {n: t.clone() for n, t in src.state.named().items()}  # K/V with max_seq_len rows
    dst.import_state(len(PROMPT), full)
    tok = int(logits.argmax())
    assert torch.equal(dst.decode_step(tok), src.decode_step(tok))


def _corrupt(tensors, how):
    t = dict(tensors)
    conv = next(n for n in t if n.endswith(".conv"))
    rec = next(n for n in t if n.endswith(".rec"))
    k = next(n for n in t if n.endswith(".k"))
    if how == "missing":
        del t[rec]
    elif how == "unexpected":
        t["layers.99.k"] = t[k]
    elif how == "shape":
        t[conv] = t[conv][:, :-1]
    elif how == "dtype":
        t[rec] = t[rec].to(torch.bfloat16)
    elif how == "short_kv":
        t[k] = t[k][:, :-1]
    elif how == "not_tensor":
        t[conv] = t[conv].tolist()
    return t


@pytest.mark.parametrize("how,msg", [
    ("missing", r"missing: \['layers\.\d+\.rec'\]"),
    ("unexpected", r"unexpected: \['layers\.99\.k'\]"),
    ("shape", r"layers\.\d+\.conv: shape \(512, 2\), expected \(512, 3\)"),
    ("dtype", r"layers\.\d+\.rec: dtype torch\.bfloat16, expected torch\.float32"),
    ("short_kv", r"layers\.\d+\.k: shape \(2, 10, 64\), expected \(2, L, 64\) with 11 <= L <= 64"),
    ("not_tensor", r"layers\.\d+\.conv: not a tensor"),
])
def test_bad_import_is_refused_and_leaves_state_untouched(pair, how, msg):
    src, dst = pair
    src.prefill(PROMPT)
    n, tensors = src.export_state()
    dst.prefill([4, 5, 6, 7])
    before = [t.clone() for t in dst.state.buffers()]
    with pytest.raises(StateError, match=msg):
        dst.import_state(n, _corrupt(tensors, how))
    assert dst.state.seq_len == 4
    assert all(torch.equal(b, t) for b, t in zip(before, dst.state.buffers()))


@pytest.mark.parametrize("seq_len", [0, 65, 3.0, True])
def test_bad_seq_len_is_refused(pair, seq_len):
    src, dst = pair
    src.prefill(PROMPT)
    _, tensors = src.export_state()
    with pytest.raises(StateError, match=r"seq_len must be an int in \[1, 64\]"):
        dst.import_state(seq_len, tensors)
    with pytest.raises(StateError, match="dict of tensors"):
        dst.import_state(len(PROMPT), list(tensors.values()))
