"""The speculative round's bookkeeping kernels (kernels/spec.py) against torch, in the interpreter (CI)
or compiled (NEXRT_KERNEL_DEVICE=cuda): accept counts the leading drafts equal to the target's
tokens and publishes exactly the round's tokens, the round record and the advanced counters; the MTP
head's input rows equal the eager `Drafter._input` normalisation; a draft pick stores the argmax
(through a draft token map, the map's id at it) where the next verify and the next chained step read it."""
import pytest
import torch

from nexrt_vllm.engine import kernels
from nexrt_vllm.testing.kernel_calls import DEV, call, rms1p

spec = dict(zip(kernels.MODULES, kernels.load(interpret=DEV == "cpu")))["spec"]

torch.set_num_threads(1)
RING = 64


def partials(rows: list[int], n_part: int = 37, per: int = 5, seed: int = 0):
    """Per-program (max, argmax) partials whose global argmax of row j is rows[j] (ties elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    pmax = torch.rand(len(rows), n_part, generator=g)
    pidx = torch.stack([torch.arange(n_part, dtype=torch.int32) * per for _ in rows])
    for j, t in enumerate(rows):
        p = t // per
        pmax[j, p] = 2.0
        pidx[j, p] = t
    return pmax, pidx


@pytest.mark.parametrize("m,drafts_ok", [(4, 0), (4, 1), (4, 3), (2, 1), (3, 2)])
def test_accept_publishes_the_round(m, drafts_ok):
    y = [17 + 5 * j for j in range(m)]  # the target's tokens (multiples-of-5 friendly ids)
    pmax, pidx = partials(y)
    drafts = [y[j] if j < drafts_ok else y[j] + 1 for j in range(m - 1)]
    tok = torch.tensor([99] + drafts, dtype=torch.int64)
    yb = torch.full((m,), -7, dtype=torch.int64)
    pos, base, acc = torch.tensor([100]), torch.tensor([-1]), torch.tensor([-1])
    step, rnd = torch.tensor([62]), torch.tensor([5])  # the ring wraps inside the round
    ring, rounds = torch.full((RING,), -1, dtype=torch.int64), torch.full((RING,), -1, dtype=torch.int64)
    call(spec.accept, pmax, pidx, pmax.shape[1], tok, yb, pos, base, acc, step, rnd, ring, rounds, RING)
    a = drafts_ok
    assert yb.tolist() == y
    assert int(acc) == a and int(base) == 100 and int(pos) == 100 + a + 1
    assert int(step) == 62 + a + 1 and int(rnd) == 6
    assert int(tok[0]) == y[a] and tok[1:].tolist() == drafts
    for j in range(a + 1):  # steps 63.. in slots 62, 63, 0, 1
        s = 63 + j
        assert int(ring[(s - 1) % RING]) == (s << 32) | y[j]
    assert int((ring != -1).sum()) == a + 1
    assert int(rounds[5]) == (6 << 32) | (a + 1) and int((rounds != -1).sum()) == 1


def test_accept_ties_take_the_lowest_id():
    pmax = torch.tensor([[1.0, 3.0, 3.0, 0.5], [3.0, 1.0, 3.0, 3.0]])
    pidx = torch.tensor([[4, 9, 2, 7], [8, 1, 6, 3]], dtype=torch.int32)
    tok = torch.tensor([0, 2], dtype=torch.int64)
    yb = torch.zeros(2, dtype=torch.int64)
    z = lambda v=0: torch.tensor([v])  # noqa: E731
    acc = z()
    call(spec.accept, pmax, pidx, 4, tok, yb, z(), z(), acc, z(), z(), torch.full((RING,), -1),
         torch.full((RING,), -1), RING)
    assert yb.tolist() == [2, 3] and int(acc) == 1


def test_mtp_input_rows():
    g = torch.Generator().manual_seed(3)
    H, V, T = 96, 50, 3
    emb = torch.randn(V, H, generator=g).to(torch.bfloat16)
    hid = torch.randn(T + 1, H, generator=g).to(torch.bfloat16)[:T]  # a view of a wider buffer
    we, wh = (torch.randn(H, generator=g) * 0.1).to(torch.bfloat16), (torch.randn(H, generator=g) * 0.1).to(torch.bfloat16)
    tok = torch.tensor([4, 49, 0])
    out = torch.full((T, 2 * H), float("nan"), dtype=torch.bfloat16)
    call(spec.mtp_input, tok, emb, hid, we, wh, out, 1e-6)
    ref = torch.cat((rms1p(emb[tok], we), rms1p(hid, wh)), dim=-1)
    assert torch.equal(out, ref)


def test_draft_pick():
    pmax, pidx = partials([23], n_part=9)
    tok = torch.tensor([5, 0, 0, 0])
    dtok, base, acc, dpos = torch.tensor([-1]), torch.tensor([40]), torch.tensor([2]), torch.tensor([-1])
    call(spec.draft_pick, pmax[0], pidx[0], 9, tok, dtok, base, acc, dpos, 2)
    assert tok.tolist() == [5, 0, 23, 0] and int(dtok) == 23 and int(dpos) == 44


def test_draft_pick_through_a_token_map():
    # the head read the rows of a draft token map: the argmax (index 23) is the map's 24th id
    pmax, pidx = partials([23], n_part=9)
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(3))[:45].to(torch.int32)
    tok = torch.tensor([5, 0, 0, 0])
    dtok, base, acc, dpos = torch.tensor([-1]), torch.tensor([40]), torch.tensor([0]), torch.tensor([-1])
    call(spec.draft_pick, pmax[0], pidx[0], 9, tok, dtok, base, acc, dpos, 1, ids)
    d = int(ids[23])
    assert tok.tolist() == [5, d, 0, 0] and int(dtok) == d and int(dpos) == 41


@pytest.mark.parametrize("mapped", [False, True])
def test_draft_pick_input_is_the_pick_then_the_input(mapped):
    """One launch for a pick and the chained step's input: the same tokens, positions and fc input rows
    (byte for byte) as draft_pick then mtp_input, over 3 slots of which the middle one is not live."""
    g = torch.Generator().manual_seed(5)
    H, V, B, M, K = 96, 60, 3, 4, 2
    pmax, pidx = partials([23, 7, 41], n_part=12)
    ids = torch.randperm(V, generator=g)[:60].to(torch.int32) if mapped else None
    emb = torch.randn(V, H, generator=g).to(torch.bfloat16)
    hid = torch.randn(B + 1, H, generator=g).to(torch.bfloat16)[:B]  # a view of a wider buffer
    we, wh = (torch.randn(H, generator=g) * 0.1).to(torch.bfloat16), (torch.randn(H, generator=g) * 0.1).to(torch.bfloat16)
    live = torch.tensor([1, 0, 1], dtype=torch.int32)

    def words():
        return (torch.arange(B * M, dtype=torch.int64).view(B, M) + 100, torch.tensor([5, 9, 3]),
                torch.tensor([40, 50, 60]), torch.tensor([2, 1, -1]), torch.tensor([-1, -1, -1]))

    tok, dtok, base, acc, dpos = want = words()
    call(spec.draft_pick, pmax, pidx, 12, tok, dtok, base, acc, dpos, K, ids, live=live)
    ref = torch.full((B, 2 * H), float("nan"), dtype=torch.bfloat16)
    call(spec.mtp_input, dtok, emb, hid, we, wh, ref, 1e-6)
    tok, dtok, base, acc, dpos = got = words()
    out = torch.full((B, 2 * H), float("nan"), dtype=torch.bfloat16)
    call(spec.draft_pick_input, pmax, pidx, 12, tok, dtok, base, acc, dpos, K, emb, hid, we, wh, out, 1e-6, ids,
         live=live)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(out, ref)
    picked = [int(ids[t]) if mapped else t for t in (23, 41)]
    assert [int(dtok[0]), int(dtok[1]), int(dtok[2])] == [picked[0], 9, picked[1]]
    assert dpos.tolist() == [40 + 2 + K, -1, 60 + 0 + K] and int(tok[1, K]) == 100 + M + K
