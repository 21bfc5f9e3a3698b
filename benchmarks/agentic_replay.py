"""Agentic replay: conversations that grow turn by turn (synthetic AgentX-shaped traces,
nexrt_vllm/bench/agentic.py) through the real CPU stack, three ways on one vLLM:

* ``nexrt_cache``: the router over a decode node with ``--context-cache-gib`` (a turn's hand-off
  ships only what the node lacks; docs/NODE.md, "Context cache");
* ``nexrt``: the router over a node without it (every turn ships the whole state);
* ``vllm``: vLLM alone (its prefix cache prefills only the new tokens).

    python -m benchmarks.agentic_replay --conversations 4 --turns 4 --out benchmarks/results/agentic_cpu.json

Each turn's prompt is the last prompt, the answer the replay got (re-tokenized, as an agent sends
text) and a tool result made of the trace's new blocks. Turns run one at a time, conversations
interleaved (every conversation's turn 1, then turn 2, ...), think times skipped; each mode
gets its own token contents (so vLLM's prefix cache holds nothing of another mode's). Per turn:
TTFT (first token at the client), the second token's time (on the NexRT path: after the
hand-off), TPOT, the hand-off bytes and the tokens the node held (its /metrics, exact since one
request runs at a time). JSON, and a plot next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import requests
from tokenizers import Tokenizer

from nexrt_vllm.bench.agentic import block_tokens, interleaved, summarize, synthesize
from nexrt_vllm.testing.real_stack import RealStack, metric

MODES = ("nexrt_cache", "nexrt", "vllm")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks.agentic_replay", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the trained tiny one, built once)")
    ap.add_argument("--trace", default=None, help="a trace JSON (nexrt_vllm/bench/agentic.py); default: synthesized")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=1024, help="first prompt, tokens")
    ap.add_argument("--system", type=int, default=256, help="system prompt shared by all conversations, tokens")
    ap.add_argument("--tool", type=int, default=256, help="tool result added per turn, tokens")
    ap.add_argument("--output", type=int, default=32, help="answer per turn, tokens")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--cache-gib", type=float, default=1.0, help="the nexrt_cache node's --context-cache-gib")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: vLLM and the node on the GPU, one node at a time (with the cache, then without)")
    ap.add_argument("--shape", choices=("2b", "35b"), default=None,
                    help="a real shape with random weights on both sides (needs --tokenizer), as gpu_e2e runs it")
    ap.add_argument("--layers", type=int, default=None, help="--shape cut to N layers (labelled)")
    ap.add_argument("--tokenizer", default=None, help="dir with the Qwen3.5 tokenizer.json (--shape)")
    ap.add_argument("--transport", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--gpu-share", type=float, default=0.45, help="vLLM's share of the GPU's memory (cuda)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured passes of the trace (own token contents) per mode before the measured one: "
                         "vLLM's and the node's kernels meet every prefill and hand-off length first there")
    ap.add_argument("--one-node", action="store_true",
                    help="one node at a time, with the cache and then without (always on a GPU)")
    ap.add_argument("--out", required=True, help="JSON path (the plot: same name, .png)")
    return ap


def _stream(url: str, body: dict) -> dict:
    """One streamed completion: text, timing of its chunks, usage."""
    t0 = time.perf_counter()
    times, text, usage, timing = [], "", None, None
    with requests.post(url + "/v1/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}},
                       stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
                timing = chunk.get("nexrt_timing")  # the router's: its queue and vLLM legs, the node's transfer
            if chunk.get("choices"):
                times.append(time.perf_counter() - t0)
                text += chunk["choices"][0].get("text", "")
    n = usage["completion_tokens"] if usage else len(times)
    rec = {"text": text, "tokens": n, "ttft_s": times[0] if times else None,
           "second_token_s": times[1] if len(times) > 1 else None,
           "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None}
    if timing:  # where a NexRT turn's first token went: admission, vLLM's prefill leg, the rest is the router
        rec.update(queue_s=timing.get("queue_s"), prefill_s=timing.get("prefill_s"),
                   transfer_s=(timing.get("node") or {}).get("transfer_s"))
    return rec


def replay(trace: dict, url: str, node_url: str | None, model: str, tok: Tokenizer, salt: int, vocab, log) -> list:
    """Every request of the trace through `url` (a router or vLLM); -> per-request records. `log`
    None: quiet (a warm-up pass)."""
    bs = trace["block_size"]
    convs = trace["conversations"]
    prompts: list[list[int] | None] = [None] * len(convs)
    out = []
    for c, t in interleaved(trace):
        req = convs[c]["requests"][t]
        if t == 0:
            ids = [x for h in req["hash_ids"] for x in block_tokens(h, bs, vocab, salt)][:req["input_length"]]
        else:
            seen = set(convs[c]["requests"][t - 1]["hash_ids"])
            new = [x for h in req["hash_ids"] if h not in seen for x in block_tokens(h, bs, vocab, salt)]
            need = max(1, req["input_length"] - len(prompts[c]))
            ids = prompts[c] + new[:need]
        before = (metric(node_url, "nexrt_transfer_bytes_total"),
                  metric(node_url, "nexrt_context_cache_held_tokens_total")) if node_url else None
        rec = _stream(url, {"model": model, "prompt": ids, "max_tokens": req["output_length"], "temperature": 0.0,
                            "ignore_eos": True, "user": convs[c]["id"]})
        if before is not None:
            rec["handoff_bytes"] = metric(node_url, "nexrt_transfer_bytes_total") - before[0]
            rec["held_tokens"] = metric(node_url, "nexrt_context_cache_held_tokens_total") - before[1]
        answer = tok.encode(rec.pop("text"), add_special_tokens=False).ids  # what an agent sends back: text
        prompts[c] = ids + answer
        out.append({"conversation": c, "turn": t, "input_tokens": len(ids), **rec})
        if log is None:
            continue
        log(f"  {convs[c]['id']} turn {t}: {len(ids)} tokens, ttft {rec['ttft_s'] * 1e3:.0f} ms"
            + (f" (vLLM leg {rec['prefill_s'] * 1e3:.0f})" if rec.get("prefill_s") is not None else "")
            + (f", hand-off {rec['handoff_bytes'] / 2**20:.2f} MiB, held {rec['held_tokens']:.0f}"
               if before is not None else ""))
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, res in report["modes"].items():
        turns = sorted(res["summary"]["by_turn"], key=int)
        rows = [res["summary"]["by_turn"][t] for t in turns]
        a.plot([int(t) + 1 for t in turns], [r["second_token_s"] * 1e3 for r in rows], "o-",
               label=f"{mode}: 2nd token")
        if rows[0].get("handoff_bytes") is not None:
            b.plot([int(t) + 1 for t in turns], [r["handoff_bytes"] / 2**20 for r in rows], "o-", label=mode)
    a.set(xlabel="turn", ylabel="ms (median)", title="time to the second token")
    b.set(xlabel="turn", ylabel="MiB (median)", title="hand-off bytes per turn")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t_wall = time.monotonic()
    workdir = args.workdir or tempfile.mkdtemp(prefix="nexrt-agentic-")
    os.makedirs(workdir, exist_ok=True)

    def log(msg):
        print(f"[agentic {time.monotonic() - t_wall:7.1f}s] {msg}", flush=True)

    model = args.model
    if args.shape:
        if not args.tokenizer:
            raise SystemExit("--shape needs --tokenizer")
        from nexrt_vllm.bench.model_dir import write_model_dir
        model = os.path.join(workdir, f"model-{args.shape}" + (f"-{args.layers}L" if args.layers else ""))
        write_model_dir(model, args.shape, args.tokenizer, args.layers)
    elif model is None:  # the stored trained checkpoint of the tests (testing/stored.py), else trained here
        from nexrt_vllm.testing import make_checkpoint, stored
        from nexrt_vllm.testing.connector_harness import TRAINED

        model = stored.lookup("qwen3_next", "bfloat16", TRAINED) or os.path.join(workdir, "ckpt-trained")
        if not os.path.exists(os.path.join(model, "config.json")):
            log(f"training the tiny checkpoint into {model}")
            make_checkpoint(model, arch="qwen3_next", dtype="bfloat16", **TRAINED)
    if args.trace:
        with open(args.trace) as f:
            trace = json.load(f)
    else:
        trace = synthesize(args.conversations, args.turns, args.first, args.tool, args.output, system=args.system,
                           seed=args.seed)
    longest = max(r["input_length"] + r["output_length"] for c in trace["conversations"] for r in c["requests"])
    if longest > args.max_len:
        raise SystemExit(f"the trace needs {longest} tokens of context; --max-len is {args.max_len}")
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    # ordinary tokens: of the tiny checkpoint's vocabulary, or well inside the real one's
    vocab = (1000, 100000) if args.shape else (3, min(tok.get_vocab_size(), 380))
    dummy = ["--load-format", "dummy"] if args.shape else []
    cache = {"args": ["--context-cache-gib", str(args.cache_gib), *dummy], "transport": args.transport}
    plain = {"args": dummy, "transport": args.transport}
    gpu = args.device == "cuda"
    one = gpu or args.one_node
    log(f"starting vLLM + {1 if one else 2} node(s) (logs in {workdir})")
    # On a GPU one node at a time (two copies of a real shape beside vLLM's would not fit): the node
    # with the cache first, then the same port without it.
    stack = RealStack(model, workdir, max_len=args.max_len, transport=args.transport, device=args.device,
                      gpu_share=args.gpu_share, vllm_extra=tuple(dummy), nodes=(cache,) if one else (cache, plain))
    # the GPU's name from nvidia-smi: torch here would hold a CUDA context beside vLLM's and the node's
    where = "one " + subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                                    capture_output=True, text=True, timeout=30).stdout.strip() if gpu else "CPU stack"
    what = (f"Qwen3.5-{args.shape.upper()} shape{f' cut to {args.layers} layers' if args.layers else ''}, "
            f"random weights" if args.shape else f"tiny trained {os.path.basename(model)}")
    report = {"title": f"agentic replay, {where}, {what}: {len(trace['conversations'])} conversations x "
                       f"{args.turns} turns, block {trace['block_size']}", "trace": trace, "modes": {},
              "command": "python -m benchmarks.agentic_replay " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": args.device, "hw": where, "shape": args.shape, "layers": args.layers,
              "transport": args.transport}
    try:
        for salt, mode in enumerate(MODES):
            # --fallback error: a turn the fast tier could not serve fails the run instead of being timed on vLLM
            if mode == "vllm":
                url, node_url = stack.vllm_url, None
            else:
                i = 0 if mode == "nexrt_cache" or one else 1
                if one and mode == "nexrt":
                    stack.kill_node(0)
                    stack.specs[0] = plain
                    stack.start_node(0)
                    stack.wait_node(0)
                url, node_url = stack.router("--fallback", "error", nodes=[i])[0], stack.node_urls[i]
            for w in range(args.warmup):
                log(f"{mode}: warm-up pass {w + 1}")
                replay(trace, url, node_url, model, tok, 1000 * (w + 1) + salt + 1, vocab, None)
            log(f"{mode}")
            turns = replay(trace, url, node_url, model, tok, salt + 1, vocab, log)
            report["modes"][mode] = {"turns": turns, "summary": summarize(turns)}
    finally:
        stack.close()
    later = {m: report["modes"][m]["summary"]["later_turns"] for m in MODES}
    if later["nexrt_cache"]["handoff_bytes"]:
        report["bytes_ratio_later_turns"] = later["nexrt"]["handoff_bytes"] / later["nexrt_cache"]["handoff_bytes"]
    report["wall_s"] = time.monotonic() - t_wall
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    for m in MODES:
        s = later[m]
        log(f"{m:12s} later turns (median): ttft {s['ttft_s'] * 1e3:.0f} ms, 2nd token "
            f"{s['second_token_s'] * 1e3:.0f} ms, tpot {s['tpot_s'] * 1e3:.1f} ms"
            + (f", hand-off {s['handoff_bytes'] / 2**20:.2f} MiB" if s.get("handoff_bytes") is not None else "")
            + (f", vLLM leg {s['prefill_s'] * 1e3:.0f} ms" if s.get("prefill_s") is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
