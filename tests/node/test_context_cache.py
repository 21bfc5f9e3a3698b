"""The node's context cache (nexrt_vllm.node.context_cache): a finished request's attention rows are
kept and filled back exactly; lookups hold only what matches the prompt's ids exactly (another
layout, another prefix, a key collision: not held); the cache stays within its bytes (LRU, pinned
entries never evicted, superseded entries dropped); and a state started from held rows plus the
received tail decodes like the whole prompt."""
import pytest
import torch

from nexrt_vllm.engine import Engine, ModelConfig, SamplingParams
from nexrt_vllm.engine.state import DecodeState
from nexrt_vllm.handoff import prefix as X
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sharding import Sharding
from nexrt_vllm.node import context_cache as C
from nexrt_vllm.node.metrics import NodeMetrics
from nexrt_vllm.testing.senders import layout_for

BS = 16
SALT = X.layout_salt({"block_size": BS})


@pytest.fixture(scope="module")
def cfg(qwen3_next_ckpt):
    return ModelConfig.from_pretrained(qwen3_next_ckpt)


def _state(cfg, seed, n=256):
    """A DecodeState whose attention rows are random (seeded) and which holds n tokens."""
    st = DecodeState(cfg, 512, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for i in cfg.attention_layers:
        st.attention(i).k.copy_(torch.randn(st.attention(i).k.shape, generator=g))
        st.attention(i).v.copy_(torch.randn(st.attention(i).v.shape, generator=g))
    st.set_seq_len(n)
    return st


def _row_bytes(cfg):
    return len(cfg.attention_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _rows(st, cfg, n):
    return {i: (st.attention(i).k[:, :n].clone(), st.attention(i).v[:, :n].clone()) for i in cfg.attention_layers}


def test_store_lookup_fill_gives_the_rows_back_exactly(cfg):
    m = NodeMetrics()
    cache = C.ContextCache(1 << 30, m)
    ids = _ids(200)
    src = _state(cfg, 1, n=200)
    want = _rows(src, cfg, 200)
    assert cache.store(X.pack_ids(ids), SALT, BS, src)
    assert len(cache) == 1 and cache.nbytes == 200 * _row_bytes(cfg)
    # the next turn: the stored tokens, then new ones; 200 tokens held -> 192 (whole pages)
    prompt = ids + _ids(57, seed=9)
    hit = cache.lookup(X.pack_ids(prompt), SALT, BS, len(prompt))
    assert hit is not None and hit.tokens == 192 and hit.entry.pins == 1
    dst = _state(cfg, 2)
    hit.fill(dst)
    assert hit.released and hit.entry.pins == 0
    for i in cfg.attention_layers:
        assert torch.equal(dst.attention(i).k[:, :192], want[i][0][:, :192])
        assert torch.equal(dst.attention(i).v[:, :192], want[i][1][:, :192])
        assert not torch.equal(dst.attention(i).k[:, 192:200], want[i][0][:, 192:200])  # past held: untouched
    body = m.render().decode()
    assert 'nexrt_context_cache_lookups_total{outcome="hit"} 1.0' in body
    assert "nexrt_context_cache_held_tokens_total 192.0" in body
    assert f"nexrt_context_cache_bytes {float(200 * _row_bytes(cfg))}" in body
    assert "nexrt_context_cache_entries 1.0" in body
    assert "nexrt_context_cache_capacity_bytes 1.073741824e+09" in body


def test_only_an_exact_prefix_under_the_same_layout_is_held(cfg):
    cache = C.ContextCache(1 << 30)
    ids = _ids(160)
    cache.store(X.pack_ids(ids), SALT, BS, _state(cfg, 1, n=160))

    def held(prompt, salt=SALT, bs=BS):
        hit = cache.lookup(X.pack_ids(prompt), salt, bs, len(prompt))
        if hit is None:
            return 0
        hit.release()
        return hit.tokens

    assert held(ids + [5] * 40) == 160
    assert held(ids) == 160  # the whole prompt held: only the GDN state travels
    assert held(ids[:100]) == 96  # a shorter prompt: its own whole pages
    assert held(ids[:50] + [999] + ids[51:]) == 48  # differs in page 3: pages 0..2 held
    assert held([999] + ids[1:]) == 0  # differs in the first page
    assert held(ids + [5] * 40, salt=X.layout_salt({"block_size": BS, "x": 1})) == 0  # another layout
    assert held(ids + [5] * 40, bs=32) == 0  # another page size
    assert all(e.pins == 0 for e in cache._entries.values())


def test_a_key_collision_never_holds_other_tokens(cfg, monkeypatch):
    """Keys that collide (simulated: every block gets one key) find an entry; the exact id compare
    holds only what the prompt really shares with it."""
    monkeypatch.setattr(C, "block_hashes", lambda packed, bs, salt: iter([b"k"] * (len(packed) // (4 * bs))))
    cache = C.ContextCache(1 << 30)
    ids = _ids(160)
    cache.store(X.pack_ids(ids), SALT, BS, _state(cfg, 1, n=160))
    other = _ids(160, seed=5)
    assert cache.lookup(X.pack_ids(other), SALT, BS, 160) is None
    mixed = ids[:40] + other[40:]
    hit = cache.lookup(X.pack_ids(mixed), SALT, BS, 160)
    assert hit.tokens == 32
    hit.release()


def test_lru_stays_within_its_bytes(cfg):
    m = NodeMetrics()
    row = _row_bytes(cfg)
    cache = C.ContextCache(250 * row, m)  # two 100-token contexts fit, not three
    a, b, c = _ids(100, 1), _ids(100, 2), _ids(100, 3)
    for i, ids in enumerate((a, b)):
        assert cache.store(X.pack_ids(ids), SALT, BS, _state(cfg, i, n=100))
    cache.lookup(X.pack_ids(a), SALT, BS, 100).release()  # a is now the most recently used
    assert cache.store(X.pack_ids(c), SALT, BS, _state(cfg, 3, n=100))
    assert cache.nbytes == 200 * row <= cache.capacity and len(cache) == 2
    assert cache.lookup(X.pack_ids(b), SALT, BS, 100) is None  # b was least recently used: evicted
    for ids in (a, c):
        cache.lookup(X.pack_ids(ids), SALT, BS, 100).release()
    assert 'nexrt_context_cache_dropped_total{why="evicted"} 1.0' in m.render().decode()
    # a context larger than the cache keeps what fits, in whole rows; one shorter than a page nothing
    big = _ids(400, 4)
    assert cache.store(X.pack_ids(big), SALT, BS, _state(cfg, 4, n=400))
    assert len(cache) == 1 and cache.nbytes == 250 * row
    hit = cache.lookup(X.pack_ids(big), SALT, BS, 400)
    assert hit.tokens == 240
    hit.release()
    assert not cache.store(X.pack_ids(_ids(10, 5)), SALT, BS, _state(cfg, 5, n=10))


def test_pinned_entries_are_not_evicted(cfg):
    row = _row_bytes(cfg)
    cache = C.ContextCache(150 * row)
    a, b = _ids(100, 1), _ids(100, 2)
    cache.store(X.pack_ids(a), SALT, BS, _state(cfg, 1, n=100))
    hit = cache.lookup(X.pack_ids(a), SALT, BS, 100)  # a hand-off is using a
    assert not cache.store(X.pack_ids(b), SALT, BS, _state(cfg, 2, n=100))
    assert len(cache) == 1 and cache.nbytes == 100 * row
    hit.release()
    hit.release()  # idempotent: the service releases at the fill and again when the admission ends
    assert hit.entry.pins == 0
    assert cache.store(X.pack_ids(b), SALT, BS, _state(cfg, 2, n=100))
    assert cache.lookup(X.pack_ids(a), SALT, BS, 100) is None


def test_a_longer_context_supersedes_its_prefix(cfg):
    """The next turn's entry holds every page the last turn's held: the older one goes."""
    m = NodeMetrics()
    cache = C.ContextCache(1 << 30, m)
    t1 = _ids(100)
    cache.store(X.pack_ids(t1), SALT, BS, _state(cfg, 1, n=100))
    t2 = t1[:96] + _ids(60, 7)  # diverges inside page 6 (tokens 96..99): pages 0..5 shared
    cache.store(X.pack_ids(t2), SALT, BS, _state(cfg, 1, n=156))
    assert len(cache) == 1
    assert 'nexrt_context_cache_dropped_total{why="superseded"} 1.0' in m.render().decode()
    other = t1[:40] + _ids(60, 8)  # a branch that shares less is another context: both kept
    cache.store(X.pack_ids(other), SALT, BS, _state(cfg, 1, n=100))
    assert len(cache) == 2


def test_node_context_uses_only_what_it_can(cfg):
    """No prompt (an older sender), a sharded hand-off, or ids that do not match seq_len: a full hand-off."""
    m = NodeMetrics()
    ctx = C.NodeContext(C.ContextCache(1 << 30, m))
    layout = layout_for(cfg, block_size=BS)
    engine = type("E", (), {"tp": 1})()
    ids = X.pack_ids(_ids(64))
    for msg, lay in ((P.Begin("r", 1, 64, layout.to_wire()), layout),
                     (P.Begin("r", 1, 64, layout.to_wire(), prompt=ids[:-4]), layout)):
        assert ctx.begin(msg, lay, engine).prompt is None
    sharded = type(layout)(layout.model, layout.block_size, layout.layers,
                           sharding=Sharding(2, 0, (0, 1), (0, 1), (0, 2)))
    assert ctx.begin(P.Begin("r", 1, 64, layout.to_wire(), prompt=ids), sharded, engine).held == 0
    assert ctx.begin(P.Begin("r", 1, 64, layout.to_wire(), prompt=ids), layout, type("E", (), {"tp": 2})()).held == 0
    p = ctx.begin(P.Begin("r", 1, 64, layout.to_wire(), prompt=ids), layout, engine)
    assert p.prompt == ids and p.salt == X.layout_salt(layout.to_wire()) and p.held == 0
    assert 'nexrt_context_cache_lookups_total{outcome="unusable"} 4.0' in m.render().decode()
    assert 'nexrt_context_cache_lookups_total{outcome="miss"} 1.0' in m.render().decode()
    off = C.NodeContext()
    assert not off.cache.enabled and off.begin(P.Begin("r", 1, 64, layout.to_wire(), prompt=ids), layout,
                                               engine).prompt is None


@pytest.fixture(scope="module")
def engines(trained_ckpt):
    torch.set_num_threads(1)
    return [Engine.from_pretrained(trained_ckpt, dtype="float32", max_seq_len=512, progress=False) for _ in range(2)]


def test_held_rows_and_the_received_tail_decode_like_the_whole_prompt(engines):
    """The node (engine B) keeps turn 1's rows (prompt + the tokens it decoded); turn 2's state is
    those rows (held) and the tail of a prefill of turn 2's prompt: B then continues exactly as a
    fresh generate of turn 2's prompt does."""
    from nexrt_vllm.testing.connector_harness import periodic_prompt

    a, b = engines
    ctx = C.NodeContext(C.ContextCache(1 << 30))
    layout = layout_for(a.config, block_size=BS)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    p1 = periodic_prompt(70, seed=3)
    first = int(a.prefill(p1).argmax())
    b.import_state(*a.export_state())
    out1 = list(b.stream(first, greedy))
    assert b.state.seq_len == 70 + 23  # the first token and all decoded but the last were fed
    parts = type("Parts", (), {"prefix": C.Prefix(X.pack_ids(p1), X.layout_salt(layout.to_wire()), BS)})()
    ctx.store(b, parts, first, out1)
    assert ctx.cache._entries[next(iter(ctx.cache._entries))].tokens == 93

    p2 = p1 + [first] + out1 + periodic_prompt(30, seed=4)
    want = a.generate(p2, 24, ignore_eos=True)
    prefix = ctx.begin(P.Begin("r2", 2, len(p2), layout.to_wire(), prompt=X.pack_ids(p2)), layout, b)
    assert prefix.held == 80  # 93 known rows, in whole 16-token pages
    a.prefill(p2)
    n, full = a.export_state()  # the prefill of p2 (what vLLM ships)
    tail = {k: (t[:, prefix.held:] if k.endswith((".k", ".v")) else t) for k, t in full.items()}
    b.prefill([1, 2, 3])  # another request ran in between
    prefix.fill(b.state)
    b.import_state(n, tail, start=prefix.held)
    got = [want[0], *b.stream(want[0], greedy)]
    assert got == want
