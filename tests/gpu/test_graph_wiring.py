"""How the product reaches the GPU graph path (Engine.use_graph, nexrt-decode --graph) on a CPU machine.

The path itself (capture, replays, tokens equal to the eager engine through Engine.stream) needs
CUDA and is checked on the device by benchmarks/checks/gpu_check.py (`engine_graph`). Here: the refusals
are typed and early, and a CPU engine keeps its eager stream.
"""
import pytest
import torch

from nexrt_vllm.engine import Engine, EngineError, SamplingParams
from nexrt_vllm.node.server import _positive, build_parser

torch.set_num_threads(1)


def test_use_graph_refuses_cpu_and_keeps_eager_stream(qwen3_5_ckpt):
    eng = Engine.from_pretrained(qwen3_5_ckpt, device="cpu", dtype="bfloat16", max_seq_len=32, progress=False)
    first = int(torch.argmax(eng.prefill([5, 17, 3])))
    n0, snap = eng.export_state()
    want = list(eng.stream(first, SamplingParams(max_tokens=6, ignore_eos=True)))
    with pytest.raises(EngineError, match="CUDA"):
        eng.use_graph("fused")
    assert eng.graph is None
    eng.import_state(n0, snap)
    assert list(eng.stream(first, SamplingParams(max_tokens=6, ignore_eos=True))) == want
    assert len(want) == 5 and eng.finish_reason == "length"


@pytest.mark.parametrize("mode", ["fused", "eager"])
def test_decode_cli_refuses_graph_on_cpu(mode, capsys):
    ap = build_parser()
    args = ap.parse_args(["--model", "m", "--device", "cpu", "--graph", mode])
    with pytest.raises(SystemExit) as e:
        _positive(ap, args)
    assert e.value.code == 2 and "needs --device cuda" in capsys.readouterr().err


def test_decode_cli_graph_default_is_auto():
    ap = build_parser()
    assert ap.parse_args(["--model", "m"]).graph == "auto"
    args = ap.parse_args(["--model", "m", "--device", "cpu", "--graph", "off"])
    _positive(ap, args)  # off is fine anywhere
    with pytest.raises(SystemExit):
        ap.parse_args(["--model", "m", "--graph", "bogus"])


def test_pdl_only_where_the_gpu_has_it():
    """PDL (on by default in Tuning) must never reach a GPU without griddepcontrol (pre-Hopper) or the
    CPU interpreter; an explicit False or the process default still decide on a Hopper GPU."""
    from nexrt_vllm.engine.gpu.tuning import Tuning, pdl_enabled

    assert Tuning().pdl is True
    assert pdl_enabled(True, False, (9, 0)) and pdl_enabled(None, True, (10, 0))
    assert not pdl_enabled(True, True, (8, 0))  # A100: the kernels would not assemble
    assert not pdl_enabled(True, True, None)  # not a CUDA device
    assert not pdl_enabled(False, True, (9, 0)) and not pdl_enabled(None, False, (9, 0))


def test_wide_rows_take_their_own_rules():
    """The batched round's GEMVs past 8 rows take `gemv_rows_wide` when it has rules (a plain tuple becomes
    rules), else `gemv_rows`, as every GEMV of at most 8 rows does; fp8 weights keep their own rules."""
    from nexrt_vllm.engine.gpu.tuning import RowsShape, Tuning

    t = Tuning(gemv_rows_wide=())
    assert t.shape(6144, rows=True, wide=True) == t.shape(6144, rows=True)
    # the default: gemv_rows with K over two programs for N <= 4096 (the H200 sweep's)
    d = Tuning()
    assert d.shape(2048, rows=True, wide=True) == d.shape(2048, rows=True)._replace(splits=2)
    assert d.shape(6144, rows=True, wide=True) == d.shape(6144, rows=True)
    w = Tuning(gemv_rows_wide=((4096, 16, 256, 4, 3), (1 << 62, 64, 256, 4, 3)))
    assert w.shape(2048, rows=True, wide=True) == RowsShape(16, 256, 4, 3)
    assert w.shape(6144, rows=True, wide=True) == RowsShape(64, 256, 4, 3)
    assert w.shape(6144, rows=True) == t.shape(6144, rows=True)  # at most 8 rows: unchanged
    assert w.shape(6144, fp8=True, rows=True, wide=True) == t.shape(6144, fp8=True, rows=True)


