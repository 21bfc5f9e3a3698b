"""vLLM-GPU prefill + NexRT GPU decode == vLLM-only greedy, through the router with the `openai` client.

    python3 benchmarks/checks/gpu_parity.py --checkpoints DIR --families qwen3_next qwen3_5 \
        --transports mooncake nixl --json OUT.json

DIR/<family> are trained tiny checkpoints (`nexrt_vllm.testing.make_checkpoint(train="periodic",
**connector_harness.TRAINED)`: greedy choices lead by several nats, so bf16 vLLM and the bf16 node
agree token for token, and a wrong state shows); a missing one is made there (copied from the stored
trained fixtures when they hold the recipe). `--speculative mtp`: the node serves MTP rounds
(`--num-speculative-tokens`), the checkpoints carry a trained MTP head (connector_harness.TRAINED_MTP),
and a run is ok only if the node also ran verify rounds (its acceptance histogram, recorded with the
mean tokens per round). `--turns T`: the node keeps finished requests' context (`--context-cache-gib 1`)
and an agent's conversation of T turns follows the single requests (each turn's prompt: the last one, its
answer and 300 new tokens; one `user`); every turn's tokens must equal vLLM-only's, and every turn after the
first must find its leading tokens held by the node (`nexrt_context_cache_held_tokens_total` grows, so its
hand-off shipped only the rest; the bytes each turn received are recorded). Per family and transport: one
vLLM with NexRTConnector (no layout keys: the connector detects them), one GPU decode node (fused graph
path), one router. Prompts of three lengths, the longest over vLLM's --max-num-batched-tokens (chunked
prefill); each goes (a) through the router's interactive path (prefill on vLLM, hand-off, decode on the
node), completions and chat, and (b) to the same vLLM as an ordinary request (vLLM-only greedy). Tokens must
be equal for --tokens tokens. The JSON has per case both token lists, the first divergence, the hand-off
status, the layout line the connector logged, and "ok"; the exit status is 1 unless every run is ok
(nexrt_vllm.bench.checks).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time

from nexrt_vllm.bench.checks import finish, record, write
from nexrt_vllm.handoff.transport import TRANSPORTS
from nexrt_vllm.launch import Procs, free_port, vllm_argv, wait_file, wait_http
from nexrt_vllm.testing.connector_harness import TRAINED, TRAINED_MTP, periodic_prompt

LENGTHS = (7, 300, 1500)
CHUNK = 512  # --max-num-batched-tokens: the 1500-token prompt is prefilled in 3 chunks


def log(*a):
    print(f"[gpu_parity {time.strftime('%H:%M:%S')}]", *a, flush=True)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def checkpoint(root: str, family: str, speculative: bool) -> str:
    """DIR/<family>, made with the trained recipe (with its MTP head when speculating) if missing: copied
    from the repository's store when it holds the recipe (testing/stored.py), else trained (minutes)."""
    from nexrt_vllm.testing import stored

    d = os.path.join(root, family)
    if stored.place(d, family, "bfloat16", TRAINED_MTP[family] if speculative else TRAINED):
        log("trained", d)
    return d


def node_metrics(url: str, *names: str) -> list[float]:
    """Each named node metric's samples summed (0 where it has none yet), from one read of /metrics."""
    import urllib.request

    lines = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines()
    return [sum(float(ln.rsplit(" ", 1)[1]) for ln in lines
                if ln.startswith(n) and ln[len(n):len(n) + 1] in (" ", "{")) for n in names]


CACHE_METRICS = ("nexrt_context_cache_held_tokens_total", "nexrt_transfer_bytes_total")


