"""MTP speculative decoding, eager (docs/NODE.md, "Speculative decoding").

One round with M = num_speculative_tokens + 1 verify positions, committed length n, pending token t
(the last emitted, not yet run) and drafts d_1..d_{M-1}:

1. verify: the target runs [t, d_1, ..., d_{M-1}] at positions n..n+M-1 in one pass
   (`Model.verify`), giving logits L_0..L_{M-1} and final-normed hidden states;
2. accept (`accept_greedy` / `accept_sampled`): a = the drafts accepted, the round emits a + 1 tokens
   (out[0..a]: the accepted drafts, then the target's own token at a);
3. commit (`Model.commit`): the GDN state after position n+a becomes live, position += a + 1;
4. draft the next round: the MTP head runs rows n..n+M-1 with (hidden_j, out_j) (rows past a are
   junk that later rows overwrite and no valid row attends to), its row a drafts d'_1, then M - 2
   chained steps one row each (`Drafter.forward`).

Every step has fixed shapes and reads positions / the accepted count from device tensors, so a round
can be captured whole (the GPU path; not built). The host reads `out` and `a` to emit tokens.

Exactness does not depend on the drafts: greedy emits the target's argmax at every position;
sampling is the standard speculative (rejection) sampler (Leviathan et al. 2023, Chen et al. 2023):
draft d ~ q, accepted with probability min(1, p(d) / q(d)), else the token is drawn from
norm(max(0, p - q)); all accepted: a bonus token from the last p. p and q are the distributions the
plain sampler uses (temperature, top-k, top-p: `sampling.sampling_probs`), so each emitted token
is distributed exactly as plain sampling's. The random stream differs from the plain sampler's.

Where the drafter's context comes from: `Engine.prefill` runs the head over the prompt (the full
context vLLM's proposer would have); after a hand-off (`import_state`) from a speculating prefill
vLLM, its MTP cache's rows 0..N-1 (`import_context` without the hidden state): the first step is a
plain one, the drafts after it see the whole prompt; from any other prefill the head has none, so
the first step is a plain one and the head's context starts at the node's first decoded position
(rows before it masked) - exact either way, only acceptance differs.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from nexrt_vllm.engine.decode_loop import DecodeLoop
from nexrt_vllm.engine.model import Model, VerifyScratch
from nexrt_vllm.engine.sampling import Sampled, Sampler, SamplingParams, sampling_probs, token_logprobs
from nexrt_vllm.engine.spec.mtp import Drafter


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, V], drafts [M-1] -> (a int64 [1], out [M]): out[j] = argmax L_j, and since the
    accepted drafts equal it, out[0..a] is the round's tokens."""
    y = torch.argmax(logits, dim=-1)
    a = torch.cumprod((drafts == y[:-1]).long(), dim=0).sum().reshape(1)
    return a, y


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """p [M, V] target distributions, q [M-1, V] the draft distributions the drafts were drawn
    from, drafts [M-1] -> (a int64 [1], out [M]) with out[0..a] the round's tokens. Fixed work per
    round (M-1 uniforms, M categorical draws) whatever is accepted."""
    M = p.shape[0]
    u = torch.rand(M - 1, generator=generator, device=p.device)
    pd = p[:-1].gather(1, drafts[:, None])[:, 0]
    qd = q.gather(1, drafts[:, None])[:, 0]
    accept = u * qd < pd  # u < p(d) / q(d); q(d) > 0 for a drawn d
    a = torch.cumprod(accept.long(), dim=0).sum().reshape(1)
    residual = (p[:-1] - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual, but then the draft is always accepted: any row will do
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:-1])
    fresh = torch.cat((torch.multinomial(residual, 1, generator=generator)[:, 0],
                       torch.multinomial(p[-1:], 1, generator=generator)[:, 0]))
    j = torch.arange(M, device=p.device)
    out = torch.where(j < a, torch.cat((drafts, drafts[:1])), fresh)
    return a, out


