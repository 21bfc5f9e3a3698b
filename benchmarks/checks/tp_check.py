"""Tensor-parallel engine check on GPUs: TP = 2 (and 4, 8 where the host has the GPUs) over NCCL,
one process per GPU, against TP = 1 on cuda:0 — greedy tokens equal in fp32, the state handed in
as re-sharded shards continues identically, and the eager step time per TP size (the eager path:
the CUDA graph path is single-device). Random weights at a small shape (no checkpoint needed).

    python benchmarks/checks/tp_check.py --json OUT/tp_check.json [--tp 2,4] [--tokens 32]
    python benchmarks/checks/tp_check.py --device cpu --tp 2 --json /tmp/tp_check.json   # the same over gloo

The exit status is 1 if any TP size's tokens differ (nexrt_vllm.bench.checks).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from nexrt_vllm.bench.checks import finish, record

CONFIG = dict(architectures=["Qwen3NextForCausalLM"], vocab_size=4096, hidden_size=512, num_hidden_layers=8,
              full_attention_interval=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
              linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
              shared_expert_intermediate_size=256, intermediate_size=1024, rms_norm_eps=1e-6, dtype="float32",
              max_position_embeddings=4096, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
              norm_topk_prob=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def main(argv=None) -> int:
    from nexrt_vllm.engine import Engine, SamplingParams
    from nexrt_vllm.engine.tp import Group
    from nexrt_vllm.node.reshard import node_shards, split_state

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="2,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    gpus = torch.cuda.device_count() if cuda else 8
    sizes = [t for t in (int(x) for x in args.tp.split(",")) if t <= gpus]
    if not sizes:
        print(f"tp_check: {gpus} GPU(s), nothing to run for --tp {args.tp}", file=sys.stderr)
        return 1
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompt = [(i * 37 + 11) % 4000 + 3 for i in range(200)]
    one = Engine.from_config(CONFIG, device="cuda:0" if cuda else "cpu", dtype=torch.float32, max_seq_len=512)
    want = one.generate(prompt, args.tokens, ignore_eos=True)
    first = int(one.prefill(prompt).argmax())
    n, full = one.export_state()
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

    def step_ms(eng) -> float:
        eng.prefill(prompt)
        sync()
        t0 = time.perf_counter()
        tok = first
        for _ in range(args.tokens):
            tok = int(eng.decode_step(tok).argmax())
        sync()
        return (time.perf_counter() - t0) / args.tokens * 1e3

    out = {"gpus": gpus if cuda else 0, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "tokens": args.tokens, "tp1_step_ms": step_ms(one), "runs": []}
    group = Group(max(sizes), device=args.device)
    try:
        for tp in sizes:
            eng = group.engine(tp, config=CONFIG, dtype=torch.float32, max_seq_len=512)
            got = eng.generate(prompt, args.tokens, ignore_eos=True)
            eng.import_shards(n, split_state(one.config, full, node_shards(one.config, tp)))
            streamed = list(eng.stream(first, sp))  # from TP = 1's prefill state, re-sharded 1 -> tp
            run = {"tp": tp, "greedy_equal": got == want, "handoff_equal": [first, *streamed] == want,
                   "step_ms": step_ms(eng)}
            out["runs"].append(run)
            record(out, f"tp{tp}/greedy", run["greedy_equal"])
            record(out, f"tp{tp}/handoff", run["handoff_equal"])
            print(json.dumps(run), flush=True)
    finally:
        group.close()
    rc = finish(out, args.json)
    print(json.dumps(out, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
