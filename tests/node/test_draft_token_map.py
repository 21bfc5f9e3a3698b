"""`nexrt-vllm draft-token-map` (node/draft_token_map.py) on a word-level tokenizer made here: the map
holds the ids most frequent in the training documents (a word frequent only in a held-out document
stays out), in ascending order; the held-out coverage of the map and of the first N ids are the
fractions of held-out tokens they hold; a .json.xz tokenizer and a tokenizer directory give the same
map; the node's reader takes the file back; bad inputs exit 1 with a message."""
import json
import lzma
import random

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from nexrt_vllm.demo.cli import main as cli
from nexrt_vllm.node.draft_token_map import TokenMapError, main, read_token_map

V = 40  # ids: 0 = [UNK], word i = "w{i}"
SIZE = 8


def _tokenizer(path):
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, V)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


def _corpus(tmp_path, held: set[int]):
    """10 documents (8 files, then a .jsonl of 2) of words drawn with higher ids more frequent (so the
    first SIZE ids are not the frequent ones), "w5" repeated only in the held-out documents, an
    unknown word in each; returns the paths and each document's words."""
    rng = random.Random(1)
    words = [f"w{i}" for i in range(1, V) if i != 5]
    docs = []
    for d in range(10):
        ws = rng.choices(words, weights=[i * i for i in range(1, len(words) + 1)], k=200) + ["zzz"]
        if d in held:
            ws += ["w5"] * 500
        rng.shuffle(ws)
        docs.append(ws)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for d in range(8):
        (folder / f"doc{d}.txt").write_text(" ".join(docs[d]))
    (folder / ".hidden.txt").write_text("w5 " * 1000)  # skipped
    (folder / "zz.jsonl").write_text("\n".join(json.dumps({"text": " ".join(ws), "id": d})
                                               for d, ws in enumerate(docs[8:], 8)) + "\n")
    return [str(folder)], docs


def test_map_holds_the_most_frequent_training_ids(tmp_path):
    order = list(range(10))
    random.Random(0).shuffle(order)  # the documented split: shuffled with --seed, the first 20 % held out
    held = set(order[:2])
    corpus, docs = _corpus(tmp_path, held)
    tok = _tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "map.json"
    assert main(["--tokenizer", str(tok), "--corpus", *corpus, "--size", str(SIZE), "--holdout", "0.2",
                 "--description", "test words", "--out", str(out)]) == 0

    def counts(ds):
        c = [0] * V
        for d in ds:
            for w in docs[d]:
                c[int(w[1:]) if w.startswith("w") else 0] += 1
        return c

    train, test = counts(set(range(10)) - held), counts(held)
    want = sorted(sorted(range(V), key=lambda i: (-train[i], i))[:SIZE])
    m = json.loads(out.read_text())
    assert list(m)[-1] == "token_ids" and m["token_ids"] == want and 5 not in want
    assert want != list(range(SIZE))
    assert m["size"] == SIZE and m["tokenizer"] == {"vocab_size": V, "path": str(tok)}
    c = m["corpus"]
    assert (c["documents"], c["train_documents"], c["heldout_documents"]) == (10, 8, 2)
    assert (c["train_tokens"], c["heldout_tokens"]) == (sum(train), sum(test))
    assert c["distinct_train_ids"] == sum(1 for x in train if x) and c["description"] == "test words"
    cov = m["coverage"]["heldout"]
    assert cov["map"] == pytest.approx(sum(test[i] for i in want) / sum(test), abs=1e-6)
    assert cov["first_n"] == pytest.approx(sum(test[:SIZE]) / sum(test), abs=1e-6)
    assert cov["map"] < 0.5 < m["coverage"]["train"]["map"]  # the held-out "w5"s are outside the map
    assert m["coverage"]["train"]["map"] == pytest.approx(sum(train[i] for i in want) / sum(train), abs=1e-6)
    assert read_token_map(str(out)) == want

    # the tokenizer compressed, or the folder holding it; the project CLI's subcommand: the same map
    xz = tmp_path / "tok" / "tokenizer.json.xz"
    xz.parent.mkdir()
    xz.write_bytes(lzma.compress(tok.read_bytes()))
    for i, t in enumerate((xz, xz.parent)):
        out2 = tmp_path / f"map{i}.json"
        assert cli(["draft-token-map", "--tokenizer", str(t), "--corpus", *corpus, "--size", str(SIZE),
                    "--out", str(out2)]) == 0
        assert json.loads(out2.read_text())["token_ids"] == want


def test_bad_inputs(tmp_path, capsys):
    tok = str(_tokenizer(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w2 w3")
    (tmp_path / "b.txt").write_text("w3 w4")
    out = str(tmp_path / "map.json")
    (tmp_path / "empty").mkdir()
    for args, msg in (([tok, str(tmp_path / "nope")], "no corpus file or folder"),
                      ([str(tmp_path / "none.json"), str(tmp_path / "a.txt")], "cannot load the tokenizer"),
                      ([str(tmp_path / "empty"), str(tmp_path / "a.txt")], "no tokenizer.json(.xz) in"),
                      ([tok, str(tmp_path / "a.txt"), "--size", str(V + 1)], f"--size must be in [1, {V}]")):
        assert main(["--tokenizer", args[0], "--corpus", *args[1:], "--out", out]) == 1
        assert msg in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1, 2]")
    (tmp_path / "floats.json").write_text('{"token_ids": [1.5]}')
    for name, msg in (("bad.json", '"token_ids"'), ("floats.json", "list of integer token ids"),
                      ("a.txt", "not a JSON file"), ("missing.json", "cannot read the map")):
        with pytest.raises(TokenMapError, match=msg):
            read_token_map(str(tmp_path / name))
