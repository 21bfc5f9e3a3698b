"""The trained tiny checkpoints of the test suite, stored in the repository (tests/fixtures/checkpoints).

Training them (`make_checkpoint(train=...)`, the MTP heads of testing/mtp_head.py) takes about 20
minutes of one CPU core, which every fresh CI machine would spend again. Each stored checkpoint is
exactly what `make_checkpoint` (+ `add_mtp_head`) writes for its recipe: the directory is named by
the digest of the recipe (arch, dtype, overrides, the training constants, RECIPE_VERSION) and holds
it as recipe.json. The suite's `ckpt_factory` copies a stored checkpoint whose recipe equals the
one asked for and trains whatever is not stored; tests/engine/test_stored_checkpoints.py fails when
a recipe changed without the store being rewritten:

    python -m nexrt_vllm.testing.stored      # (re)builds what is missing or stale, removes the rest
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

# Bump when the training changes in a way the constants in `recipe` do not show.
RECIPE_VERSION = 1
STORE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "tests", "fixtures", "checkpoints")


def recipe(arch: str, dtype: str, overrides: dict) -> dict:
    """What decides a trained checkpoint's bytes (on a given host's arithmetic)."""
    from . import TRAIN_STEPS
    from .agents import AGENT_LR, AGENT_STEPS
    from .mtp_head import MTP_CHAIN_WEIGHT, MTP_MODEL_LR, MTP_TRAIN_LR, MTP_TRAIN_STEPS

    train = overrides.get("train")
    return {"arch": arch, "dtype": dtype, "overrides": dict(sorted(overrides.items())), "version": RECIPE_VERSION,
            "train_steps": TRAIN_STEPS if train == "periodic" else None,
            "agents": [AGENT_STEPS, AGENT_LR] if train == "agents" else None,
            "mtp": [MTP_TRAIN_STEPS, MTP_TRAIN_LR, MTP_MODEL_LR, MTP_CHAIN_WEIGHT] if overrides.get("mtp") else None}


def digest(r: dict) -> str:
    return hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16]


def lookup(arch: str, dtype: str, overrides: dict) -> str | None:
    """The stored checkpoint of this recipe, or None (not trained, or not stored)."""
    if not overrides.get("train"):
        return None
    path = os.path.join(STORE, digest(recipe(arch, dtype, overrides)))
    return path if os.path.isfile(os.path.join(path, "recipe.json")) else None


def place(path: str, arch: str, dtype: str, overrides: dict) -> bool:
    """Put this recipe's checkpoint at `path` unless one is there: copied from the store, else trained
    (minutes). True if it was trained."""
    if os.path.exists(os.path.join(path, "config.json")):
        return False
    kept = lookup(arch, dtype, overrides)
    if kept:
        shutil.copytree(kept, path, dirs_exist_ok=True)
        return False
    from . import make_checkpoint
    make_checkpoint(path, arch=arch, dtype=dtype, **overrides)
    return True


def recipes() -> list[tuple[str, str, dict]]:
    """The trained checkpoints the suite asks for."""
    from .agents import AGENTS_TRAINED
    from .recipes import TRAINED, TRAINED_MTP
    return ([("qwen3_next", "bfloat16", TRAINED)] + [(a, "bfloat16", o) for a, o in TRAINED_MTP.items()]
            + [("qwen3_next", "bfloat16", AGENTS_TRAINED)])


def main(argv=None) -> int:
    from . import make_checkpoint  # with mtp=True: the model, then its head, as ckpt_factory derives it

    os.makedirs(STORE, exist_ok=True)
    want = {digest(recipe(*r)): r for r in recipes()}
    for name in sorted(os.listdir(STORE)):
        if name not in want:
            shutil.rmtree(os.path.join(STORE, name))
            print(f"removed stale {name}", flush=True)
    for name, (arch, dtype, overrides) in want.items():
        path = os.path.join(STORE, name)
        if os.path.isfile(os.path.join(path, "recipe.json")):
            continue
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_checkpoint(tmp, arch=arch, dtype=dtype, **overrides)
        with open(os.path.join(tmp, "recipe.json"), "w") as f:
            json.dump(recipe(arch, dtype, overrides), f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        print(f"stored {name}: {arch} {dtype} {overrides}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
