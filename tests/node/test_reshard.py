"""Re-sharding N prefill parts into M node shards (nexrt_vllm.node.reshard), on synthetic states
whose every value names its layer part, head (or conv segment and channel) and position, so a
value in the wrong place is caught. Sources are cut by vLLM's rule written out here, independently
of the code under test: KV heads (one head per rank, shipped by its first replica, when TP > KV
heads), GDN key/value heads, conv channels split per segment q | k | v."""
import pytest
import torch

from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.handoff.sharding import Sharding
from nexrt_vllm.node import reshard as R

DK, DV, HD, W, L = 2, 3, 4, 3, 5  # GDN key/value head dims, attention head dim, conv width, tokens


def _cfg(kv: int, nk: int = 4, nv: int = 8) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "num_attention_heads": 8, "num_key_value_heads": kv, "head_dim": HD, "linear_num_key_heads": nk,
        "linear_num_value_heads": nv, "linear_key_head_dim": DK, "linear_value_head_dim": DV,
        "linear_conv_kernel_dim": W + 1, "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 4,
        "shared_expert_intermediate_size": 4, "intermediate_size": 4})


# value codes: attention 1e6*(1 + kv) + 1e4*head + 10*t + d; conv 1e6*seg + 10*channel + column
# (seg 1 = q, 2 = k, 3 = v; channel counted inside its segment); recurrent 1e4*head + 100*a + b
def _kv(head, t, d, v):
    return 1e6 * (1 + v) + 1e4 * head + 10 * t + d


def _global(cfg) -> dict:
    st = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            h, t, d = torch.meshgrid(torch.arange(cfg.num_kv_heads), torch.arange(L), torch.arange(HD), indexing="ij")
            st[f"layers.{i}.k"] = (_kv(h, t, d, 0) + i).double()
            st[f"layers.{i}.v"] = (_kv(h, t, d, 1) + i).double()
        else:
            segs = [(1, cfg.key_dim), (2, cfg.key_dim), (3, cfg.value_dim)]
            st[f"layers.{i}.conv"] = torch.cat([
                1e6 * s + 10 * torch.arange(n)[:, None] + torch.arange(W)[None] + 0.25 * i
                for s, n in segs]).double()
            h, a, b = torch.meshgrid(torch.arange(cfg.linear_num_value_heads), torch.arange(DK), torch.arange(DV),
                                     indexing="ij")
            st[f"layers.{i}.rec"] = (1e4 * h + 100 * a + b + 0.25 * i).double()
    return st


def _vllm_kv(cfg, tp, r):
    if tp <= cfg.num_kv_heads:
        n = cfg.num_kv_heads // tp
        return list(range(r * n, (r + 1) * n)), True
    reps = tp // cfg.num_kv_heads
    return [r // reps], r % reps == 0


def _vllm_part(cfg, g, tp, r, shipped=True):
    """Rank r's shard of the global state g under vLLM TP = tp, cut by hand."""
    kv, ships = _vllm_kv(cfg, tp, r)
    nk, nv = cfg.linear_num_key_heads // tp, cfg.linear_num_value_heads // tp
    out = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            if ships or not shipped:
                for p in "kv":
                    out[f"layers.{i}.{p}"] = g[f"layers.{i}.{p}"][kv].clone()
        else:
            c = g[f"layers.{i}.conv"]
            kd, q0, v0 = cfg.key_dim, r * nk * DK, r * nv * DV
            out[f"layers.{i}.conv"] = torch.cat([c[q0: q0 + nk * DK], c[kd + q0: kd + q0 + nk * DK],
                                                 c[2 * kd + v0: 2 * kd + v0 + nv * DV]])
            out[f"layers.{i}.rec"] = g[f"layers.{i}.rec"][r * nv: (r + 1) * nv].clone()
    sh = Sharding(tp, r, (kv[0], kv[-1] + 1) if (ships or not shipped) else None, (r * nk, (r + 1) * nk),
                  (r * nv, (r + 1) * nv))
    return sh, out


CASES = [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4), (4, 4), (1, 4), (4, 1)]


@pytest.mark.parametrize("kv", [2, 1])
@pytest.mark.parametrize("n,m", CASES, ids=[f"{n}to{m}" for n, m in CASES])
def test_n_parts_to_m_shards_exact(n, m, kv):
    cfg = _cfg(kv)
    g = _global(cfg)
    parts = [_vllm_part(cfg, g, n, r) for r in range(n)]
    assert [p[0] for p in parts] == R.prefill_parts(cfg, n)
    if n > kv:  # replicated heads are shipped once
        assert sum(s.kv_heads is not None for s, _ in parts) == kv
    got = R.reshard(cfg, parts, R.node_shards(cfg, m))
    for r, shard in enumerate(got):
        want = _vllm_part(cfg, g, m, r, shipped=False)[1]
        assert sorted(shard) == sorted(want)
        for name in want:
            assert torch.equal(shard[name], want[name]), (name, r)


def test_round_trip_through_every_split():
    cfg = _cfg(2)
    g = _global(cfg)
    for n in (1, 2, 4):
        back = R.merge_state(cfg, list(zip(R.node_shards(cfg, n), R.split_state(cfg, g, R.node_shards(cfg, n)))))
        assert all(torch.equal(back[k], g[k]) for k in g)


def test_conv_segments_are_split_separately():
    """A part's conv channels are q[its key heads] | k[its key heads] | v[its value heads]: slicing
    the concatenated channels as one block (the known trap) gives other values, and re-sharding
    from such slices cannot reproduce the state."""
    cfg = _cfg(2)
    g = _global(cfg)
    conv = g["layers.0.conv"]
    for n in (2, 4):
        block = conv.shape[0] // n
        for r in range(n):
            right = _vllm_part(cfg, g, n, r)[1]["layers.0.conv"]
            one_block = conv[r * block: (r + 1) * block]
            assert right.shape == one_block.shape and not torch.equal(right, one_block)
            seg = (right // 1e6).long().tolist()  # every shard holds all three segments, in order
            assert [s[0] for s in seg] == sorted(s[0] for s in seg) and {s[0] for s in seg} == {1, 2, 3}
        wrong = []
        for r in range(n):
            s, st = _vllm_part(cfg, g, n, r)
            wrong.append((s, {**st, **{f"layers.{i}.conv": g[f"layers.{i}.conv"][r * block: (r + 1) * block]
                                       for i in cfg.gdn_layers}}))
        merged = R.merge_state(cfg, wrong)
        assert not torch.equal(merged["layers.0.conv"], conv)
        merged = R.merge_state(cfg, [_vllm_part(cfg, g, n, r) for r in range(n)])
        assert torch.equal(merged["layers.0.conv"], conv) and torch.equal(merged["layers.2.conv"], g["layers.2.conv"])


def test_missing_heads_and_bad_shapes_are_named():
    cfg = _cfg(2)
    g = _global(cfg)
    parts = [_vllm_part(cfg, g, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="no part holds heads"):
        R.merge_state(cfg, parts[:1])
    s, st = parts[1]
    with pytest.raises(ValueError, match="layers.2.rec has shape"):
        R.merge_state(cfg, [parts[0], (s, {**st, "layers.2.rec": st["layers.2.rec"][:1]})])
    with pytest.raises(ValueError, match="lacks layers.1.k"):
        R.merge_state(cfg, [parts[0], (s, {k: v for k, v in st.items() if k != "layers.1.k"})])
