"""Hand-off benchmark: bytes, seconds and GiB/s of the prefill -> decode-node transfer, per
transport, for a few state sizes. Writes JSON (and a PNG plot).

    python benchmarks/handoff_bench.py [--transports mooncake nixl] [--seq-lens 1024 4096 8192]
        [--model PATH] [--reps 3] [--out benchmarks/results/handoff_bench.json]
        [--source host|device|staged] [--kv-interior HND|NHD] [--node-args "--device cuda --recv-memory device"]

The whole real path is measured: a `nexrt-decode` process admits, the connector's
`HandoffSender` sends hello/begin, writes every page of a vLLM-like scattered paged cache through
the transport (coalesced descriptors), sends done; then a `generate` with max_tokens=1 makes the
node convert the pages into its native state (the conversion time comes from the node's metrics).
On a GPU, ``--source device`` sends from a device-memory cache registered with the transport (as
the connector does with vLLM's KV cache) and ``--source staged`` through the connector's pinned
staging pool; ``--kv-interior NHD`` lays attention pages out as FlashAttention's LBNHC.

Without --model the state has the shapes of Qwen3.5-35B-A3B (40 layers: 30 GDN with 16 key / 32
value heads of 128, 10 attention layers with 2 KV heads of 256; ~221 MiB at 8K tokens) on a
model with a tiny hidden size, so weights stay small while the hand-off is full size.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from nexrt_vllm.testing.node_process import NodeProcess  # the same runner the tests use

# Qwen3.5-35B-A3B's state shapes (docs/ARCHITECTURE.md) with a tiny hidden size and few experts.
STATE_SHAPED = dict(num_hidden_layers=40, full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
                    linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, max_position_embeddings=65536)


def _random_state(cfg, seq_len: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from nexrt_vllm.engine import DecodeState

    st = DecodeState(cfg, seq_len, dtype)
    g = torch.Generator().manual_seed(seq_len)
    for t in st.buffers():
        t.copy_(torch.randn(t.shape, generator=g))
    return st.named()


def _send(sender, stager, node, layout, rid, generation, seq_len, addrs):
    if stager is None:
        return sender.send(node.control_addr, layout, rid, generation, seq_len, addrs)
    t = sender.begin(node.control_addr, layout, rid, generation, seq_len)
    writes = [(a, t.regions[layer].offset + i * t.regions[layer].page_bytes, t.regions[layer].page_bytes)
              for layer, pages in addrs.items() for i, a in enumerate(pages)]
    stager.write(t, writes, None)
    t.done()
    return t


def bench_transport(model: str, transport: str, seq_lens: list[int], reps: int, block_size: int,
                    source: str = "host", kv_interior: str = "HND", node_args: tuple[str, ...] = ()) -> list[dict]:
    from nexrt_vllm.engine import ModelConfig
    from nexrt_vllm.handoff.sender import HandoffSender
    from nexrt_vllm.testing.senders import layout_for, pack_state

    cfg = ModelConfig.from_pretrained(model)
    node = NodeProcess(model, transport, "--recv-buffers", "1", *node_args, max_seq_len=max(seq_lens) + 1,
                       start_timeout=300)
    sender = HandoffSender(transport, control_timeout=30.0, transfer_timeout=120.0)
    rows = []
    try:
        layout = layout_for(cfg, block_size=block_size, kv_interior=kv_interior)
        for seq_len in seq_lens:
            cache, pages = pack_state(_random_state(cfg, seq_len, torch.bfloat16), seq_len, layout)
            stager = None
            if source == "host":
                sender.register(cache.data_ptr(), cache.numel())
            else:
                cache = cache.cuda()
                if source == "device":
                    sender.register(cache.data_ptr(), cache.numel(), "device", cache.device.index or 0)
                else:
                    from nexrt_vllm.connector.staging import PinnedStager

                    stager = PinnedStager([cache.untyped_storage()], sender, 256 << 20, timeout=120.0)
            addrs = {layer: [cache.data_ptr() + o for o in offs] for layer, offs in pages.items()}
            runs = []
            for rep in range(reps):
                rid = f"bench-{transport}-{seq_len}-{rep}"
                conv0 = node.metric("nexrt_convert_seconds_sum")
                t0 = time.perf_counter()
                adm = node.admit(rid)
                t_adm = time.perf_counter()
                t = _send(sender, stager, node, layout, rid, adm["generation"], seq_len, addrs)
                t_done = time.perf_counter()
                _, final = node.generate(rid, adm["generation"], 0, 1)
                runs.append({"bytes": t.nbytes, "pages": sum(len(v) for v in addrs.values()),
                             "descriptors": t.descriptors, "write_s": t.seconds, "handoff_s": t_done - t_adm,
                             "admit_s": t_adm - t0, "node_transfer_s": final["timing"]["transfer_s"],
                             "convert_s": node.metric("nexrt_convert_seconds_sum") - conv0})
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row = {"transport": transport, "source": source, "kv_interior": kv_interior, "seq_len": seq_len,
                   "bytes": runs[0]["bytes"],
                   "mib": runs[0]["bytes"] / 2**20, "pages": runs[0]["pages"], "descriptors": runs[0]["descriptors"],
                   "write_s": med["write_s"], "handoff_s": med["handoff_s"], "admit_s": med["admit_s"],
                   "node_transfer_s": med["node_transfer_s"], "convert_s": med["convert_s"],
                   "write_gib_s": runs[0]["bytes"] / med["write_s"] / 2**30,
                   "handoff_gib_s": runs[0]["bytes"] / med["handoff_s"] / 2**30, "reps": runs}
            rows.append(row)
            print(f"{transport:9s} seq_len={seq_len:6d} {row['mib']:8.1f} MiB  write {row['write_s'] * 1e3:8.1f} ms "
                  f"({row['write_gib_s']:.2f} GiB/s)  hand-off {row['handoff_s'] * 1e3:8.1f} ms "
                  f"({row['handoff_gib_s']:.2f} GiB/s)  convert {row['convert_s'] * 1e3:7.1f} ms", flush=True)
            # before the memory is freed and reused
            sender.unregister(stager.pool.data_ptr() if stager is not None else cache.data_ptr())
            del cache, stager
    finally:
        sender.close()
        node.stop()
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, tr in enumerate(sorted({r["transport"] for r in rows})):
        rs = [r for r in rows if r["transport"] == tr]
        ax.plot([r["mib"] for r in rs], [r["handoff_gib_s"] for r in rs], "o-", color=f"C{i}", label=f"{tr} (hand-off)")
        ax.plot([r["mib"] for r in rs], [r["write_gib_s"] for r in rs], "x--", color=f"C{i}",
                label=f"{tr} (writes only)")
    ax.set_xscale("log")
    ax.set_xlabel("state size (MiB)")
    ax.set_ylabel("GiB/s")
    ax.set_title("NexRT hand-off throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", nargs="+", default=["mooncake", "nixl"], choices=["mooncake", "nixl"])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 8192])
    ap.add_argument("--model", default=None, help="checkpoint (default: a state-shaped tiny model, see above)")
    ap.add_argument("--block-size", type=int, default=256, help="sender page size in tokens (vLLM hybrid: 256+)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "handoff_bench.json"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--source", default="host", choices=("host", "device", "staged"),
                    help="sender memory: host, GPU memory registered directly, or GPU through the pinned pool")
    ap.add_argument("--kv-interior", default="HND", choices=("HND", "NHD"))
    ap.add_argument("--node-args", default="", help="extra nexrt-decode arguments, e.g. '--device cuda'")
    args = ap.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(1)
    tmp = None
    model = args.model
    if model is None:
        from nexrt_vllm.testing import make_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="nexrt-handoff-bench-")
        model = make_checkpoint(tmp.name, arch="qwen3_5_moe", **STATE_SHAPED)
    rows = []
    for tr in args.transports:
        rows += bench_transport(model, tr, args.seq_lens, args.reps, args.block_size, args.source, args.kv_interior,
                                tuple(args.node_args.split()))
    out = {"benchmark": "handoff", "model": args.model or "qwen3_5_moe state-shaped like Qwen3.5-35B-A3B",
           "block_size": args.block_size, "source": args.source, "kv_interior": args.kv_interior,
           "node_args": args.node_args, "host": platform.node(), "cpus": os.cpu_count(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if not args.no_plot:
        plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps([{k: v for k, v in r.items() if k != "reps"} for r in rows], indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
