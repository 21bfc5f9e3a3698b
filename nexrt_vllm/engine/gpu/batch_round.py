"""MTP speculative decoding for B request slots: one captured CUDA graph per batched round.

The one-request round (gpu/spec_round.py: verify, accept, commit, draft) over the B slots of a batch
node (`--max-batch B --speculative mtp`), every slot's M positions in the same launches: the
verify's R = B * M rows are slot-major (row b * M + j: slot b's position pos[b] + j), so each
projection is one M-row GEMV over all of them (each weight tile read once, on the tensor cores),
the per-slot work (the GDN conv and recurrence over the slot's state, attention over its cache,
the MoE experts its rows route to) runs the one-request round's kernel bodies with a grid axis over
the slots (kernels/batch_round.py), and accept / commit / draft pick are per-slot programs
(kernels/spec.py, kernels/gdn.py with `live`). The MTP head drafts for every slot together: its
pass over the R rows (its own K/V cache per slot), then the M - 2 chained steps with one row per
slot. Which slots take part is the device mask `live` (the host writes it between replays); a slot
that is not live keeps its state, position, tokens and counters.

Each slot has its own counters (device): the step counter of its tokens (the control ring's column b
receives (step << 32 | token) for each token a round emits) and its round counter (the round
ring's column b receives (round << 32 | tokens emitted)). A round never emits a token past the
slot's context (the accept clamps it), so a slot speculates to its last position: its rows past
the end are junk no token comes from (the K/V caches carry M rows of slack, StackedStates pad_rows).

Greedy requests without logprobs or grammar (the others decode on their slot engine's eager round).
`BatchRoundRunner` is the host side: `join`, `step`, `leave` as gpu/batch_runner.py's, a step being
one round (each request gets 1..M tokens from it); as there, one graph per bucket of slots (1, 2, 4,
... B: the first k slots, k * M rows), the smallest holding every live slot replayed. Each bucket makes
the launch choices of its own rows, and the one-slot bucket runs the one-request round's in_proj + conv
launch and one-row GEMVs, so a batch node serving one request rounds as fast as a one-request node
(Tuning.batch_invariant: every bucket makes the node's choices instead).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from nexrt_vllm.engine.decode_loop import DecodeLoop
from nexrt_vllm.engine.errors import EngineError, NotBuiltError
from nexrt_vllm.engine.fp8 import FP8Weight
from nexrt_vllm.engine.gpu.batch_decoder import BatchDecoder, gated_out_proj
from nexrt_vllm.engine.gpu.batch_runner import SlotEvent, SlotRunner
from nexrt_vllm.engine.gpu.control import RING, wait_record
from nexrt_vllm.engine.gpu.decoder import Launch, gdn_kw
from nexrt_vllm.engine.gpu.fusion import FusedLayer, GDNMixer, MoEFFN
from nexrt_vllm.engine.gpu.spec_round import SYNTHETIC_ROUNDS, draft_rows, fuse_head
from nexrt_vllm.engine.gpu.tuning import RowsShape, gemv_kwargs, moe_kwargs
from nexrt_vllm.engine.model import rope_tables


class BatchRoundDecoder:
    """Static buffers of the batched round over a `BatchDecoder`'s fused weights and stacked states (whose
    K/V caches carry M rows of slack: `StackedStates(pad_rows=M)`), the MTP head's weights `w`
    (spec/mtp.py MTPWeights) and a head K/V cache per slot (`draft_k`, `draft_v`, `draft_start`: what
    each slot's eager Drafter is over). `plan()` is the round as launches, `launch()` enqueues it."""

    def __init__(self, batch: BatchDecoder, w, num_speculative_tokens: int, draft_vocab=None,
                 synthetic: bool = False):
        from nexrt_vllm.engine.kernels import batch_round, gdn, spec  # triton: GPU path only
        self.kr, self.k_spec, self.k_gdn = batch_round, spec, gdn
        self.b, self.cfg, self.t, self.states = batch, batch.cfg, batch.t, batch.states
        c, n, M = batch.cfg, batch.n, num_speculative_tokens + 1
        self.n, self.M, self.R = n, M, n * M
        if self.R > batch_round.MAX_ROWS:
            raise NotBuiltError(f"the batched speculative round verifies at most {batch_round.MAX_ROWS} rows: "
                                f"{n} slots x {M} positions (num_speculative_tokens {num_speculative_tokens}) "
                                f"= {self.R}")
        L = self.states.max_seq_len
        probe = self.states.attention(c.attention_layers[0]).k if c.attention_layers else None
        if probe is not None and probe.untyped_storage().nbytes() < probe.numel() * probe.element_size() \
                + M * c.head_dim * probe.element_size():
            raise EngineError(f"the batched round needs StackedStates(pad_rows={M}) (rows past a context's end)")
        V, H, dev, dt = c.vocab_size, c.hidden_size, self.states.device, self.states.dtype
        z = lambda *s, d=dt: torch.zeros(*s, dtype=d, device=dev)  # noqa: E731
        i64, R = torch.int64, self.R
        # control: each slot's verify tokens [t, d_1..] and target tokens, its round's first position,
        # accepted count, the head's chained-step token / position, its round and token counters
        self.tok, self.y = z(n, M, d=i64), z(n, M, d=i64)
        self.base, self.acc, self.dtok, self.dpos, self.round, self.step = (z(n, d=i64) for _ in range(6))
        self.live, self.pos = batch.live, self.states.position
        self.row_live = z(R, d=torch.int32)  # live, per row (the MoE experts' rows)
        self.mem = batch.mem
        self.ring_host, self.ring = self.mem.host["slot_ring"], self.mem.device["slot_ring"]
        self.rounds_host, self.rounds = self.mem.host["slot_rounds"], self.mem.device["slot_rounds"]
        # verify activations, R rows (the head's layer has the shapes of the target's attention layers)
        self.res, self.buf = z(R, H), z(R, batch.buf.shape[1])
        # Tuning.norm_rows: the RMSNorm of the M-row passes' GEMVs once per row into xr, then plain GEMVs (in
        # the buckets of that many rows; Tuning.batch_invariant: in every bucket when the whole batch has them)
        self.xr = z(R, H) if self._norm_once(R, n) else None
        self.o, self.q = z(R, batch.o.shape[1]), z(R, batch.q.shape[1])
        self.window = {i: z(n, c.conv_dim, c.conv_kernel - 1 + M) for i in c.gdn_layers}
        # the GDN states after each position (gdn_commit picks the accepted one), or with Tuning.gdn_recommit
        # none and each GDN layer's own verify rows (gdn.Recommit runs the accepted ones again, all layers in
        # one launch)
        self.recommit = self.t.gdn_recommit
        self.rec_after = None if self.recommit else {
            i: z(n, M, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, d=torch.float32)
            for i in c.gdn_layers}
        self.gdn_buf = {i: z(R, batch.buf.shape[1]) for i in c.gdn_layers} if self.recommit else {}
        self.commit_all = self.k_gdn.Recommit(
            [(self.gdn_buf[i], self.states.gdn(i).conv, self.states.gdn(i).rec, self.window[i],
              batch.layers[i].mixer.a_log, batch.layers[i].mixer.dt_bias) for i in c.gdn_layers], m=M,
            slots=True, **gdn_kw(c, self.t)) if self.recommit and c.gdn_layers else None
        rows = L + M  # the head's cache (and the target's, read up to M rows past its end)
        self.attn_scratch = {k: z(*s, d=torch.float32) for k, s in batch_round.verify_rows_scratch(
            n, M, c.num_heads, self.t.slot_attn_splits, rows, c.head_dim).items()}
        if c.num_experts:
            self.act, self.router_logits = z(R, batch.act.shape[1]), z(R, c.num_experts + 1)
            self.ids, self.wts = z(R, c.num_experts_per_tok, d=torch.int32), z(R, c.num_experts_per_tok,
                                                                               d=torch.float32)
            self.xn = z(R, H)
        if c.intermediate_size:
            self.act_dense = z(R, c.intermediate_size)
        self.logits = z(R, V, d=torch.float32)
        self.n_part = self._partials(batch.lm_head, V, M)
        self.pmax, self.pidx = z(R, self.n_part, d=torch.float32), z(R, self.n_part, d=torch.int32)
        self.hn = z(R, H)  # final-normed hidden rows (the head's input)
        # the head: its layer fused like the target's, over a K/V cache per slot
        self.w = w
        self.draft_k = z(n, c.num_kv_heads, rows, c.head_dim)
        self.draft_v = torch.zeros_like(self.draft_k)
        self.draft_start = z(n, d=i64)
        self.draft_cos, self.draft_sin = rope_tables(c, rows, dt, dev)
        self.head = fuse_head(w, self.draft_k, self.draft_v)
        self.draft_vocab, self.draft_lm, self.draft_ids = draft_rows(w.lm_head, draft_vocab)
        self.fc_in, self.u = z(R, 2 * H), z(R, H)
        self.u1, self.g1 = z(n, H), z(n, H)
        self.dlogits = z(n, self.draft_vocab, d=torch.float32)
        self.n_dpart = self._partials(self.draft_lm, self.draft_vocab, 1)
        self.dpmax, self.dpidx = z(n, self.n_dpart, d=torch.float32), z(n, self.n_dpart, d=torch.int32)
        # pinned acceptance (benchmarks): each slot's accepted-draft counts per round, written at join
        self.forced = z(n, SYNTHETIC_ROUNDS, d=i64) if synthetic else None

    def drafter_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, start) of `slot`'s head cache: what its eager Drafter is built over (spec/mtp.py)."""
        return self.draft_k[slot], self.draft_v[slot], self.draft_start[slot:slot + 1]

    def _partials(self, w, n_out: int, per_slot: int) -> int:
        """The argmax partials per row of an lm_head over `per_slot` rows a slot (`Tuning.lm_rows`), the same in
        every bucket: what the accept / pick launches read."""
        blocks = {self._rows_kw(w, n_out, k * per_slot, k, self.t.lm_rows)["block_n"] for k in (1, self.n)}
        if len(blocks) > 1:
            raise EngineError(f"Tuning.lm_rows {tuple(self.t.lm_rows)}: the batched round's lm_heads need one "
                              f"block_n at every slot count (block_n >= 16, or stages > 0), got {sorted(blocks)}")
        return -(-n_out // blocks.pop())

    def _choice_rows(self, rows: int, k: int) -> int:
        """The row count that the choices of a launch over `rows` rows of slots 0..k-1 follow (shapes, kernels,
        the norm in a launch of its own): its own rows, so that a replay of few slots runs what a round of that
        many rows runs best (one slot: the one-request round's choices); with Tuning.batch_invariant the rows
        of all n slots, so that a request's arithmetic does not depend on how many slots the replay covers."""
        return rows * self.n // k if self.t.batch_invariant else rows

    def _norm_once(self, rows: int, k: int) -> bool:
        return self._choice_rows(rows, k) >= self.t.norm_rows

    def _rows_kw(self, w, n_out: int, rows: int, k: int, shape: RowsShape | None = None, dot: bool = False) -> dict:
        """The keywords of an M-row GEMV over `rows` rows of slots 0..k-1: `shape` (else the `gemv_rows` rule for
        n_out outputs, `gemv_rows_wide`'s past 8 rows), on the tensor-core kernel past 8 rows (the fold keeps at
        most 8 rows in registers) or with `dot`; rows as `_choice_rows` counts them. One row (the head's chained
        steps of one slot) without a fixed shape: the one-row GEMV's own rule, as the one-request round's chain
        runs it (the M-row rules' 16-row, one-warp shapes on the one-row kernel took the H100's chained gate/up
        121 µs a round against 42)."""
        fp8 = isinstance(w, FP8Weight)
        if shape is None and not dot and self._choice_rows(rows, k) == 1:
            return gemv_kwargs(self.t, w, self.t.shape(n_out, fp8=fp8))
        wide = self._choice_rows(rows, k) > 8
        s = shape or self.t.shape(n_out, fp8=fp8, rows=True, wide=wide)
        if (dot or wide) and s.stages == 0:
            s = RowsShape(max(16, s.block_n), max(16, s.block_k), s.num_warps, 2)
        return gemv_kwargs(self.t, w, s)

    # ---- the round ---------------------------------------------------------------------------------
    def plan(self, k: int | None = None) -> list[Launch]:
        """The round's launches in order (group names as the one-request round's: verify_* / accept /
        commit / draft_* / chain_*) over slots 0..k-1 (default: all; rows k*M.. and slots k.. are left out)."""
        b, c, g, k = self.b, self.cfg, self.b.k_gemv, k or self.n
        if not 1 <= k <= self.n:
            raise EngineError(f"a batched round runs 1..{self.n} slots, got {k}")
        R, live, once = k * self.M, self.live[:k], self._norm_once(k * self.M, k)
        steps = [Launch("verify_embed", None, lambda: b.k_samp.gather_rows(self.tok[:k].view(-1), b.embed,
                                                                           self.res[:R]))]
        for i, L in enumerate(b.layers):
            mixer = self._gdn(i, L, k) if isinstance(L.mixer, GDNMixer) else self._attention(
                L, self.res[:R], self.pos[:k], None, self.M, k, b.model.rope_cos, b.model.rope_sin, once)
            ffn = self._ffn(L, self.res[:R], self.row_live[:R], k, once)
            steps += [Launch("verify_" + grp, i, fn) for grp, fn in mixer + ffn]
        # the final-normed rows left in hn: the head's input
        steps += [Launch("verify_" + grp, None, fn) for grp, fn in self._rmsnorm_gemv(
            "lm_head+argmax", self.res[:R], b.final_norm, b.lm_head, self.logits[:R], R, once,
            xn=self.hn[:R], epi=g.EPI_ARGMAX, aux0=self.pmax[:R], aux1=self.pidx[:R],
            **self._rows_kw(b.lm_head, self.cfg.vocab_size, R, k, self.t.lm_rows))]
        steps.append(Launch("accept", None, lambda: self.k_spec.accept(
            self.pmax[:R], self.pidx[:R], self.n_part, self.tok[:k], self.y[:k], self.pos[:k], self.base[:k],
            self.acc[:k], self.step[:k], self.round[:k], self.ring, self.rounds, RING,
            None if self.forced is None else self.forced[:k], live=live, max_len=self.states.max_seq_len)))
        if self.commit_all is not None:  # every GDN layer's commit in one launch
            steps.append(Launch("commit", None, lambda: self.commit_all(self.acc[:k], live)))
        for i in c.gdn_layers if self.commit_all is None else ():
            st = self.states.gdn(i)
            steps.append(Launch("commit", i, lambda i=i, st=st: self.k_gdn.gdn_commit(
                st.conv, st.rec, self.window[i][:k], self.rec_after[i][:k], self.acc[:k], live=live)))
        return steps + self._draft(k)

    def _gdn(self, i: int, L: FusedLayer, k: int):
        c, t, m, eps, M, kr, g = self.cfg, self.t, L.mixer, self.cfg.rms_norm_eps, self.M, self.kr, self.b.k_gemv
        R, live, st = k * M, self.live[:k], self.states.gdn(i)
        buf = self.gdn_buf.get(i, self.buf)  # Tuning.gdn_recommit: the layer's own rows, read again at the commit
        once, rows = self._norm_once(R, k), self._choice_rows(R, k)
        sh = self._rows_kw(m.w_in, m.w_in.shape[0], R, k, dot=True)  # the per-slot conv follows the tensor-core loop
        split = rows >= t.gated_norm_rows
        gated = self._rows_kw(m.w_out, c.hidden_size, R, k, None if split else t.gemv_gated_rows)
        x = self.xr[:R] if once else self.res[:R]
        norm = [("gdn_in_proj+conv", lambda: g.rmsnorm_rows(self.res[:R], L.input_norm, x, m=R, eps=eps))] \
            if once else []
        pro = g.PRO_NONE if once else g.PRO_RMSNORM
        if rows == M:
            # one slot: the one-request round's launch over slot 0's conv state (read only) and window; the
            # per-slot kernel, which stores the rows and reads them back for the conv, took the H100's
            # one-slot round 417 µs here against the one-request round's 286
            conv = [("gdn_in_proj+conv", lambda: g.gemv(
                x, m.w_in, buf[:R], pro=pro, epi=g.EPI_CONV, norm_w=L.input_norm, aux0=st.conv[0], aux1=m.conv_w,
                window=self.window[i][0], eps=eps, conv_n=c.conv_dim, kc=c.conv_kernel, m=M,
                **self.b.rows_shape(m.w_in, m.w_in.shape[0], t.prefetch_conv)))]
        else:
            conv = [("gdn_in_proj+conv", lambda: kr.gemv_conv_slots(
                x, m.w_in, buf[:R], L.input_norm, st.conv, m.conv_w, self.window[i][:k], live, m=M,
                eps=eps, conv_n=c.conv_dim, kc=c.conv_kernel, block_n=sh["block_n"], block_k=sh["block_k"],
                num_warps=sh["num_warps"], stages=sh["dot"], all_slots=t.conv_all_slots, normed=once,
                round_w=sh.get("round_w", False)))]
        return norm + conv + [
            ("gdn_step", lambda: kr.gdn_verify_rows(
                buf[:R], st.rec, None if self.recommit else self.rec_after[i][:k], self.o[:R], m.a_log, m.dt_bias,
                live, m=M, **gdn_kw(c, t))),
            *gated_out_proj(g, self.k_gdn, self.o[:R], buf[:R, c.conv_dim:c.conv_dim + c.value_dim], m,
                            self.res[:R], R, c.linear_value_head_dim, eps, split, gated)]

    def _rmsnorm_gemv(self, grp: str, x, norm_w, w, y, rows: int, norm_once: bool, xn=None, **kw) -> list[tuple]:
        """The (grp, launch) pairs of an M-row GEMV over RMSNorm(x[:rows]) into y: the norm in its prologue, or
        with `norm_once` (Tuning.norm_rows) in a launch of its own into xr and then the plain GEMV. `xn`: where
        the normed rows are left too (the lm_head's, the MTP head's input); `kw`: the GEMV's epilogue and shape."""
        g, eps = self.b.k_gemv, self.cfg.rms_norm_eps
        if not norm_once:
            return [(grp, lambda: g.gemv(x, w, y, pro=g.PRO_RMSNORM, norm_w=norm_w, eps=eps, xn_out=xn, m=rows,
                                         **kw))]
        xr = self.xr[:rows] if xn is None else xn
        return [(grp, lambda: g.rmsnorm_rows(x, norm_w, xr, m=rows, eps=eps)),
                (grp, lambda: g.gemv(xr, w, y, m=rows, **kw))]

    def _attention(self, L: FusedLayer, x, pos, start, m: int, k: int, cos, sin, norm_once: bool = False):
        """A full-attention mixer over each of slots 0..k-1's m rows of x at positions pos[b]..pos[b]+m-1 (the
        target's layers; the head's over its own caches, `start` their first valid rows); `norm_once`: its
        input norm in a launch of its own (Tuning.norm_rows)."""
        c, t, a, eps, kr, g = self.cfg, self.t, L.mixer, self.cfg.rms_norm_eps, self.kr, self.b.k_gemv
        rows, live = k * m, self.live[:k]
        buf, q, o = self.buf[:rows], self.q[:rows], self.o[:rows]
        scratch = {name: t_[:k] for name, t_ in self.attn_scratch.items()}
        qkv_kw = self._rows_kw(a.w_qkv, a.w_qkv.shape[0], rows, k)
        o_kw = self._rows_kw(a.w_o, c.hidden_size, rows, k)
        return self._rmsnorm_gemv("attn_qkv_proj", x, L.input_norm, a.w_qkv, buf, rows, norm_once, **qkv_kw) + [
            ("attn_qknorm_rope_kvwrite", lambda: kr.qk_rope_rows(
                buf, q, a.state.k, a.state.v, a.q_norm, a.k_norm, cos, sin, pos, live, m=m,
                num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rotary_dim=c.rotary_dim,
                eps=eps)),
            ("attn_splitk+combine", lambda: kr.attention_verify_rows(
                q, a.state.k, a.state.v, pos, live, buf, o, **scratch, m=m, num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, start=start, nsplit=t.slot_attn_splits,
                block=t.attn_block, min_per=t.attn_min_per, num_warps=t.attn_warps)),
            ("attn_o_proj", lambda: g.gemv(o, a.w_o, x, epi=g.EPI_RESIDUAL, m=rows, **o_kw))]

    def _ffn(self, L: FusedLayer, x, live, k: int, norm_once: bool = False):
        """The FFN over the rows of x, slots 0..k-1 (`live`, one word per row: which rows' experts run); `norm_once`: a dense
        FFN's post-attention norm in a launch of its own (Tuning.norm_rows; the MoE router stores it anyway)."""
        c, t, ff, eps, g, m = self.cfg, self.t, L.ffn, self.cfg.rms_norm_eps, self.b.k_gemv, x.shape[0]
        if isinstance(ff, MoEFFN):
            router_kw = self._rows_kw(ff.w_router, ff.w_router.shape[0], m, k)
            return [("moe_router", lambda: g.gemv(
                        x, ff.w_router, self.router_logits[:m], pro=g.PRO_RMSNORM, norm_w=L.post_norm, eps=eps,
                        xn_out=self.xn[:m], m=m, **router_kw)),
                    ("moe_experts", lambda: self.b.k_moe.moe_experts(
                        self.xn[:m], x, self.router_logits[:m], ff.gate_up, ff.s_gate_up, ff.down, ff.s_down,
                        self.act[:m], self.ids[:m], self.wts[:m], live=live, **moe_kwargs(t, c, ff)))]
        up_kw = self._rows_kw(ff.w_gate_up, ff.w_gate_up.shape[0] // 2, m, k)
        down_kw = self._rows_kw(ff.w_down, c.hidden_size, m, k)
        return self._rmsnorm_gemv("mlp_gate_up+swiglu", x, L.post_norm, ff.w_gate_up, self.act_dense[:m], m, norm_once,
                                  epi=g.EPI_SWIGLU, **up_kw) + [
            ("mlp_down", lambda: g.gemv(self.act_dense[:m], ff.w_down, x, epi=g.EPI_RESIDUAL, m=m, **down_kw))]

    def _draft(self, k: int) -> list[Launch]:
        """The head's launches over slots 0..k-1: its pass over every slot's M rows, then the chained steps, one
        row per slot, each from the pick of the draft before it fused with its input (`draft_pick_input`); the
        last draft's pick ends the round (groups draft_* / chain_*)."""
        c, M, g, w, ks = self.cfg, self.M, self.b.k_gemv, self.w, self.k_spec
        R, live, eps = k * M, self.live[:k], c.rms_norm_eps
        start, u, u1, g1 = self.draft_start[:k], self.u[:R], self.u1[:k], self.g1[:k]
        words = (self.dpmax[:k], self.dpidx[:k], self.n_dpart, self.tok[:k], self.dtok[:k], self.base[:k],
                 self.acc[:k], self.dpos[:k])

        def head(x, fc_in, pos, m, first, norm_once=False):
            fc_kw = self._rows_kw(w.fc, c.hidden_size, x.shape[0], k)
            steps = [first, ("fc", lambda: g.gemv(fc_in, w.fc, x, m=x.shape[0], **fc_kw))]
            steps += self._attention(self.head, x, pos, start, m, k, self.draft_cos, self.draft_sin, norm_once)
            if m > 1:  # only each slot's accepted row goes on (the other rows' K/V are written)
                steps.append(("select", select))
            return steps + self._ffn(self.head, u1, live, k)

        def lm_head():
            return ("lm_head+argmax", lambda: g.gemv(
                u1, self.draft_lm, self.dlogits[:k], pro=g.PRO_RMSNORM, epi=g.EPI_ARGMAX, norm_w=w.norm,
                aux0=self.dpmax[:k], aux1=self.dpidx[:k], xn_out=g1, eps=eps, m=k, n=self.draft_vocab,
                **self._rows_kw(self.draft_lm, self.draft_vocab, k, k, self.t.lm_rows)))

        def pick_input(j):  # each live slot's d_j, and the fc input of its chained step (g, d_j)
            return ("pick+input", lambda: ks.draft_pick_input(
                *words, j, w.embed, g1, w.pre_fc_norm_embedding, w.pre_fc_norm_hidden, self.fc_in[:k], eps,
                self.draft_ids, live=live))

        def select():  # u1[b] = u[b * M + acc[b]] (a slot whose round emitted nothing: its row 0, junk)
            self.b.k_samp.gather_rows(self.acc[:k], u, u1, step=M)

        # each slot's rows base..base+M-1 from (hidden_j, y_j); its row acc drafts d_1
        first = ("input", lambda: ks.mtp_input(self.y[:k].reshape(-1), w.embed, self.hn[:R],
                                               w.pre_fc_norm_embedding, w.pre_fc_norm_hidden, self.fc_in[:R], eps))
        steps = head(u, self.fc_in[:R], self.base[:k], M, first, self._norm_once(R, k))
        out = [Launch("draft_" + grp, None, fn) for grp, fn in steps + [lm_head()]]
        for j in range(1, M - 1):  # chained: (g, d_j) at row base + acc + j drafts d_{j+1}
            steps = head(u1, self.fc_in[:k], self.dpos[:k], 1, pick_input(j)) + [lm_head()]
            out += [Launch("chain_" + grp, None, fn) for grp, fn in steps]
        out.append(Launch(("chain_" if M > 2 else "draft_") + "pick", None,
                          lambda: ks.draft_pick(*words, M - 1, self.draft_ids, live=live)))
        return out

    def launch(self, k: int | None = None) -> None:
        """Enqueue one round over slots 0..k-1 (default: all)."""
        with self.b.k_common.launch_options(self.b.pdl):
            for s in self.plan(k):
                s.run()
        if self.b.control == "pinned-copy":  # the rings reach the host by copy nodes (gpu/control.py)
            self.ring_host.copy_(self.ring, non_blocking=True)
            self.rounds_host.copy_(self.rounds, non_blocking=True)


@dataclass(eq=False)
class _Request:
    slot: int
    loop: DecodeLoop
    state: object  # its slot's DecodeState
    spec: object  # its slot's Speculator (the round histogram, `on_round`)
    need: int  # tokens it may still take (max_tokens and the context)
    got: int = 0  # tokens read
    pending: int = 0  # rounds enqueued with it whose record is not read yet
    placeholder: bool = False  # its first round's drafts are not the head's (not an acceptance sample)


class BatchRoundRunner(SlotRunner):
    """The batched round graph over a `BatchRoundDecoder` and the host side of its slots: `join`, `step`,
    `leave` (gpu/batch_runner.py's contract; one step is one round, 1..M tokens per request).

    The host mirrors each slot's device counters: the rounds enqueued with the slot live (the round
    counter after them) and the tokens its rounds emitted (the step counter, learned from each round
    record). Records of rounds still in flight when a request leaves are read before its slot's
    next request joins, so the mirrors stay exact."""

    least = 1  # one slot's round is M rows
    what = "batched round"

    def __init__(self, decoder: BatchRoundDecoder, speculators: list, timeout_s: float = 60.0):
        super().__init__(decoder, timeout_s)
        if len(speculators) != self.n:
            raise EngineError(f"{self.n} slots need {self.n} speculators, got {len(speculators)}")
        self.speculators = speculators
        self._rounds = [int(x) for x in decoder.round.tolist()]  # enqueued rounds per slot (device counter after)
        self._read = list(self._rounds)  # rounds whose record the host read, per slot
        self._steps = [int(x) for x in decoder.step.tolist()]  # tokens emitted per slot, as read
        self._inflight: deque[list[tuple[int, int, _Request]]] = deque()  # per replay: (slot, round, request)

    @property
    def M(self) -> int:
        return self.d.M

    def capture(self) -> None:
        """Compile and capture the round graphs (CUDA; on the CPU each replay runs the launches in order).
        The warm-up round runs with no slot live: no state, counter or ring changes."""
        d = self.d
        self._capture((d.step, d.round, d.tok, d.pos), ())

    def _set_live(self, want: list[bool], force: bool = False) -> None:
        M = self.M
        for b in range(self.n):  # the rows' words (the MoE experts') with the slots'
            if force or want[b] != self._live[b]:
                self.d.row_live[b * M:(b + 1) * M].fill_(int(want[b]))
        super()._set_live(want, force)

    # ---- requests ------------------------------------------------------------------------------------
    def join(self, slot: int, first_token: int, params) -> str | None:
        """Start a request in `slot` (its state loaded, token N = `first_token`): it takes part from the
        next round on. The slot's Speculator says what the head knows of the context (spec/speculative.py
        `take_context`): with the prompt's last hidden state the first round verifies the head's drafts,
        else placeholders (exact either way). Returns None, or the finish reason when the request ends
        before any token. Greedy without logprobs only."""
        d = self.d
        st = self._check_join(slot, first_token, params)
        spec = self.speculators[slot]
        self._drain(slot)
        rows, ctx_hidden = spec.take_context(st.seq_len)
        started = self._start_loop(st, first_token, params)
        if isinstance(started, str):
            return started
        loop, need = started
        drafts = None
        if not rows:  # the head's context begins at the node's first decoded position
            d.draft_start[slot].fill_(st.seq_len)
        elif ctx_hidden is not None:
            drafts = spec.first_drafts(ctx_hidden, first_token, st.seq_len)
        d.tok[slot, 0].fill_(first_token)
        if drafts is not None:
            d.tok[slot, 1:].copy_(drafts)
        else:
            d.tok[slot, 1:].fill_(first_token)
        d.pos[slot].fill_(st.seq_len)
        if d.forced is not None:  # this request's schedule, from its next round on
            k = min(need, SYNTHETIC_ROUNDS)
            counts = spec.synthetic.draws(k)
            if drafts is None:
                counts[0] = 0  # placeholder drafts are not the head's: that round accepts none
            at = (self._rounds[slot] + torch.arange(k, device=d.forced.device)) % SYNTHETIC_ROUNDS
            d.forced[slot].index_copy_(0, at, torch.tensor(counts, dtype=torch.int64, device=d.forced.device))
        self.requests[slot] = _Request(slot, loop, st, spec, need, placeholder=drafts is None)
        return None

    def _drain(self, slot: int) -> None:
        """Read the records of `slot`'s rounds still in flight (its previous request's)."""
        while self._read[slot] < self._rounds[slot]:
            self._read_round(slot, self._read[slot] + 1)

    def _read_round(self, slot: int, rnd: int) -> list[int]:
        """Round `rnd` of `slot`: its tokens, read from the slot's ring column; the mirrors advance."""
        d = self.d
        n = wait_record(d.rounds_host[:, slot], rnd, self.timeout_s, f"slot {slot}: speculative round")
        toks = []
        for j in range(n):
            s = self._steps[slot] + j + 1
            tv = int(d.ring_host[(s - 1) % RING, slot])
            if tv >> 32 != s:
                raise EngineError(f"slot {slot}: speculative round {rnd}: token of step {s} missing from the ring")
            toks.append(tv & 0xFFFFFFFF)
        self._steps[slot] += n
        self._read[slot] = rnd
        return toks

    def step(self) -> list[SlotEvent]:
        """Read the oldest round in flight (enqueuing one first when none is) after enqueuing the next, and
        return a `SlotEvent` per token it gave each request still in its slot (in order); a request that
        ends has left when this returns. [] when no slot is live."""
        if not self._inflight:
            self._enqueue()
        if not self._inflight:
            return []
        self._enqueue()  # round k + 1 in flight before we read round k
        events = []
        for slot, rnd, r in self._inflight.popleft():
            if self._read[slot] >= rnd:
                continue  # drained at a join
            toks = self._read_round(slot, rnd)
            r.pending -= 1
            if self.requests[slot] is not r:
                continue
            r.state.seq_len += len(toks)
            if r.placeholder:
                r.placeholder = False
            else:
                r.spec.rounds[len(toks)] += 1
                if r.spec.on_round is not None:
                    r.spec.on_round(len(toks))
            for tok in toks:
                r.got += 1
                end = r.loop.emit(tok)
                if not end and r.got >= r.need:
                    r.loop.end()  # its room is used up (a full context): "length"
                    end = True
                events.append(SlotEvent(slot, tok, r.loop.finish_reason if end else None))
                if end:
                    self.leave(slot)
                    break
        return events

    # ---- replays -------------------------------------------------------------------------------------
    def _enqueue(self) -> None:
        """Enqueue one round over the requests that may still take a token (each round in flight gives
        at least one): none, nothing."""
        reqs = [r for r in self.requests if r is not None and r.got + r.pending < r.need]
        if not reqs:
            return
        self._replay([r.slot for r in reqs])
        entry = []
        for r in reqs:
            r.pending += 1
            self._rounds[r.slot] += 1
            entry.append((r.slot, self._rounds[r.slot], r))
        self._inflight.append(entry)
