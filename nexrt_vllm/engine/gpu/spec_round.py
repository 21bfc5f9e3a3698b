"""MTP speculative decoding on the GPU path: one captured CUDA graph per round.

A round is the eager round of engine/spec/speculative.py (greedy) as fused Triton launches, with no
host value in it:

1. verify: the target runs tokens [t, d_1 .. d_{M-1}] at positions pos..pos+M-1 in one pass. Every
   projection is an M-row GEMV (each weight tile read once for the M rows); GDN layers run the M
   tokens in order from the live state, which they leave untouched, keeping the conv inputs and the
   recurrent state after each position (`VerifyScratch`); attention writes the M K/V rows and
   attends causally among them; MoE routes the M rows in one launch and runs all M rows' experts
   in the step's two launches with a row grid axis (an expert two rows choose is read by both at
   once, mostly from L2). The lm_head leaves per-row argmax partials and
   the final-normed hidden rows (the head's input).
2. accept (`kernels/spec.accept`): the target's tokens y, a = the leading drafts equal to them;
   y_0..y_a go to the control ring, then the round record; position += a + 1; y_a is the next
   round's first token.
3. commit: each GDN layer's state after position a becomes live (`gdn.gdn_commit`). K/V rows past
   the accepted ones stay written but lie at or past the position, so no later query sees them
   before they are overwritten.
4. draft the next round: the MTP head over rows base..base+M-1 with (hidden_j, y_j) (its own K/V
   rows; rows past a are junk that later rounds overwrite), its row a drafts d'_1, then M - 2
   chained single-row steps. With a draft vocabulary (engine/spec/draft_vocab.py) the head's lm_head
   reads only its rows: the first N rows, or a token map's rows gathered once into a contiguous
   copy, whose argmax index the pick maps back to the token id (cheaper drafts, exact output either
   way).

Weights: bf16, or an FP8 checkpoint's kept e4m3 + block scales (fp8.FP8Weight): the verify's M-row GEMVs and the
MoE experts read them as the step's fp8 kernels do (kernels/gemv_verify.py), the drafts run the step's kernels.

Exactness does not depend on the drafts (each emitted token is the target's argmax at its
position), so the first round of a stream may run with placeholder drafts. `SpecRunner` replays
the round graph, enqueuing round r + 1 before it reads round r, and finishes a stream whose context
has no room for M more positions with the plain step graph.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from nexrt_vllm.engine.errors import EngineError, NotBuiltError
from nexrt_vllm.engine.fp8 import take_rows
from nexrt_vllm.engine.gpu.batch_decoder import gated_out_proj
from nexrt_vllm.engine.gpu.control import RING, wait_record
from nexrt_vllm.engine.gpu.decoder import FusedDecoder, Launch, gdn_kw
from nexrt_vllm.engine.gpu.fusion import AttentionMixer, FusedLayer, GDNMixer, MoEFFN, concat_shared, fuse_ffn
from nexrt_vllm.engine.gpu.runner import GraphRunner, capture_graph
from nexrt_vllm.engine.gpu.tuning import RowsShape, gemv_kwargs, moe_kwargs
from nexrt_vllm.engine.spec.draft_vocab import check_draft_vocab
from nexrt_vllm.engine.state import AttentionState

# Pinned-acceptance counts held on the device; a stream longer than this many rounds reuses them in order.
SYNTHETIC_ROUNDS = 1 << 16


def draft_rows(lm_head: torch.Tensor, draft_vocab) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """The MTP head's lm_head for a draft vocabulary (engine/spec/draft_vocab.py): (rows it reads, the
    weight: the first N rows of the target's, or a token map's rows copied once, the map's ids (int32,
    what the pick maps the argmax through; None without a map))."""
    V = lm_head.shape[0]
    dv = check_draft_vocab(draft_vocab, V)
    if isinstance(dv, torch.Tensor):  # an FP8 lm_head's rows keep their scales (fp8.take_rows)
        return dv.numel(), take_rows(lm_head, dv.to(lm_head.device)), dv.to(device=lm_head.device, dtype=torch.int32)
    return V if dv is None else dv, lm_head, None


def fuse_head(w, k: torch.Tensor, v: torch.Tensor) -> FusedLayer:
    """The MTP head's layer (`w`: spec/mtp.py MTPWeights) fused as the target's layers are, its attention over
    the K/V cache k / v (the eager head's weights re-pointed at the fused ones)."""
    lw = w.layer
    w_qkv, (lw.mixer.q_proj, lw.mixer.k_proj, lw.mixer.v_proj) = concat_shared(
        [lw.mixer.q_proj, lw.mixer.k_proj, lw.mixer.v_proj])
    return FusedLayer(lw.input_norm, lw.post_norm,
                      AttentionMixer(w_qkv, lw.mixer.q_norm, lw.mixer.k_norm, lw.mixer.o_proj, AttentionState(k, v)),
                      fuse_ffn(lw.ffn))


class SpecDecoder:
    """Static buffers of the round over a `FusedDecoder`'s fused weights and a `Speculator`'s drafter;
    `plan()` is the round as launches, `launch()` enqueues it."""

    def __init__(self, fused: FusedDecoder, spec, draft_vocab=None):
        if fused.mode != "fused":
            raise EngineError("the speculative round needs the fused decoder (mode 'fused')")
        from nexrt_vllm.engine.kernels import spec as k_spec  # triton: GPU path only
        self.k_spec = k_spec
        f, c, M = fused, fused.cfg, spec.M
        if M > 8:  # the fold M-row GEMVs keep up to 8 rows in registers
            raise NotBuiltError(f"the graph path's speculative round verifies at most 8 positions "
                                f"(num_speculative_tokens <= 7), got {spec.num_speculative_tokens}")
        self.f, self.cfg, self.spec, self.M = f, c, spec, M
        self.drafter, self.scratch = spec.drafter, spec.scratch
        V = c.vocab_size
        dev, dt, H = f.state.device, f.state.dtype, c.hidden_size
        self.draft_vocab, self.draft_lm, self.draft_ids = draft_rows(self.drafter.w.lm_head, draft_vocab)
        z = lambda *s, d=dt: torch.zeros(*s, dtype=d, device=dev)  # noqa: E731
        i64 = torch.int64
        # control: verify tokens [t, d_1..], target tokens y, first position of the round, accepted count,
        # the head's chained-step token / position, the round counter
        self.tokens, self.y = z(M, d=i64), z(M, d=i64)
        self.base, self.acc, self.dtok, self.dpos, self.round = (z(1, d=i64) for _ in range(5))
        # verify activations, one row per position
        self.res, self.buf = z(M, H), z(M, f.buf.numel())
        self.rec_after = self.scratch.rec_after  # GDN layers: the state after each position (the eager scratch's)
        # Tuning.gdn_recommit: the verify keeps no state per position and each GDN layer its own verify rows,
        # which the commit runs again up to the accepted token (kernels/gdn.py Recommit: all layers, one launch)
        self.recommit = f.t.gdn_recommit
        self.gdn_buf = {i: z(M, f.buf.numel()) for i in c.gdn_layers} if self.recommit else {}
        self.commit_all = f.k_gdn.Recommit(
            [(self.gdn_buf[i], f.state.gdn(i).conv, f.state.gdn(i).rec, self.scratch.window(i, M),
              f.layers[i].mixer.a_log, f.layers[i].mixer.dt_bias) for i in c.gdn_layers], m=M,
            **gdn_kw(c, f.t)) if self.recommit and c.gdn_layers else None
        self.o, self.q = z(M, f.o.numel()), z(M, f.q.numel())
        self.attn_scratch = self._attn_scratch(M)
        if c.num_experts:
            self.act, self.router_logits = z(M, f.act.numel()), z(M, c.num_experts + 1)
            self.ids, self.wts = z(M, c.num_experts_per_tok, d=torch.int32), z(M, c.num_experts_per_tok, d=torch.float32)
            self.xn = z(M, H)
        if c.intermediate_size:
            self.act_dense = z(M, c.intermediate_size)
        self.logits = z(M, V, d=torch.float32)
        self.lm_rows = self._rows_rule(f.lm_head, f.t.lm_rows)
        self.n_part = -(-V // self.lm_rows["block_n"])
        self.pmax, self.pidx = z(M, self.n_part, d=torch.float32), z(M, self.n_part, d=torch.int32)
        self.hn = z(M, H)  # final-normed hidden rows (the lm_head's normed input)
        # the head: its layer fused like the target's, its attention over the drafter's own cache
        self.head = fuse_head(self.drafter.w, self.drafter.k, self.drafter.v)
        # the pass over the verified rows reads the head as stored (spec/mtp.py: with draft weights "fp8" the
        # chained single-row steps read the fp8 copy, the M-row pass not: the fp8 M-row GEMVs stream slower)
        self.head_rows = self.head if self.drafter.w.stored is None else \
            fuse_head(self.drafter.w.stored, self.drafter.k, self.drafter.v)
        self.fc_in, self.u = z(M, 2 * H), z(M, H)
        self.u1, self.g1 = z(1, H), z(1, H)
        self.dlogits = z(self.draft_vocab, d=torch.float32)
        # the head's lm_head launch: the target's shape rule, or the fp8 one for an fp8 draft head (spec/mtp.py)
        self.dlm_shape = dict(f.fixed_shape(self.draft_lm, f.t.lm, f.t.lm_fp8), n=self.draft_vocab)
        self.n_dpart = -(-self.draft_vocab // self.dlm_shape["block_n"])
        self.dpmax, self.dpidx = z(self.n_dpart, d=torch.float32), z(self.n_dpart, d=torch.int32)
        # the round record ring (round << 32 | tokens emitted), host-mapped beside the token ring
        self.rounds_host, self.rounds = f.mem.host["rounds"], f.mem.device["rounds"]
        # pinned acceptance (benchmarks): accepted-draft counts per round, refilled by the host per stream
        self.forced = z(SYNTHETIC_ROUNDS, d=i64) if spec.synthetic is not None else None

    def _attn_scratch(self, m: int) -> dict:
        c, t, dev = self.cfg, self.f.t, self.f.state.device
        sizes = self.f.k_attn.verify_scratch_sizes(m, c.num_heads, t.spec_attn_splits,
                                                   self.f.state.max_seq_len + self.M, c.head_dim)
        return {k: torch.zeros(n, dtype=torch.float32, device=dev) for k, n in sizes.items()}

    # ---- the round ---------------------------------------------------------------------------------
    def plan(self) -> list[Launch]:
        """The round's launches in order (group names: verify_* / accept / commit / draft_*)."""
        f, c, M, g = self.f, self.cfg, self.M, self.f.k_gemv
        verify = [("embed", None, lambda: f.k_samp.gather_rows(self.tokens, f.embed, self.res), None)]
        for i, L in enumerate(f.layers):
            mixer = self._gdn(i, L) if isinstance(L.mixer, GDNMixer) else self._attention(L, self.res, f.state.position,
                                                                                         None, M, f.model.rope_cos,
                                                                                         f.model.rope_sin)
            verify += [(grp, i, fn, stream) for grp, fn, stream in mixer + self._ffn(L, self.res, M)]
        verify.append(("lm_head+argmax", None, lambda **l2: g.gemv(
            self.res, f.lm_head, self.logits, pro=g.PRO_RMSNORM, epi=g.EPI_ARGMAX, norm_w=f.final_norm,
            aux0=self.pmax, aux1=self.pidx, xn_out=self.hn, eps=c.rms_norm_eps, m=M, **l2, **self.lm_rows),
            (f.lm_head, False)))
        # Tuning.rows_l2_prefetch: each M-row GEMV asks L2 for the next one's first weight bytes when done
        targets = f._l2_plan([e[3] for e in verify], f.t.rows_l2_prefetch)
        steps = [Launch("verify_" + grp, i, fn if t is None else functools.partial(fn, l2=t))
                 for (grp, i, fn, _), t in zip(verify, targets)]
        steps.append(Launch("accept", None, lambda: self.k_spec.accept(
            self.pmax, self.pidx, self.n_part, self.tokens, self.y, f.state.position, self.base, self.acc, f.step,
            self.round, f.ring, self.rounds, RING, self.forced)))
        if self.commit_all is not None:  # every GDN layer's commit in one launch
            steps.append(Launch("commit", None, lambda: self.commit_all(self.acc)))
        for i in c.gdn_layers if self.commit_all is None else ():
            steps.append(Launch("commit", i, lambda i=i: f.k_gdn.gdn_commit(
                f.state.gdn(i).conv, f.state.gdn(i).rec, self.scratch.window(i, M), self.rec_after[i], self.acc)))
        steps += self._draft()
        return steps

    def _rows_rule(self, w, shape: RowsShape) -> dict:
        """An M-row GEMV's launch keywords from a fixed shape (Tuning.lm_rows, gemv_gated_rows)."""
        return gemv_kwargs(self.f.t, w, shape)

    def _gdn(self, i: int, L: FusedLayer):
        c, g, t, m, eps, M, f = self.cfg, self.f.k_gemv, self.f.t, L.mixer, self.cfg.rms_norm_eps, self.M, self.f
        buf = self.gdn_buf.get(i, self.buf)  # Tuning.gdn_recommit: the layer's own rows, read again at the commit
        split = M >= t.gated_norm_rows  # the out_proj's norm in a launch of its own (batch_decoder.gated_out_proj)
        out_shape = f.gemv_shape(m.w_out, c.hidden_size, rows=True) if split else \
            self._rows_rule(m.w_out, t.gemv_gated_rows)
        out_proj = gated_out_proj(g, f.k_gdn, self.o, buf[:, c.conv_dim:c.conv_dim + c.value_dim], m, self.res, M,
                                  c.linear_value_head_dim, eps, split, out_shape)
        return [
            ("gdn_in_proj+conv", lambda **l2: g.gemv(
                self.res, m.w_in, buf, pro=g.PRO_RMSNORM, epi=g.EPI_CONV, norm_w=L.input_norm,
                aux0=m.state.conv, aux1=m.conv_w, window=self.scratch.window(i, M), eps=eps, conv_n=c.conv_dim,
                kc=c.conv_kernel, m=M, **l2,
                **f.gemv_shape(m.w_in, m.w_in.shape[0], prefetch=t.prefetch_conv, rows=True)), (m.w_in, False)),
            ("gdn_step", lambda: f.k_gdn.gdn_verify_step(
                buf, m.state.rec, None if self.recommit else self.rec_after[i], self.o, m.a_log, m.dt_bias, m=M,
                **gdn_kw(c, t), prefetch=t.prefetch > 0), None),
            *[(grp, fn, (m.w_out, False) if grp == "gdn_out_proj" else None) for grp, fn in out_proj]]

    def _attention(self, L: FusedLayer, x, pos, start, m: int, cos, sin):
        """A full-attention mixer over rows x[:m] at positions pos..pos+m-1 (the target's layers, or the
        head's over its own cache with `start`): (group, launch, its GEMV's (weight, SwiGLU halves) or None)."""
        c, g, t, a, eps, f = self.cfg, self.f.k_gemv, self.f.t, L.mixer, self.cfg.rms_norm_eps, self.f
        buf, q, o = self.buf[:m], self.q[:m], self.o[:m]
        return [
            ("attn_qkv_proj", lambda **l2: g.gemv(
                x, a.w_qkv, buf, pro=g.PRO_RMSNORM, norm_w=L.input_norm, eps=eps, m=m, **l2,
                **f.gemv_shape(a.w_qkv, a.w_qkv.shape[0], rows=m > 1)), (a.w_qkv, False)),
            ("attn_qknorm_rope_kvwrite", lambda: f.k_attn.qk_rope_cache(
                buf, q, a.state.k, a.state.v, a.q_norm, a.k_norm, cos, sin, pos, num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rotary_dim=c.rotary_dim, eps=eps, m=m), None),
            ("attn_splitk+combine", lambda: f.k_attn.attention_verify(
                q, a.state.k, a.state.v, pos, buf, o, **self.attn_scratch, m=m, num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, start=start, nsplit=t.spec_attn_splits,
                block=t.attn_block, min_per=t.attn_min_per, num_warps=t.attn_warps), None),
            ("attn_o_proj", lambda **l2: g.gemv(
                o, a.w_o, x, epi=g.EPI_RESIDUAL, m=m, **l2, **f.gemv_shape(a.w_o, c.hidden_size, rows=m > 1)),
             (a.w_o, False))]

    def _ffn(self, L: FusedLayer, x, m: int):
        c, g, t, ff, eps, f = self.cfg, self.f.k_gemv, self.f.t, L.ffn, self.cfg.rms_norm_eps, self.f
        if isinstance(ff, MoEFFN):
            # the router over the m rows in one launch; the experts of all m rows in the step's two launches
            # with a row grid axis (each program one row's slot: the step's one-row arithmetic; an expert
            # several rows chose is read by their programs at once, so mostly from L2)
            xs = (lambda b: b[:m]) if m > 1 else (lambda b: b[0])  # noqa: E731
            return [("moe_router", lambda: g.gemv(
                        x, ff.w_router, self.router_logits[:m], pro=g.PRO_RMSNORM, norm_w=L.post_norm, eps=eps,
                        xn_out=self.xn[:m], m=m, **f.fixed_shape(ff.w_router, t.gemv_router, t.gemv_router_fp8)),
                     None),
                    ("moe_experts", lambda: f.k_moe.moe_experts(
                        xs(self.xn), xs(x), xs(self.router_logits), ff.gate_up, ff.s_gate_up, ff.down, ff.s_down,
                        xs(self.act), xs(self.ids), xs(self.wts), **moe_kwargs(t, c, ff)), None)]
        return [
            ("mlp_gate_up+swiglu", lambda **l2: g.gemv(
                x, ff.w_gate_up, self.act_dense[:m], pro=g.PRO_RMSNORM, epi=g.EPI_SWIGLU, norm_w=L.post_norm,
                eps=eps, m=m, **l2, **f.gemv_shape(ff.w_gate_up, ff.w_gate_up.shape[0] // 2, rows=m > 1)),
             (ff.w_gate_up, True)),
            ("mlp_down", lambda **l2: g.gemv(
                self.act_dense[:m], ff.w_down, x, epi=g.EPI_RESIDUAL, m=m, **l2,
                **f.gemv_shape(ff.w_down, c.hidden_size, rows=m > 1)), (ff.w_down, False))]

    def _draft(self) -> list[Launch]:
        """The head's launches: groups draft_* (the M-row pass) and chain_* (each chained step, from the pick of
        the draft before it fused with its input, `draft_pick_input`; the last draft's pick ends the round)."""
        f, c, M, g, d, w = self.f, self.cfg, self.M, self.f.k_gemv, self.drafter, self.drafter.w
        eps, ks = c.rms_norm_eps, self.k_spec
        words = (self.dpmax, self.dpidx, self.n_dpart, self.tokens, self.dtok, self.base, self.acc, self.dpos)

        def head(x, fc_in, pos, m, first):
            fc_kw = f.gemv_shape(w.fc, c.hidden_size, rows=m > 1)
            steps = [first, ("fc", lambda: g.gemv(fc_in, w.fc, x, m=m, **fc_kw))]
            layer = self.head_rows if m > 1 else self.head
            steps += [(grp, fn) for grp, fn, _ in self._attention(layer, x, pos, d.start, m, d.rope_cos, d.rope_sin)]
            if m > 1:  # only row a goes on (the other rows' K/V are written): the MLP reads one row's weights
                steps.append(("select", lambda: f.k_samp.gather_rows(self.acc, self.u, self.u1)))
            return steps + [(grp, fn) for grp, fn, _ in self._ffn(self.head, self.u1, 1)]

        def lm_head():
            return ("lm_head+argmax", lambda: g.gemv(
                self.u1, self.draft_lm, self.dlogits, pro=g.PRO_RMSNORM, epi=g.EPI_ARGMAX, norm_w=w.norm,
                aux0=self.dpmax, aux1=self.dpidx, xn_out=self.g1, eps=eps, **self.dlm_shape))

        def pick_input(k):  # d_k, and the fc input of the chained step (g, d_k) that drafts d_{k+1}
            return ("pick+input", lambda: ks.draft_pick_input(
                *words, k, w.embed, self.g1, w.pre_fc_norm_embedding, w.pre_fc_norm_hidden, self.fc_in[:1], eps,
                self.draft_ids))

        # rows base..base+M-1 from (hidden_j, y_j); row a drafts d_1
        first = ("input", lambda: ks.mtp_input(self.y, w.embed, self.hn, w.pre_fc_norm_embedding,
                                               w.pre_fc_norm_hidden, self.fc_in, eps))
        steps = head(self.u, self.fc_in, self.base, M, first)
        out = [Launch("draft_" + grp, None, fn) for grp, fn in steps + [lm_head()]]
        for k in range(1, M - 1):  # chained: (g, d_k) at row base + a + k drafts d_{k+1}
            steps = head(self.u1, self.fc_in[:1], self.dpos, 1, pick_input(k)) + [lm_head()]
            out += [Launch("chain_" + grp, None, fn) for grp, fn in steps]
        out.append(Launch(("chain_" if M > 2 else "draft_") + "pick", None,
                          lambda: ks.draft_pick(*words, M - 1, self.draft_ids)))
        return out

    def launch(self) -> None:
        with self.f.launch_options():
            for s in self.plan():
                s.run()
        if self.f.control == "pinned-copy":  # the rings reach the host by copy nodes (gpu/control.py)
            self.f.ring_host.copy_(self.f.ring, non_blocking=True)
            self.rounds_host.copy_(self.rounds, non_blocking=True)


class SpecRunner:
    """The round graph over a `SpecDecoder` and the host loop that streams its tokens; the plain step
    graph (`GraphRunner`) finishes streams whose context has no room for another round."""

    def __init__(self, runner: GraphRunner, spec, draft_vocab=None):
        self.plain, self.spec = runner, spec
        self.d = SpecDecoder(runner.d, spec, draft_vocab)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.rounds_run = 0

    def _live(self) -> list[torch.Tensor]:
        d, f = self.d, self.d.f
        return ([f.state.position, f.step, d.tokens, d.round, self.spec.drafter.k, self.spec.drafter.v,
                 self.spec.drafter.start] + f.state.buffers())

    def capture(self) -> None:
        """Compile and capture the round graph (a warm-up round first; every tensor it mutates is restored)."""
        d, f = self.d, self.d.f
        if self.graph is not None or f.state.device.type != "cuda":
            return
        self.graph = capture_graph(d.launch, self._live(), (f.ring, f.ring_host, d.rounds, d.rounds_host))

    def _replay(self) -> None:
        if self.graph is None:  # CPU (the interpreter tests): the round's launches, run in order
            self.d.launch()
        else:
            self.graph.replay()

    def stream(self, first_token: int, max_new_tokens: int, stop_token_ids=(), *, drafts=None,
               timeout_s: float = 60.0) -> Iterator[int]:
        """Greedy tokens after `first_token` (at position state.seq_len) until a stop id (yielded) or
        `max_new_tokens`. `drafts` [M-1] (device): the first round's drafts (else placeholders). At
        most max_new_tokens; a full context ends the stream early only where the plain step graph
        also has no room. Afterwards state.seq_len counts every position the rounds that ran
        committed (also the in-flight round past a stop; its tokens are discarded). The request's
        stop / length rules and finish reason are its caller's (`Engine`, decode_loop.py)."""
        d, f, st, M = self.d, self.d.f, self.d.f.state, self.M
        if max_new_tokens <= 0:
            return
        stops = set(stop_token_ids)
        if d.forced is not None:  # this stream's schedule, from the next round on (a round emits >= 1 token)
            n = min(max_new_tokens, SYNTHETIC_ROUNDS)
            counts = self.spec.synthetic.draws(n)
            if drafts is None:
                counts[0] = 0  # placeholder drafts are not the head's: that round accepts none
            at = (int(d.round.item()) + torch.arange(n, device=d.forced.device)) % SYNTHETIC_ROUNDS
            d.forced.index_copy_(0, at, torch.tensor(counts, dtype=torch.int64, device=d.forced.device))
        d.tokens.fill_(first_token)
        if drafts is not None:
            d.tokens[1:].copy_(drafts)
        st.position.fill_(st.seq_len)
        step0, round0 = int(f.step.item()), int(d.round.item())
        ring, rounds = f.ring_host, d.rounds_host
        done, read, launched, pos = 0, 0, 0, st.seq_len  # pos: position after the rounds read
        placeholder = drafts is None  # the first round's drafts are not the head's: not an acceptance sample
        room = lambda ahead: pos + (ahead + 1) * M <= st.max_seq_len  # noqa: E731 - rounds in flight
        last = first_token
        try:
            if room(0):
                self._replay()
                launched = 1
            while done < max_new_tokens and read < launched:
                if room(launched - read) and done + (launched - read) < max_new_tokens:
                    self._replay()  # round r+1 in flight before we read round r
                    launched += 1
                want = round0 + read + 1
                n = wait_record(rounds, want, timeout_s, "speculative round")
                read += 1
                pos += n
                if not placeholder:
                    self.spec.rounds[n] += 1
                    if self.spec.on_round is not None:
                        self.spec.on_round(n)
                placeholder = False
                for j in range(n):
                    s = step0 + done + 1
                    tv = int(ring[(s - 1) % RING])
                    if tv >> 32 != s:
                        raise EngineError(f"speculative round {want}: token of step {s} missing from the ring")
                    last = tv & 0xFFFFFFFF
                    done += 1
                    yield last
                    if last in stops or done >= max_new_tokens:
                        return
                if read == launched and room(0) and done < max_new_tokens:
                    self._replay()
                    launched += 1
        finally:
            if st.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self.rounds_run += launched
            st.seq_len = int(st.position.item())
        # no room for another round: the plain step graph takes the rest from the last token
        rest = min(max_new_tokens - done, st.max_seq_len - st.seq_len)
        if rest > 0:
            for rec in self.plain.steps(last, rest, stop_token_ids=stops, timeout_s=timeout_s):
                yield rec.token
                if rec.token in stops:
                    return

    @property
    def M(self) -> int:
        return self.d.M
