"""Per-token cost of logprobs and of a grammar mask on the GPU graph path, at a real model shape.

For each context it captures the step variants GraphRunner serves (greedy: plain, logprobs, mask,
both) and reports:

* device time per step of each variant (median of `--steps` back-to-back replays, CUDA events; the
  mask variants with the flag raised, so they never wait) and its overhead over the plain step;
* launches per step of each variant;
* end to end, the product loop (`GraphRunner.steps`): tokens/s plain, with logprobs (k), with a
  JSON-schema mask (the host fills step k+1's mask while the device runs it), with both; and the
  host's per-token grammar work (accept + bitmask fill), which is what the pipelining hides;
* checks: the graph's logprobs (teacher-forced, every variant) against torch's log_softmax / topk
  of the same logits (a failure exits 1, nexrt_vllm.bench.checks), and every constrained token
  accepted by a fresh matcher.

The mask needs a tokenizer of the shape's vocabulary size: `--tokenizer DIR` (a Hugging Face
tokenizer, e.g. Qwen3.5's), else a synthetic one (random printable tokens, 248320 of them), which
the report says.

    python3 benchmarks/outputs_bench.py --shape 2b --contexts 1024,8192 --steps 200 \\
        --tokens 256 --json $OUT/outputs_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

from nexrt_vllm.bench.checks import finish, record
from nexrt_vllm.bench.shapes import NAMES, SHAPES
from nexrt_vllm.bench.step import fill_context, time_replays

# A schema whose answers do not end by themselves (an open array of records): the run is
# `--tokens` long whatever the weights pick.
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "score": {"type": "number"}, "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"]}}
# The graph's logprobs against torch's log_softmax of the same fp32 logits (nats): both are fp32.
LOGPROB_TOL = 1e-3
VARIANTS = {"plain": (False, False), "logprobs": (True, False), "mask": (False, True), "mask+logprobs": (True, True)}


def log(*a):
    print(*a, flush=True)


def synthetic_info(vocab_size: int, seed: int = 0):
    """An xgrammar TokenizerInfo of `vocab_size` raw tokens: the 95 printable ASCII characters, then
    random printable strings of 2-8 characters (word-like mostly), the last id the stop token."""
    import xgrammar as xgr

    rng = random.Random(seed)
    printable = [chr(c) for c in range(32, 127)]
    words = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    vocab, seen = list(printable), set(printable)
    while len(vocab) < vocab_size - 1:
        alpha = words if rng.random() < 0.8 else "".join(printable)
        t = ("" if rng.random() < 0.6 else " ") + "".join(rng.choice(alpha) for _ in range(rng.randint(2, 8)))
        if t not in seen:
            seen.add(t)
            vocab.append(t)
    vocab.append("<|end|>")
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[vocab_size - 1])


def launches(d, logprobs: bool, mask: bool) -> int:
    """Kernel launches of one greedy step of this variant (the plan, the tail if any, the finish)."""
    return len(d.plan()) + (1 if logprobs or mask else 0) + 1


def check_logprobs(runner, k: int, steps: int = 6) -> dict:
    """Teacher-forced: the logprob ring after each step == log_softmax / stable sort of the logits the
    step left, for both logprob variants (the mask variant with every token allowed)."""
    from nexrt_vllm.engine.gpu.control import RING

    d = runner.d
    out = {}
    for mask in (False, True):
        d.mem.host["masks"].fill_(-1)
        d.mem.host["flag"].fill_(1 << 62)
        d.lp_k.fill_(k)
        worst, ids_equal = 0.0, True
        tok = 1
        for _ in range(steps):
            d.tok.fill_(tok)
            d.launch(False, True, mask)
            torch.cuda.synchronize()
            slot = (int(d.step) - 1) % RING
            ref = torch.log_softmax(d.logits.float(), -1)
            tok = int(d.tok)
            vals, ids = torch.sort(ref, descending=True, stable=True)
            lpv, lpi = d.mem.host["lpv"][slot], d.mem.host["lpi"][slot]
            worst = max(worst, abs(float(lpv[0]) - float(ref[tok])),
                        float((lpv[1:k + 1].to(vals.device) - vals[:k]).abs().max()))
            ids_equal &= lpi[:k].tolist() == ids[:k].tolist() and tok == int(ids[0])
        out["mask" if mask else "plain"] = {"max_abs_err": worst, "top_ids_equal": ids_equal}
    d.mem.host["flag"].fill_(int(d.step))
    return out


def run(args) -> dict:
    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.engine.structured import Grammars
    from nexrt_vllm.handoff.structured import StructuredSpec

    cfg = SHAPES[args.shape]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    max_len = max(contexts) + max(args.steps, args.tokens) + 64
    t0 = time.time()
    eng = Engine.from_config(cfg, device="cuda", dtype="bfloat16", max_seq_len=max_len, seed=0)
    runner = GraphRunner(FusedDecoder(eng.model, eng.state, mode="fused"))
    d = runner.d
    if not runner.masks:
        raise SystemExit(f"control memory is {d.control}: the mask variants need host-mapped memory")
    for lp, m in VARIANTS.values():
        runner.capture(False, lp, m)
    log(f"[{args.shape}] built + captured 4 variants in {time.time() - t0:.1f}s ({d.control})")
    vocab = cfg["vocab_size"]
    if args.tokenizer:
        grammars, tok_kind = Grammars(args.tokenizer, vocab), f"huggingface:{args.tokenizer}"
    else:
        t1 = time.time()
        grammars, tok_kind = Grammars(None, vocab, info=synthetic_info(vocab)), "synthetic"
        log(f"synthetic tokenizer info in {time.time() - t1:.1f}s")
    t1 = time.time()
    compiled = grammars.compile(StructuredSpec("json_schema", SCHEMA))
    compile_s = time.time() - t1
    res = {"shape": NAMES[args.shape], "vocab_size": vocab, "tokenizer": tok_kind, "logprobs_k": args.k,
           "schema": SCHEMA, "compile_s": compile_s, "control": d.control, "pdl": d.pdl,
           "launches": {name: launches(d, lp, m) for name, (lp, m) in VARIANTS.items()},
           "logprobs_check": check_logprobs(runner, args.k), "contexts": []}
    log(f"logprobs check {res['logprobs_check']}")
    gen = torch.Generator(device="cuda").manual_seed(1234)
    for ctx in contexts:
        fill_context(eng, ctx, gen)
        row = {"context": ctx, "device_step_ms": {}, "e2e_tok_s": {}}
        # device time: the flag raised for every step, the mask all-allowed
        d.mem.host["masks"].fill_(-1)
        d.mem.host["flag"].fill_(1 << 62)
        d.lp_k.fill_(args.k)
        for name, (lp, m) in VARIANTS.items():
            g = runner.capture(False, lp, m)
            d.state.position.fill_(ctx)
            d.tok.fill_(1)
            time_replays(g, 5)
            d.state.position.fill_(ctx)
            row["device_step_ms"][name] = statistics.median(time_replays(g, args.steps)) * 1e3
        d.mem.host["flag"].fill_(int(d.step))
        base = row["device_step_ms"]["plain"]
        row["device_overhead_pct"] = {n: 100 * (v / base - 1) for n, v in row["device_step_ms"].items() if n != "plain"}
        # end to end: the product loop, a fresh matcher per run
        host_us = []
        for name, (lp, m) in VARIANTS.items():
            eng.state.set_seq_len(ctx)
            c = None
            first = 1
            if m:
                c = grammars.constraint(compiled, [vocab - 1])
                allowed = c.fill()
                first = next(t for t in range(vocab) if (int(allowed[t // 32]) >> (t % 32)) & 1)
                c.accept(first)
                c = _Timed(c, host_us)
            t1 = time.perf_counter()
            n = sum(1 for _ in runner.steps(first, args.tokens, logprobs=args.k if lp else None, constraint=c))
            row["e2e_tok_s"][name] = n / (time.perf_counter() - t1)
            row.setdefault("e2e_tokens", {})[name] = n
        row["e2e_overhead_pct"] = {n: 100 * (row["e2e_tok_s"]["plain"] / v - 1)
                                   for n, v in row["e2e_tok_s"].items() if n != "plain"}
        host_us.sort()
        row["host_grammar_us_per_token"] = {"median": statistics.median(host_us), "p90": host_us[9 * len(host_us) // 10],
                                            "max": host_us[-1]}
        res["contexts"].append(row)
        log(f"[{args.shape}] ctx {ctx}: device ms {json.dumps({k: round(v, 4) for k, v in row['device_step_ms'].items()})}"
            f" overhead % {json.dumps({k: round(v, 2) for k, v in row['device_overhead_pct'].items()})}; e2e tok/s "
            f"{json.dumps({k: round(v, 1) for k, v in row['e2e_tok_s'].items()})}; host grammar us/token "
            f"{row['host_grammar_us_per_token']}")
    return res


class _Timed:
    """A constraint whose accept + fill time per token is recorded (the host's grammar work)."""

    def __init__(self, c, sink: list):
        self.c, self.sink, self._t = c, sink, 0.0

    def accept(self, tok):
        self._t = time.perf_counter()
        self.c.accept(tok)

    @property
    def terminated(self):
        return self.c.terminated

    def fill(self, out=None):
        row = self.c.fill(out)
        if self._t:  # not the first mask, which the request's start fills before any token
            self.sink.append((time.perf_counter() - self._t) * 1e6)
        return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--steps", type=int, default=200, help="replays per device-time median")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per end-to-end run")
    ap.add_argument("--k", type=int, default=20, help="top logprobs per token")
    ap.add_argument("--tokenizer", default="", help="Hugging Face tokenizer dir of the shape's vocabulary")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("outputs_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    out.update(run(args))
    for name, c in out["logprobs_check"].items():
        record(out, f"logprobs_check/{name}", c["top_ids_equal"] and c["max_abs_err"] <= LOGPROB_TOL)
    return finish(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
