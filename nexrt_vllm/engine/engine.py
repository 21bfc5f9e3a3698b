"""Engine: one model + one DecodeState, batch 1 (docs/ARCHITECTURE.md §1)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.decode_loop import DecodeLoop
from nexrt_vllm.engine.dtypes import MODEL_DTYPES, TORCH_DTYPES
from nexrt_vllm.engine.errors import ConfigError, EngineError, InputError, NotBuiltError, StateError
from nexrt_vllm.engine.model import Model
from nexrt_vllm.engine.sampling import Sampled, Sampler, SamplingParams, token_logprobs
from nexrt_vllm.engine.state import DecodeState, StackedStates
from nexrt_vllm.engine.weights import load_checkpoint, random_weights

_DTYPES = {name: TORCH_DTYPES[name] for name in MODEL_DTYPES}


def resolve_dtype(dtype, cfg: ModelConfig) -> torch.dtype:
    if dtype is None:
        return _DTYPES[cfg.dtype]
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.replace("torch.", ""), dtype)
    if dtype not in _DTYPES.values():
        raise ConfigError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return dtype


FP8_WEIGHTS = ("auto", "keep", "dequantize")


def keep_fp8(mode: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine keeps an FP8 checkpoint's projections in fp8 (`Engine.from_pretrained`)."""
    if mode not in FP8_WEIGHTS:
        raise ConfigError(f"fp8_weights must be one of {FP8_WEIGHTS}, got {mode!r}")
    if cfg.quantization is None or mode == "dequantize":
        return False
    return mode == "keep" or (device.type == "cuda" and dtype == torch.bfloat16)