def accept_synthetic(k: int, tokens: torch.Tensor, target: torch.Tensor, generator: torch.Generator | None,
                     greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A round with `k` drafts accepted by a pinned schedule (engine/spec/synthetic.py): out[0..k-1] are the
    drafts tokens[1..k], out[k] the target's token after them (argmax of logits `target[k]` when greedy,
    else drawn from the distribution `target[k]`). Returns (a int64 [1], out [M])."""
    nxt = (torch.argmax(target[k]) if greedy else torch.multinomial(target[k:k + 1], 1, generator=generator)[0, 0])
    out = torch.cat((tokens[1:], tokens[:1]))
    out[k] = nxt
    return torch.full((1,), k, dtype=torch.long, device=tokens.device), out


class Speculator:
    """Drafter + verify scratch of one engine; `rounds[k]` counts verify rounds that emitted k tokens
    (1..M); `on_round(k)` (optional) is called after each. `synthetic` (a SyntheticAcceptance, None by
    default): benchmark mode, every full round accepts the drafts the schedule says (accept_synthetic)."""

    def __init__(self, model: Model, drafter: Drafter, num_speculative_tokens: int):
        self.model, self.drafter = model, drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.M = num_speculative_tokens + 1
        self.scratch = VerifyScratch(model.config, self.M, model.dtype, model.device)
        self.rounds = [0] * (self.M + 1)
        self.on_round = None
        self.synthetic = None
        self.buffered = 0  # tokens of the current round `steps` holds back, yielded before the next round
        self._ctx_len, self._ctx_hidden = -1, None

    # ---- drafter context ----------------------------------------------------------------------
    def prefill_context(self, hidden: torch.Tensor, ids: torch.Tensor) -> None:
        """After a prefill of `ids` with final-normed hidden rows [T, H]: the head's rows 0..T-2 and
        the last hidden state, so the stream that follows drafts with the full prompt context."""
        self.drafter.prefill(hidden[:-1], ids[1:])
        self._ctx_len, self._ctx_hidden = ids.shape[0], hidden[-1:].clone()

    def drop_context(self) -> None:
        self._ctx_len, self._ctx_hidden = -1, None

    def take_context(self, seq_len: int) -> tuple[bool, torch.Tensor | None]:
        """What a stream from a state of `seq_len` tokens has of the armed context, which it disarms (one
        stream per prefill): whether the head's rows of the prompt are armed (0..N-2 or 0..N-1), and the
        target's last hidden state [1, H] when the first round can draft at once (else None)."""
        rows = self._ctx_len == seq_len
        hidden = self._ctx_hidden if rows else None
        self.drop_context()
        return rows, hidden

    def first_drafts(self, hidden: torch.Tensor, first_token: int, seq_len: int) -> torch.Tensor:
        """Greedy drafts [M-1] of a stream's first round from `take_context`'s hidden state: the head's
        row N-1 = (H_{N-1}, first_token) drafts d_1, then the chained steps."""
        dev = hidden.device
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        drafts, _ = self._draft(hidden, torch.tensor([first_token], device=dev),
                                torch.tensor([seq_len - 1], device=dev), zero, SamplingParams(), None)
        return drafts

    def export_context(self, first_token: int | None = None) -> dict[str, torch.Tensor] | None:
        """The armed full context (after a prefill of N tokens) as copies: {"hidden": [1, H] the
        target's last hidden state, "k", "v": the head's K/V rows 0..N-2}; with `first_token`,
        {"k", "v": rows 0..N-1}, row N-1 the head on (H_{N-1}, first_token) - what a speculating
        prefill vLLM's MTP cache ships (`import_context` takes both). None when no context is armed."""
        if self._ctx_hidden is None:
            return None
        d, n = self.drafter, self._ctx_len - 1
        if first_token is None:
            return {"hidden": self._ctx_hidden.clone(), "k": d.k[:, :n].clone(), "v": d.v[:, :n].clone()}
        dev = d.k.device
        d.forward(self._ctx_hidden, torch.tensor([first_token], device=dev), torch.tensor([n], device=dev))
        return {"k": d.k[:, :n + 1].clone(), "v": d.v[:, :n + 1].clone()}

    def import_context(self, seq_len: int, ctx: dict[str, torch.Tensor]) -> None:
        """Arm a context for a state of `seq_len` tokens (call after import_state): {"hidden", "k",
        "v" of rows 0..N-2} (export_context: the first round drafts at once), or {"k", "v" of rows
        0..N-1} without the hidden state (what a speculating prefill vLLM's MTP cache holds: its row
        N-1 is (H_{N-1}, the first token)): the first step is a plain one, the drafts after it
        attend to every row."""
        from nexrt_vllm.engine.errors import StateError

        d = self.drafter
        n = seq_len - 1 if "hidden" in ctx else seq_len
        want = {"k": (d.k.shape[0], n, d.k.shape[2]), "v": (d.k.shape[0], n, d.k.shape[2])}
        if "hidden" in ctx:
            want["hidden"] = (1, self.model.config.hidden_size)
        bad = [f"{k}: {tuple(ctx[k].shape) if k in ctx else None}, expected {s}" for k, s in want.items()
               if k not in ctx or tuple(ctx[k].shape) != s]
        if bad:
            raise StateError("MTP context does not match: " + "; ".join(bad))
        d.k[:, :n].copy_(ctx["k"])
        d.v[:, :n].copy_(ctx["v"])
        d.start.zero_()
        self._ctx_len = seq_len
        self._ctx_hidden = ctx["hidden"].to(d.k.dtype).clone() if "hidden" in ctx else None

    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen):
        """Draft token(s) from head logits [R, V]: argmax when greedy, else drawn from q (returned)."""
        if params.greedy:
            return torch.argmax(logits, dim=-1), None
        q = sampling_probs(logits, params.temperature, params.top_k, params.top_p)
        return torch.multinomial(q, 1, generator=gen)[:, 0], q

    def _draft(self, hidden: torch.Tensor, tokens: torch.Tensor, base: torch.Tensor, a: torch.Tensor,
               params: SamplingParams, gen):
        """Head rows base..base+T-1 with (hidden, tokens); row a drafts d_1, then M - 2 chained steps.
        Returns (drafts [M-1], q [M-1, V] or None)."""
        T = tokens.shape[0]
        g, lg = self.drafter.forward(hidden, tokens, base + torch.arange(T, device=base.device), row=a)
        d, q = self._pick(lg, params, gen)
        drafts, qs = [d], [q]
        for k in range(1, self.M - 1):
            g, lg = self.drafter.forward(g, d, base + a + k)
            d, q = self._pick(lg, params, gen)
            drafts.append(d)
            qs.append(q)
        return torch.cat(drafts), (None if params.greedy else torch.cat(qs))

    # ---- the decode loop ------------------------------------------------------------------------
    def steps(self, engine, first_token: int, params: SamplingParams, loop: DecodeLoop) -> Iterator[Sampled]:
        """Engine.steps' contract (no grammar), decided by `loop` (decode_loop.py): tokens after
        `first_token`, stop/EOS yielded, at most max_tokens - 1, until the context is full. After a
        stop, state.seq_len may count accepted positions past the stop token (their tokens are
        discarded)."""
        self.buffered = 0
        try:
            yield from self._steps(engine, first_token, params, loop)
        finally:
            self.buffered = 0

    def _steps(self, engine, first_token: int, params: SamplingParams, loop: DecodeLoop) -> Iterator[Sampled]:
        model, state, M, dev = self.model, engine.state, self.M, engine.device
        gen = Sampler(params, dev).generator  # seeded as the plain sampler's (None when greedy)
        rows, ctx_hidden = self.take_context(state.seq_len)
        full = ctx_hidden is not None
        if not loop.start(first_token):
            return
        drafts = q = None
        pending = torch.tensor([first_token], device=dev)  # the next round's first token, on the device
        if full and state.seq_len + M <= engine.max_seq_len:
            # the head's row N-1 (H_{N-1}, first_token) drafts the first round
            base = state.position - 1
            drafts, q = self._draft(ctx_hidden, pending, base, torch.zeros(1, dtype=torch.long, device=dev),
                                    params, gen)
        while loop.room(state) > 0:
            T = M if drafts is not None else 1
            tokens = pending if drafts is None else torch.cat((pending, drafts))
            base = state.position.clone()
            logits, hidden = model.verify(tokens, state, self.scratch)
            if self.synthetic is not None and T == M:
                target = logits if params.greedy else sampling_probs(logits, params.temperature, params.top_k,
                                                                     params.top_p)
                a, out = accept_synthetic(self.synthetic.draw(), tokens, target, gen, params.greedy)
            elif params.greedy:
                a, out = accept_greedy(logits, tokens[1:])
            else:
                p = sampling_probs(logits, params.temperature, params.top_k, params.top_p)
                if T == 1:
                    a, out = torch.zeros(1, dtype=torch.long, device=dev), torch.multinomial(p, 1, generator=gen)[:, 0]
                else:
                    a, out = accept_sampled(p, q, tokens[1:], gen)
            model.commit(state, self.scratch, a, T)
            n_acc = int(a) + 1
            state.seq_len += n_acc
            if T == M:
                self.rounds[n_acc] += 1
                if self.on_round is not None:
                    self.on_round(n_acc)
            emitted = out[:n_acc].tolist()
            for j, tok in enumerate(emitted):
                self.buffered = n_acc - 1 - j
                if params.logprobs is None:
                    yield Sampled(tok)
                else:
                    yield Sampled(tok, *token_logprobs(logits[j], tok, params.logprobs))
                if loop.emit(tok):
                    return
            pending = out.index_select(0, a)
            drafts = q = None
            if state.seq_len + M <= engine.max_seq_len:
                if T == 1 and not full:
                    if not rows:  # the head's context begins at the node's first position
                        self.drafter.start.copy_(base)
                    full = True
                drafts, q = self._draft(hidden, out, base, a, params, gen)
        loop.end()
