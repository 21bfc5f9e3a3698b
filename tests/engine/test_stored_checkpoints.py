"""The trained checkpoints stored in the repository (testing/stored.py, tests/fixtures/checkpoints) are
exactly the recipes the suite asks for: a recipe changed without `python -m nexrt_vllm.testing.stored`
fails here, not as a silent retraining in every test session. What the checkpoints can do (margins,
acceptance of their MTP heads, parity with vLLM) is what the tests that use them assert."""
import json
import os

from safetensors import safe_open

from nexrt_vllm.testing import stored


def test_the_store_holds_every_recipe_and_nothing_else():
    want = {stored.digest(stored.recipe(*r)) for r in stored.recipes()}
    have = set(os.listdir(stored.STORE))
    assert have == want, f"stale: {sorted(have - want)}, missing: {sorted(want - have)}"


def test_each_stored_checkpoint_is_its_recipe():
    for arch, dtype, overrides in stored.recipes():
        path = stored.lookup(arch, dtype, overrides)
        assert path is not None
        with open(os.path.join(path, "recipe.json")) as f:
            assert json.load(f) == stored.recipe(arch, dtype, overrides)
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        assert cfg.get("text_config", cfg)["model_type"].startswith(arch) and cfg.get("dtype") == dtype, cfg
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            heads = [k for k in f.keys() if k.startswith("mtp.")]
        assert bool(heads) == bool(overrides.get("mtp")), (arch, overrides, len(heads))


def test_an_untrained_or_unstored_recipe_is_not_looked_up():
    assert stored.lookup("qwen3_next", "bfloat16", {}) is None
    assert stored.lookup("qwen3_next", "bfloat16", {"train": "periodic", "seed": 12345}) is None
