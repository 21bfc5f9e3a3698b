"""decode_bench.eager_controls: the eager engine against itself from a perturbed state (CPU)."""
import torch

from benchmarks.decode_bench import eager_controls
from nexrt_vllm.engine import Engine
from nexrt_vllm.testing import make_checkpoint


def test_eager_controls_restore_the_state_and_see_a_perturbation(tmp_path):
    torch.set_num_threads(1)
    make_checkpoint(str(tmp_path), arch="qwen3_5", dtype="float32")
    eng = Engine.from_pretrained(str(tmp_path), dtype="float32", max_seq_len=64, progress=False)
    first = int(torch.argmax(eng.prefill([5, 17, 3, 99, 42])))
    n0, snap = eng.export_state()
    tokens, logits, tok = [], [], first
    for _ in range(6):
        lg = eng.decode_step(tok)
        logits.append(lg.clone())
        tok = int(torch.argmax(lg))
        tokens.append(tok)
    same = eager_controls(eng, n0, snap, first, tokens, logits, rel=0.0)["eager_state_perturbed"]
    assert same["equal"] and same["first_divergence"] is None and same["logits_rel_err_median"] == 0.0
    moved = eager_controls(eng, n0, snap, first, tokens, logits, rel=0.5)["eager_state_perturbed"]
    assert moved["logits_rel_err_step0"] > 1e-4
    assert eng.state.seq_len == n0  # left as it found it