class Engine:
    """Prefill, decode and sample for one request at a time.

    `finish_reason` is set when `generate` / `stream` end: "stop" (EOS, a stop id or the grammar's
    end) or "length" (max tokens or a full context), by the request's `DecodeLoop` (decode_loop.py).
    """

    def __init__(self, config: ModelConfig, model: Model, max_seq_len: int, state: DecodeState | None = None):
        self.config = config
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        # the model's config: a tensor-parallel shard's state holds only its heads (engine/tp.py)
        self.state = state if state is not None else DecodeState(model.config, max_seq_len, model.dtype, model.device)
        self.loop: DecodeLoop | None = None  # the last request's stop / length bookkeeping
        self.graph = None  # GPU graph path (use_graph); None: `stream` runs the eager decode loop
        self.speculative = None  # spec.speculative.Speculator (enable_speculative); None: one token per step
        self.spec_graph = None  # gpu.spec_round.SpecRunner: the speculative round on the graph path (fused + MTP)
        self.draft_vocab = None  # the head's lm_head rows on the graph path, as given (None: all; spec/draft_vocab.py)
        self.batch_graph = None  # gpu.batch_runner.BatchRunner: the batch step of `slots` (use_batch_graph)
        self._slot_engines: list[Engine] = []

    @property
    def finish_reason(self) -> str | None:
        """Why the last request's stream ended ("stop" | "length"); None before it ended."""
        return self.loop.finish_reason if self.loop is not None else None

    @property
    def weight_format(self) -> str:
        """"fp8" when projections are kept in block-scaled e4m3 (the GPU kernels read them), else the dtype."""
        from .fp8 import FP8Weight
        m = self.model
        ws = [m.lm_head] + [getattr(part, f) for L in m.layers for part in (L.mixer, L.ffn)
                            for f in getattr(part, "__dataclass_fields__", ())]
        if any(isinstance(w, FP8Weight) for w in ws):
            return "fp8"
        return str(self.dtype).removeprefix("torch.")

    @classmethod
    def from_pretrained(cls, path: str, device: str | torch.device = "cpu", dtype=None,
                        max_seq_len: int = 4096, progress: bool = True, fp8_weights: str = "auto") -> "Engine":
        """`fp8_weights` (FP8 checkpoints only): "keep" = the projections stay e4m3 + block scales
        (the GPU kernels read them natively, the eager ops dequantize them per use); "dequantize" =
        dequantized at load (the CPU oracle); "auto" = keep on CUDA with a bfloat16 engine (what the
        fused graph path runs), dequantize otherwise."""
        cfg = ModelConfig.from_pretrained(path)
        dt = resolve_dtype(dtype, cfg)
        tensors, mtp = load_checkpoint(path, cfg, dt, device, progress=progress,
                                       keep_fp8=keep_fp8(fp8_weights, cfg, torch.device(device), dt))
        return cls(cfg, Model(cfg, tensors, max_seq_len, mtp=mtp), max_seq_len)

    @classmethod
    def from_config(cls, config: ModelConfig | dict, device: str | torch.device = "cpu", dtype=None,
                    max_seq_len: int = 4096, seed: int = 0) -> "Engine":
        """Random weights (std 0.02) made directly on `device`: for benchmarks at real shapes. A config
        that declares MTP layers gets a random MTP head too (engine/spec/mtp.py), as its checkpoint would have."""
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
        dt = resolve_dtype(dtype, cfg)
        mtp = None
        if cfg.mtp_num_layers:
            from nexrt_vllm.engine.spec.mtp import random_mtp_tensors
            mtp = random_mtp_tensors(cfg, dt, device)
        return cls(cfg, Model(cfg, random_weights(cfg, dt, device, seed), max_seq_len, mtp=mtp), max_seq_len)

    @property
    def max_seq_len(self) -> int:
        return self.state.max_seq_len

    def slot(self) -> "Engine":
        """Another engine over this one's weights with its own DecodeState: one more request a node
        decodes alongside (node/batch.py, `--max-batch`), on the eager step. With speculative decoding it
        speculates too, with a Speculator of its own (drafter cache, verify scratch; the same settings,
        synthetic schedule and `on_round`)."""
        if self.graph is not None or self.batch_graph is not None:
            raise NotBuiltError("slot engines of their own run the eager step: not with the one-request graph "
                                "(the batch step's slots: use_batch_graph, slots)")
        eng = Engine(self.config, self.model, self.max_seq_len)
        if self.speculative is not None:
            eng.speculative, eng.draft_vocab = self._slot_speculator(), self.draft_vocab
        return eng

    def slots(self, n: int) -> list["Engine"]:
        """The engines of `n` request slots over these weights, this one first (node/batch.py): with the
        batch step (`use_batch_graph`) the ones whose states it steps, else `slot()`s."""
        if self.batch_graph is not None:
            if n != len(self._slot_engines):
                raise EngineError(f"the batch step has {len(self._slot_engines)} slots, not {n}")
            return list(self._slot_engines)
        return [self] + [self.slot() for _ in range(n - 1)]

    def use_batch_graph(self, n: int, tuning=None) -> None:
        """Decode up to `n` requests (2..8) in one captured CUDA graph per step (gpu.batch_runner.BatchRunner
        over gpu.batch_decoder.BatchDecoder; CUDA, bfloat16 weights): their states are stacked
        (state.StackedStates), this engine's becomes slot 0's and `slots(n)` gives every slot's
        engine. With speculative decoding (`enable_speculative` first) a step is one MTP round of
        every slot (gpu.batch_round.BatchRoundRunner; n x M verify rows, at most 32). Greedy requests
        without logprobs or grammar join the batch graph (node/batch.py); the others decode on their
        slot engine's eager loop (or eager round). Not with `use_graph`."""
        if self.device.type != "cuda":
            raise EngineError(f"the batch graph needs a CUDA device (engine is on {self.device})")
        runner = self.batch_runner(n, tuning)
        runner.capture()
        self.use_batch(runner)

    def batch_runner(self, n: int, tuning=None):
        """The batch graph's runner over `n` stacked slots of this engine's model, not captured (on the CPU
        its replays run the launches through the Triton interpreter, the tests' way in; `use_batch`
        then makes it this engine's): a BatchRunner, or with speculative decoding a BatchRoundRunner
        whose slots each have a Speculator over their head cache."""
        from nexrt_vllm.engine.gpu.batch_decoder import BatchDecoder  # triton: imported by the GPU path only
        from nexrt_vllm.engine.gpu.batch_runner import BatchRunner
        self._check_batch()
        spec = self.speculative
        states = StackedStates(self.model.config, n, self.max_seq_len, self.dtype, self.device,
                               pad_rows=spec.M if spec is not None else 0)
        batch = BatchDecoder(self.model, states, tuning)
        if spec is None:
            return BatchRunner(batch)
        from nexrt_vllm.engine.gpu.batch_round import BatchRoundDecoder, BatchRoundRunner
        # the batched round's head passes span the slots' rows: the head as stored (spec/mtp.py MTPWeights.rows)
        d = BatchRoundDecoder(batch, spec.drafter.w.rows, spec.num_speculative_tokens, self.draft_vocab,
                              synthetic=spec.synthetic is not None)
        return BatchRoundRunner(d, [self._slot_speculator(d.drafter_views(b)) for b in range(n)])

    def use_batch(self, runner) -> None:
        """Decode through `runner` (`batch_runner`'s, over this engine's model): this engine becomes slot
        0 (its state that slot's), `slots` gives the slot engines; with a BatchRoundRunner each slot
        engine speculates with its slot's Speculator."""
        self._check_batch()
        states = runner.d.states.states
        self.state = states[0]
        self._slot_engines = [self] + [Engine(self.config, self.model, self.max_seq_len, state=s) for s in states[1:]]
        for b, e in enumerate(self._slot_engines):
            e.batch_graph = runner
            if getattr(runner, "speculators", None) is not None:
                e.speculative, e.draft_vocab = runner.speculators[b], self.draft_vocab

    def _check_batch(self) -> None:
        if self.graph is not None or self.batch_graph is not None:
            raise NotBuiltError("the batch step is not built together with the one-request graph, and is set up "
                                "once")

    # ---- the two passes -------------------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise InputError(f"{what}: token ids must be ints in [0, {self.config.vocab_size}), got {bad[:8]}")

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Reset the state and run the prompt; returns the fp32 logits [vocab] after its last token."""
        ids = list(ids)
        if not ids:
            raise InputError("prompt is empty")
        if len(ids) > self.max_seq_len:
            raise InputError(f"prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len}")
        self._check_ids(ids, "prompt")
        self.state.reset()
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.speculative is None:
            logits = self.model.prefill(t, self.state)
        else:  # the MTP head sees the prompt too: the next stream drafts with the full context
            logits, hidden = self.model.prefill(t, self.state, hidden=True)
            self.speculative.prefill_context(hidden, t)
        self.state.set_seq_len(len(ids))
        return logits

    def decode_step(self, token: int) -> torch.Tensor:
        """Run `token` at position seq_len; seq_len += 1. Returns fp32 logits [vocab]."""
        self._check_ids([token], "decode_step")
        if self.state.seq_len == 0:
            raise StateError("decode_step before prefill/import_state: the state is empty")
        if self.state.seq_len >= self.max_seq_len:
            raise StateError(f"context is full ({self.max_seq_len} tokens)")
        logits = self.model.decode(torch.tensor([token], dtype=torch.long, device=self.device), self.state)
        self.state.seq_len += 1
        return logits

    # ---- GPU graph path (hook owned by the GPU path, docs/GPU.md) ------------------------------
    def use_graph(self, mode: str = "fused", tuning=None) -> None:
        """Make `stream` decode through one captured CUDA graph per token (gpu.runner.GraphRunner
        over gpu.decoder.FusedDecoder; CUDA + bfloat16 only, EngineError otherwise). Every variant
        (greedy and sampling, each plain / with logprobs / with a grammar mask / both) is captured
        here, at start-up, so no request pays for compilation or capture. mode "fused": the Triton
        kernels; "eager": this model's own ops in the graph (bit-equal tokens, slower). Prefill,
        decode_step and the hand-off stay on the eager path; so do grammar-constrained requests
        when the control memory could not be host-mapped (`graph.masks` False). With speculative
        decoding (mode "fused" only) the round graph is captured too (gpu.spec_round.SpecRunner):
        it serves greedy requests without logprobs; the others take the one-token graph. `tuning`: the
        fused kernels' launch shapes (gpu.tuning.Tuning; None: the defaults)."""
        if self.device.type != "cuda":
            raise EngineError(f"the graph path needs a CUDA device (engine is on {self.device})")
        if self.speculative is not None and mode != "fused":
            raise NotBuiltError(f"speculative decoding (MTP) on the CUDA graph path runs the fused kernels "
                                f"(graph mode 'fused'), not {mode!r}")
        if self.batch_graph is not None:
            raise NotBuiltError("this engine decodes through the batch step (use_batch_graph)")
        from nexrt_vllm.engine.gpu.decoder import FusedDecoder  # triton: imported by the GPU path only
        from nexrt_vllm.engine.gpu.runner import GraphRunner
        runner = GraphRunner(FusedDecoder(self.model, self.state, mode=mode, tuning=tuning))
        for sample, logprobs, mask in runner.VARIANTS:
            if runner.masks or not mask:
                runner.capture(sample, logprobs, mask)
        self.graph = runner
        if self.speculative is not None:
            self._capture_spec()

    def _capture_spec(self) -> None:
        from nexrt_vllm.engine.gpu.spec_round import SpecRunner
        spec = SpecRunner(self.graph, self.speculative, self.draft_vocab)
        spec.capture()
        self.spec_graph = spec

    # ---- speculative decoding (engine/spec/speculative.py) ----------------------------------------
    def enable_speculative(self, method: str = "mtp", num_speculative_tokens: int = 3,
                           draft_vocab=None, synthetic=None, draft_weights: str = "checkpoint") -> None:
        """Decode with the checkpoint's MTP head drafting `num_speculative_tokens` tokens per round,
        verified in one pass of M = num_speculative_tokens + 1 positions (greedy and sampled output
        distributed exactly as without; docs/NODE.md). ConfigError if the checkpoint has no MTP head
        or the method is unknown. Grammar-constrained requests keep the one-token loop. On the graph
        path (`use_graph("fused")`, before or after this) greedy requests run the captured round,
        whose head drafts from `draft_vocab` only: None = every id, an int N = ids 0..N-1, a token map
        = a 1-D sequence (or tensor) of distinct ids, e.g. the most frequent ones (spec/draft_vocab.py;
        exact output either way, only acceptance depends on it). `draft_weights` (spec/mtp.py DRAFT_WEIGHTS):
        "checkpoint" = the head as stored, "fp8" = its projections and a copy of the lm_head quantized at load
        (drafts read about half the bytes; exact output either way).
        `synthetic` (engine.spec.synthetic.SyntheticAcceptance, benchmarks only): every round accepts the
        drafts its schedule says instead of the matching ones - output is then no longer the target's."""
        from nexrt_vllm.engine.spec.draft_vocab import check_draft_vocab
        from nexrt_vllm.engine.spec.mtp import mtp_weights

        if method != "mtp":
            raise ConfigError(f"unknown speculative method {method!r}; supported: 'mtp'")
        if self.batch_graph is not None:
            raise NotBuiltError("enable speculative decoding before the batch graph (use_batch_graph) is built")
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or not 1 <= num_speculative_tokens <= 15:
            raise ConfigError(f"num_speculative_tokens must be an int in [1, 15], got {num_speculative_tokens!r}")
        check_draft_vocab(draft_vocab, self.config.vocab_size)
        if self.graph is not None and self.graph.d.mode != "fused":
            raise NotBuiltError("speculative decoding (MTP) on the CUDA graph path runs the fused kernels "
                                f"(graph mode 'fused'), not {self.graph.d.mode!r}")
        if synthetic is not None and synthetic.num_drafts != num_speculative_tokens:
            raise ConfigError(f"the synthetic acceptance schedule has {synthetic.num_drafts} rates, one per draft; "
                              f"num_speculative_tokens is {num_speculative_tokens}")
        # the head in the format asked for (not an earlier call's), which the slots' speculators then share (a MoE
        # head's experts are stacked once, here); mtp_weights refuses an unknown format before anything changes
        w = mtp_weights(self.config, self.model.mtp, self.model.embed, self.model.lm_head, draft_weights)
        self.speculative = self._new_speculator(num_speculative_tokens, w)
        self.speculative.synthetic = synthetic
        self.draft_vocab = draft_vocab
        if self.graph is not None:
            self._capture_spec()

    def _slot_speculator(self, over=None):
        """A Speculator for another request slot: this engine's settings (drafts, synthetic schedule,
        `on_round`), a drafter cache of its own (or `over`, as `_new_speculator`)."""
        s = self._new_speculator(self.speculative.num_speculative_tokens, self.speculative.drafter.w, over)
        s.synthetic, s.on_round = self.speculative.synthetic, self.speculative.on_round
        return s

    def _new_speculator(self, num_speculative_tokens: int, w, over=None):
        """A Speculator over this engine's model drafting with the head `w` (spec/mtp.py MTPWeights), with a
        drafter cache (or `over`: Drafter's) and verify scratch of its own."""
        from nexrt_vllm.engine.spec.mtp import Drafter
        from nexrt_vllm.engine.spec.speculative import Speculator

        drafter = Drafter(self.model.config, w, self.max_seq_len, extra=num_speculative_tokens + 1, over=over)
        return Speculator(self.model, drafter, num_speculative_tokens)

    # ---- generation -----------------------------------------------------------------------------
    def stream(self, first_token: int, params: SamplingParams, constraint=None) -> Iterator[int]:
        """Continue a request whose state holds N tokens and whose token N is `first_token` (already
        emitted by the caller). Yields the following tokens until EOS / a stop id (yielded too) /
        max_tokens (which counts first_token, so at most max_tokens-1 are yielded) / a full context
        / the grammar's end (decode_loop.py). The token ids of `steps`."""
        it = self.steps(first_token, params, constraint)
        return (s.token for s in it)

    def steps(self, first_token: int, params: SamplingParams, constraint=None) -> Iterator[Sampled]:
        """`stream` with each token's logprobs (`params.logprobs`), as `Sampled` records.

        `constraint` (engine.structured.Constraint, fresh for the request): the tokens obey its
        grammar. It accepts `first_token` first (vLLM sampled that one under the same grammar;
        InputError if the grammar refuses it), each step's logits are masked with its bitmask
        before sampling and before the logprobs, and generation ends ("stop") once it terminates.

        On the graph path sampled tokens come from the device sampler (same distribution, another
        random stream), and after a stop state.seq_len also counts the replay or round that ran past
        it (its tokens discarded)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_ids([first_token], "first_token")
        if self.state.seq_len == 0:
            raise StateError("stream before prefill/import_state: the state is empty")
        if constraint is not None:
            try:
                constraint.accept(first_token)
            except EngineError as e:
                raise InputError(f"first_token: {e}") from None
        loop = self.loop = DecodeLoop(params, self.config.eos_token_ids, constraint)
        if self.graph is not None and (constraint is None or self.graph.masks):
            if self.spec_graph is not None and constraint is None and params.greedy and params.logprobs is None:
                return self._spec_graph_stream(first_token, loop)
            return self.graph.stream_steps(first_token, params, constraint, loop)
        if self.speculative is not None and constraint is None:
            return self.speculative.steps(self, first_token, params, loop)
        return self._stream(first_token, params, constraint, loop)  # checked above, at call time; decoding is lazy

    def _spec_graph_stream(self, first_token: int, loop: DecodeLoop) -> Iterator[Sampled]:
        # The eager Speculator's drafter context (spec/speculative.py), rounds from the graph.
        spec, st = self.speculative, self.state
        rows, ctx_hidden = spec.take_context(st.seq_len)
        if not loop.start(first_token):
            return
        drafts = None
        if not rows:  # the head's context begins at the node's first decoded position
            spec.drafter.start.fill_(st.seq_len)
        elif ctx_hidden is not None and st.seq_len + spec.M <= self.max_seq_len:
            drafts = spec.first_drafts(ctx_hidden, first_token, st.seq_len)
        # the round graph ends by itself at a stop id or after `room` tokens
        for tok in self.spec_graph.stream(first_token, loop.room(st), loop.stop_ids, drafts=drafts):
            yield Sampled(tok)
            loop.emit(tok)
        loop.end()

    def _stream(self, first_token: int, params: SamplingParams, constraint, loop: DecodeLoop) -> Iterator[Sampled]:
        sampler = Sampler(params, self.device)
        token = first_token
        if not loop.start(token):
            return
        while loop.room(self.state) > 0:
            logits = self.decode_step(token)
            if constraint is not None:
                from nexrt_vllm.engine.structured import apply_mask
                logits = apply_mask(logits, constraint.fill())
            token = sampler(logits)
            if params.logprobs is None:
                yield Sampled(token)
            else:
                yield Sampled(token, *token_logprobs(logits, token, params.logprobs))
            if constraint is not None:
                constraint.accept(token)
            if loop.emit(token):
                return
        loop.end()

    def generate(self, prompt_token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
                 stop_token_ids: Sequence[int] | None = None) -> list[int]:
        """Prefill + sample + decode; returns the new tokens only (stop/EOS token included).

        The first token is drawn with a sampler seeded by `seed`; the rest come from `stream`, which
        seeds its own - exactly what a hand-off does, so generate == prefill + first token + stream."""
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, ignore_eos=ignore_eos, stop_token_ids=tuple(stop_token_ids or ()))
        first = Sampler(params, self.device)(self.prefill(prompt_token_ids))
        return [first, *self.stream(first, params)]

    # ---- hand-off -------------------------------------------------------------------------------
    def export_state(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(seq_len, copies of the native state tensors, K/V trimmed to seq_len rows)."""
        return self.state.export()

    def import_state(self, seq_len: int, tensors: dict[str, torch.Tensor], start: int = 0) -> None:
        """Load a state in the native layout (validated: names, shapes, dtypes; StateError otherwise);
        `start`: K/V rows before it are kept and the tensors' K/V begin at row `start` (DecodeState.load).
        With speculative decoding the MTP head then has no context (its first rows come from the
        positions this engine decodes) unless `speculative.import_context` follows (docs/NODE.md,
        "The MTP context")."""
        self.state.load(seq_len, tensors, start)
        if self.speculative is not None:
            self.speculative.drop_context()