def conversation(router, plain, model: str, node_url: str, turns: int, n_tokens: int, family: str) -> list[dict]:
    """An agent's turns through the router against vLLM-only; per turn the tokens, the leading tokens the
    node held (not shipped) and the hand-off bytes it received."""
    prompt, out = periodic_prompt(300, seed=200), []
    for t in range(turns):
        held0, bytes0 = node_metrics(node_url, *CACHE_METRICS)
        kw = dict(model=model, prompt=prompt, max_tokens=n_tokens, temperature=0,
                  extra_body={"return_token_ids": True})
        ref_ids = list(plain.completions.create(**kw).choices[0].token_ids)
        got = router.completions.create(**kw, user="parity-agent")
        ids = list(getattr(got.choices[0], "token_ids", None) or [])
        div = first_divergence(ids, ref_ids)
        held, nbytes = node_metrics(node_url, *CACHE_METRICS)
        held -= held0
        case = {"turn": t, "prompt_len": len(prompt), "api": "completions-turn", "tokens": ids,
                "vllm_only": ref_ids, "first_divergence": div, "held_tokens": held, "handoff_bytes": nbytes - bytes0,
                "equal": div is None and len(ids) == n_tokens and (held > 0) == (t > 0)}
        out.append(case)
        log(family, f"turn {t}: {len(prompt)} tokens, held {held:.0f}, {case['handoff_bytes'] / 2**20:.2f} MiB,",
            "equal" if case["equal"] else f"NOT ok (divergence {div}, held {held:.0f})")
        prompt = prompt + ids + periodic_prompt(300, seed=201 + t)
    return out


def node_rounds(url: str) -> tuple[float, float | None]:
    """(verify rounds, mean tokens per round) from the node's acceptance histogram."""
    n, total = node_metrics(url, "nexrt_spec_acceptance_length_count", "nexrt_spec_acceptance_length_sum")
    return n, (total / n if n else None)


