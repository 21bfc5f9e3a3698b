"""Draft token maps: the token ids the MTP head drafts from on the graph path (`nexrt-decode
--draft-token-map FILE`; engine/spec/draft_vocab.py), and the tool that builds one from a corpus.

A map is a JSON object whose "token_ids" holds N distinct token ids; every other key is metadata
the node ignores (this tool writes the tokenizer's vocabulary size, the corpus, its token counts and
the held-out coverage). Output does not depend on the map (the verify is exact); acceptance does:
a draft can only be right when the head's choice lies in the map, so a map should hold the ids
that the served text uses most.

    nexrt-vllm draft-token-map --tokenizer DIR_OR_FILE --corpus FILE_OR_DIR [...] [--size 32768]
                               [--holdout 0.2] [--seed 0] [--description TEXT] --out map.json
    (also: python3 -m nexrt_vllm.node.draft_token_map ...)

The corpus is split into documents (a file each; a `.jsonl` file: one per line, its "text"), the
documents shuffled with `--seed` and the first `--holdout` fraction held out. Ids are ranked by their
count in the rest (ties: the smaller id first); the top `--size` are written in ascending order,
with the held-out coverage of the map and of the first `--size` ids (what `--draft-vocab N` reads).
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import random
import sys
from collections.abc import Iterator

BATCH = 256  # documents tokenized per encode_batch call


class TokenMapError(ValueError):
    """A map file, tokenizer or corpus that cannot be read (the message names it)."""


# ---- the file the node reads ---------------------------------------------------------------------
def read_token_map(path: str) -> list[int]:
    """The "token_ids" of the map file at `path` (ints; their range and distinctness are checked
    against the model's vocabulary by engine/spec/draft_vocab.py)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise TokenMapError(f"cannot read the map: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenMapError(f"not a JSON file: {e}") from None
    if not isinstance(doc, dict) or "token_ids" not in doc:
        raise TokenMapError('expected a JSON object with "token_ids": [id, ...]')
    ids = doc["token_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TokenMapError('"token_ids" must be a list of integer token ids')
    return ids


# ---- building one ----------------------------------------------------------------------------------
def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from tokenizer.json, tokenizer.json.xz or a directory holding either."""
    from tokenizers import Tokenizer

    if os.path.isdir(path):
        found = [os.path.join(path, n) for n in ("tokenizer.json", "tokenizer.json.xz")
                 if os.path.isfile(os.path.join(path, n))]
        if not found:
            raise TokenMapError(f"no tokenizer.json(.xz) in {path}")
        path = found[0]
    try:
        if path.endswith(".xz"):
            with lzma.open(path, "rt", encoding="utf-8") as f:
                return Tokenizer.from_str(f.read())
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions on a bad file
        raise TokenMapError(f"cannot load the tokenizer {path}: {e}") from None


def corpus_files(paths: list[str]) -> list[str]:
    """The corpus files: each path, or the files under it (sorted; hidden files and folders skipped)."""
    out = []
    for p in paths:
        if os.path.isfile(p):
            out.append(p)
        elif os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                out += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".")]
        else:
            raise TokenMapError(f"no corpus file or folder {p}")
    if not out:
        raise TokenMapError(f"no corpus files in {paths}")
    return out


def documents(files: list[str]) -> Iterator[str]:
    """The corpus's documents in order: a file's UTF-8 text (files that are not UTF-8 text are
    skipped), or for a `.jsonl` file each line's "text"."""
    for path in files:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            text = json.loads(line)["text"]
                        except (json.JSONDecodeError, KeyError, TypeError):
                            raise TokenMapError(f'{path}:{n}: expected a JSON object with "text"') from None
                        yield str(text)
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        if "\x00" not in text:
            yield text


def build(tokenizer, files: list[str], size: int, holdout: float = 0.2, seed: int = 0) -> dict:
    """The map of the `size` ids most frequent in the corpus's training documents, with its metadata
    (module doc)."""
    import numpy as np

    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 1 <= size <= vocab:
        raise TokenMapError(f"--size must be in [1, {vocab}] (the tokenizer's vocabulary), got {size}")
    if not 0.0 <= holdout < 1.0:
        raise TokenMapError(f"--holdout must be in [0, 1), got {holdout}")
    n_docs = sum(1 for _ in documents(files))
    n_held = round(holdout * n_docs)
    if holdout > 0 and n_docs >= 2:
        n_held = min(max(n_held, 1), n_docs - 1)
    if n_docs - n_held < 1:
        raise TokenMapError(f"the corpus has {n_docs} documents: too few to build a map")
    order = list(range(n_docs))
    random.Random(seed).shuffle(order)
    held = set(order[:n_held])
    counts = {False: np.zeros(vocab, dtype=np.int64), True: np.zeros(vocab, dtype=np.int64)}
    batch: list[tuple[bool, str]] = []

    def flush():
        for (is_held, _), enc in zip(batch, tokenizer.encode_batch([t for _, t in batch], add_special_tokens=False)):
            counts[is_held] += np.bincount(np.asarray(enc.ids, dtype=np.int64), minlength=vocab)
        batch.clear()

    for i, text in enumerate(documents(files)):
        batch.append((i in held, text))
        if len(batch) == BATCH:
            flush()
    flush()
    train, test = counts[False], counts[True]
    rank = np.lexsort((np.arange(vocab), -train))  # by count, descending; ties: the smaller id first
    ids = np.sort(rank[:size])

    def coverage(c):
        total = int(c.sum())
        if not total:
            return None
        return {"map": round(float(c[ids].sum()) / total, 6), "first_n": round(float(c[:size].sum()) / total, 6)}

    # the ids last: the metadata stays readable at the head of the file
    return {"source": "nexrt-vllm draft-token-map", "size": size,
            "tokenizer": {"vocab_size": vocab},
            "corpus": {"files": len(files), "documents": n_docs, "train_documents": n_docs - n_held,
                       "heldout_documents": n_held, "train_tokens": int(train.sum()), "heldout_tokens": int(test.sum()),
                       "distinct_train_ids": int((train > 0).sum()), "holdout": holdout, "seed": seed},
            "coverage": {"heldout": coverage(test), "train": coverage(train)}, "token_ids": ids.tolist()}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokenizer", required=True,
                    help="the model's tokenizer: tokenizer.json, tokenizer.json.xz or a directory holding one")
    ap.add_argument("--corpus", required=True, nargs="+", metavar="FILE_OR_DIR",
                    help="text like the traffic the node will serve: files (a document each; .jsonl: one per line, "
                         "its \"text\") or folders of them")
    ap.add_argument("--size", type=int, default=32768, help="token ids in the map")
    ap.add_argument("--holdout", type=float, default=0.2,
                    help="fraction of the documents held out to measure the map's coverage")
    ap.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    ap.add_argument("--description", default=None, help="what the corpus is (stored in the map)")
    ap.add_argument("--out", required=True, help="the map file to write (JSON)")


def run(args) -> int:
    try:
        tok = load_tokenizer(args.tokenizer)
        files = corpus_files(args.corpus)
        m = build(tok, files, args.size, args.holdout, args.seed)
    except TokenMapError as e:
        print(f"draft-token-map: {e}", file=sys.stderr)
        return 1
    m["tokenizer"]["path"] = args.tokenizer
    m["corpus"].update(paths=list(args.corpus), description=args.description)
    m["token_ids"] = m.pop("token_ids")
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(m, f)
    os.replace(tmp, args.out)
    cov = m["coverage"]["heldout"]
    c = m["corpus"]
    print(f"{args.out}: {args.size} ids from {c['train_tokens']} tokens ({c['train_documents']} documents)"
          + (f"; held-out coverage {100 * cov['map']:.1f}% (the first {args.size} ids: {100 * cov['first_n']:.1f}%)"
             if cov else "; no held-out documents"), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("draft-token-map", description="Build a draft token map (nexrt-decode "
                                 "--draft-token-map) from a corpus: the most frequent token ids.")
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