def test_tuning_overrides_from_the_command_line(capsys):
    """`nexrt-decode --tuning` / `decode_bench.py --tuning`: fields replaced in the defaults (rules with a
    split count, the K split of the M-row GEMVs, reach the launch keywords); an unknown field, a value that
    is not a number or a shape of the wrong length is refused at start, naming it."""
    from nexrt_vllm.engine.gpu.tuning import RowsShape, Tuning, gemv_kwargs, tuning_overrides

    t, kw = tuning_overrides("gemv_rows=4096/16/256/1/5/2+4611686018427387904/32/256/2/3,pdl=0,attn_splits=64")
    assert kw == {"gemv_rows": ((4096, 16, 256, 1, 5, 2), (1 << 62, 32, 256, 2, 3)), "pdl": False, "attn_splits": 64}
    assert t.shape(2048, rows=True) == RowsShape(16, 256, 1, 5, 2) and t.shape(6144, rows=True).splits == 1
    w = torch.zeros(2048, 6144, dtype=torch.bfloat16)
    assert gemv_kwargs(t, w, t.shape(2048, rows=True))["splits"] == 2
    assert "splits" not in gemv_kwargs(Tuning(), w, Tuning().shape(2048, rows=True))  # the default: one
    assert tuning_overrides("") == (Tuning(), {})
    for bad, msg in (("gemv_rowz=1", "unknown Tuning field 'gemv_rowz'"), ("attn_splits=x", "attn_splits: 'x'"),
                     ("lm_rows=64/256", "lm_rows=64/256")):
        with pytest.raises(ValueError, match=msg):
            tuning_overrides(bad)
        ap = build_parser()
        args = ap.parse_args(["--model", "m", "--tuning", bad])
        with pytest.raises(SystemExit) as ei:
            _positive(ap, args)
        assert ei.value.code == 2 and "--tuning" in capsys.readouterr().err


def test_decode_cli_tp_graph_needs_a_gpu_per_rank(capsys):
    """`--tp N --device cuda` (the graph path on every rank) refuses at start with fewer than N visible
    GPUs, naming both counts; at TP > 1 the graph modes are no longer refused as such."""
    ap = build_parser()
    n = max(2, torch.cuda.device_count() + 1)
    with pytest.raises(SystemExit) as e:
        _positive(ap, ap.parse_args(["--model", "m", "--device", "cuda", "--tp", str(n)]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"it needs {n} CUDA devices, {torch.cuda.device_count()} visible" in err
    _positive(ap, ap.parse_args(["--model", "m", "--device", "cpu", "--tp", "2", "--graph", "off"]))
    with pytest.raises(SystemExit):  # the graph modes still need CUDA, at any TP
        _positive(ap, ap.parse_args(["--model", "m", "--device", "cpu", "--tp", "2", "--graph", "fused"]))
    assert "needs --device cuda" in capsys.readouterr().err
    for flags in (["--tp", "1", "--device", "cuda"], ["--tp", "2", "--device", "cpu", "--graph", "off"]):
        with pytest.raises(SystemExit):  # the peer collectives are the CUDA graph step's, at TP > 1
            _positive(ap, ap.parse_args(["--model", "m", "--tp-collectives", "peer", *flags]))
        assert "--tp-collectives chooses the CUDA graph step's collectives" in capsys.readouterr().err


def test_tp_group_refuses_missing_gpus_before_spawning():
    from nexrt_vllm.engine.errors import ConfigError
    from nexrt_vllm.engine.tp import Group

    n = max(2, torch.cuda.device_count() + 1)
    with pytest.raises(ConfigError, match=f"needs {n} CUDA devices, {torch.cuda.device_count()} visible"):
        Group(n, device="cuda")


def test_batch_graph_flags_and_cpu_refusal(qwen3_5_ckpt):
    """--max-batch B > 1 reaches the captured batch step with --graph fused (or auto) on CUDA; --graph eager
    is refused (the batch step runs the fused kernels); a CPU engine refuses the batch graph and keeps
    its eager slot engines."""
    ap = build_parser()
    _positive(ap, ap.parse_args(["--model", "m", "--device", "cuda", "--graph", "fused", "--max-batch", "4"]))
    _positive(ap, ap.parse_args(["--model", "m", "--device", "cuda", "--max-batch", "8"]))
    eng = Engine.from_pretrained(qwen3_5_ckpt, device="cpu", dtype="bfloat16", max_seq_len=32, progress=False)
    with pytest.raises(EngineError, match="CUDA"):
        eng.use_batch_graph(2)
    assert eng.batch_graph is None
    slots = eng.slots(3)
    assert slots[0] is eng and len({id(e.state) for e in slots}) == 3 and all(e.batch_graph is None for e in slots)