def run_case(family: str, ckpt: str, transport: str, device: str, n_tokens: int, work: str,
             spec_tokens: int = 0, turns: int = 0) -> dict:
    import openai

    procs = Procs(work)
    out = {"family": family, "transport": transport, "cases": [], "ok": False}
    max_len = 4096
    try:
        ready = os.path.join(work, "node.ready")
        spec = ["--speculative", "mtp", "--num-speculative-tokens", str(spec_tokens)] if spec_tokens else []
        spec += ["--context-cache-gib", "1"] if turns else []
        procs.start("node", [sys.executable, "-m", "nexrt_vllm.node.server", "--model", ckpt, "--device", device,
                             "--port", "0", "--transport", transport, "--max-seq-len", str(max_len),
                             "--ready-file", ready, *spec])
        vport = free_port()
        extra = ["--max-num-batched-tokens", str(CHUNK), "--enable-chunked-prefill"]
        if device == "cuda":
            extra += ["--enforce-eager"]  # tiny model: a fast start; the kernels are the same
        procs.start("vllm", vllm_argv(ckpt, vport, max_len, transport, device, 0.1, extra=extra))
        node = asyncio.run(wait_file(ready, procs, 420, "decode node"))
        vurl = f"http://127.0.0.1:{vport}"
        asyncio.run(wait_http(vurl + "/health", procs, 600, "vLLM"))
        rport = free_port()
        procs.start("router", [sys.executable, "-m", "nexrt_vllm.router.server", "--port", str(rport),
                               "--vllm-url", vurl, "--decode-url", node["url"], "--tokenizer", ckpt,
                               # parity of the fast path: never let the standard path answer
                               "--default-class", "interactive", "--fallback", "error",
                               "--log-level", "WARNING"])
        rurl = f"http://127.0.0.1:{rport}"
        asyncio.run(wait_http(rurl + "/health", procs, 60, "router"))
        with open(os.path.join(work, "vllm.log"), errors="replace") as f:
            lines = f.readlines()
        out["connector_log"] = [ln.strip() for ln in lines if "NexRTConnector" in ln][:6]
        # vLLM's engine line names the quantization it serves the checkpoint with (fp8 for FP8 ones)
        out["vllm_quantization"] = next((m.group(1) for ln in lines
                                         for m in [re.search(r"quantization=(\w+)", ln)] if m), None)
        router = openai.OpenAI(base_url=rurl + "/v1", api_key="x", timeout=120)
        plain = openai.OpenAI(base_url=vurl + "/v1", api_key="x", timeout=120)
        model = plain.models.list().data[0].id
        for i, n in enumerate(LENGTHS):
            prompt = periodic_prompt(n, seed=100 + i)
            ref = plain.completions.create(model=model, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                           extra_body={"return_token_ids": True})
            ref_ids = list(ref.choices[0].token_ids)
            got = router.completions.create(model=model, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                            extra_body={"return_token_ids": True})
            ids = list(getattr(got.choices[0], "token_ids", None) or [])
            timing = getattr(got, "nexrt_timing", None)
            div = first_divergence(ids, ref_ids)
            case = {"prompt_len": n, "api": "completions", "tokens": ids, "vllm_only": ref_ids,
                    "equal": div is None and len(ids) == n_tokens, "first_divergence": div,
                    "nexrt_timing": timing}
            out["cases"].append(case)
            log(family, transport, n, "completions equal" if case["equal"] else f"DIVERGES at {div}")
            # streamed (SSE) through the router: the text must equal vLLM-only's (the tiny tokenizer has
            # no byte fallback, so equal text means equal tokens)
            stream = router.completions.create(model=model, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                               stream=True)
            text = "".join(ch.choices[0].text for ch in stream if ch.choices)
            ok = text == ref.choices[0].text
            out["cases"].append({"prompt_len": n, "api": "completions-stream", "text": text,
                                 "vllm_only_text": ref.choices[0].text, "equal": ok})
            log(family, transport, n, "stream equal" if ok else "stream DIFFERS")
        if turns:
            out["cases"] += conversation(router, plain, model, node["url"], turns, n_tokens, family)
        out["ok"] = all(c["equal"] for c in out["cases"])
        if spec_tokens:
            out["mtp_rounds"], out["tokens_per_round"] = node_rounds(node["url"])
            out["ok"] = out["ok"] and out["mtp_rounds"] > 0
            log(family, transport, f"{out['mtp_rounds']:.0f} MTP rounds, {out['tokens_per_round']} tokens per round")
    except Exception as e:  # noqa: BLE001 - record and go on with the next case
        out["error"] = f"{type(e).__name__}: {e}"
        for name, _, logf in procs.procs:
            with open(logf, errors="replace") as f:
                out.setdefault("logs", {})[name] = f.read()[-3000:]
        log("FAILED", family, transport, out["error"])
    finally:
        procs.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", required=True, help="dir of <family>/ trained tiny checkpoints")
    ap.add_argument("--families", nargs="+", default=["qwen3_next", "qwen3_5"])
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--tokens", type=int, default=33, help="tokens per request (vLLM's first + the node's)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--speculative", choices=("off", "mtp"), default="off",
                    help="mtp: the node serves MTP rounds (checkpoints with a trained MTP head)")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--turns", type=int, default=0, help="then an agent's conversation of this many turns "
                    "through the node's context cache (0: none)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    spec_tokens = a.num_speculative_tokens if a.speculative == "mtp" else 0
    res = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "device": a.device,
           "prompt_lengths": LENGTHS, "max_num_batched_tokens": CHUNK, "tokens": a.tokens,
           "speculative": a.speculative, "num_speculative_tokens": spec_tokens or None, "turns": a.turns, "runs": []}
    if a.device == "cuda":
        import torch
        res["hw"] = torch.cuda.get_device_name()
    for fam in a.families:
        for tr in a.transports:
            with tempfile.TemporaryDirectory(prefix=f"parity-{fam}-{tr}-") as work:
                run = run_case(fam, checkpoint(a.checkpoints, fam, bool(spec_tokens)), tr, a.device, a.tokens, work,
                               spec_tokens, a.turns)
            res["runs"].append(run)
            record(res, f"{fam}/{tr}", run["ok"])
            write(res, a.json)
    log("ok" if all(r["ok"] for r in res["runs"]) else "NOT ok",
        [(r["family"], r["transport"], r["ok"]) for r in res["runs"]])
    return finish(res, a.json)


if __name__ == "__main__":
    sys.exit(main())
