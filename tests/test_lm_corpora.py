"""transformer_lm corpora (issue 17 item 4): the byte-level BPE tokenizer is the `tokenizers` library's own and
travels in the weights file; `prepare` writes token files that train through np.memmap as the text does; bad
input is refused in one line."""
from __future__ import annotations

import hashlib
import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler
from torch.utils.data.dataloader import default_collate

from . import test_bad_input as bad
from .test_bad_input import LM_TINY, Case, script, train

tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
TRICKY = ["naïve café — 東京タワー", "😀👍🏽 👨‍👩‍👧", "\x00\x01\t\r\n\x0b\x0c",
          "e\u0301 \u200b \u00a0\u3000 x", "  two  spaces\n\n\n  lead", "\u2028line\u2029", "'s 're 'll contractions'd"]


def write_corpus(d: Path, lines: int = 160) -> Path:
    """About 7 KB of made-up words: enough repeated pairs for 512 BPE tokens."""
    r = random.Random(0)
    syllables = ["ka", "ro", "mi", "tu", "sel", "an", "dor", "vi", "le", "qu", "en", "th", "is", "or", "gal", "pe",
                 "ny", "ust"]
    words = ["".join(r.choice(syllables) for _ in range(r.randint(1, 3))) for _ in range(300)]
    text = "\n".join(" ".join(r.choice(words) for _ in range(r.randint(4, 12))).capitalize() + r.choice(".!?,;")
                     for _ in range(lines))
    path = d / "corpus.txt"
    path.write_text(text + "\n" + "\n".join(TRICKY) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def bpe(corpus):
    from zoo.data.corpus import new_tokenizer
    return new_tokenizer("bpe", corpus, vocab_size=512)


def test_bpe_is_the_tokenizers_librarys_own_and_round_trips_any_text(corpus, bpe):
    from zoo.data.bpe import BPETokenizer
    from zoo.data.corpus import new_tokenizer, text_chunks
    text = corpus.read_text(encoding="utf-8")
    saved = tokenizers.Tokenizer.from_str(bpe.spec()["json"])  # what a user of the weights file gets
    # the library's own byte-level BPE, trained on the same text as zoo trains (the tokenizer's part of it)
    peer = tokenizers.ByteLevelBPETokenizer(add_prefix_space=False)
    learned_from = "".join(text_chunks(corpus, until_byte=int(corpus.stat().st_size * 0.9)))
    peer.train_from_iterator([learned_from], vocab_size=512, min_frequency=2, special_tokens=[], show_progress=False)
    r = random.Random(1)
    arbitrary = ["".join(chr(r.choice([r.randint(32, 0x7ff), r.randint(0xe000, 0x10ffff)])) for _ in range(40))
                 for _ in range(20)]
    samples = [text, text[-300:], *TRICKY, *arbitrary]
    for s in samples:
        ids = bpe.encode(s)
        assert ids == saved.encode(s).ids == peer.encode(s).ids
        assert bpe.decode(ids) == saved.decode(ids) == s
    assert bpe.vocab_size == saved.get_vocab_size() == 512 and max(bpe.encode(text)) < 512
    assert new_tokenizer("bpe", corpus, vocab_size=512).json == bpe.json, "training is deterministic"
    assert BPETokenizer(bpe.json).encode(text) == bpe.encode(text)


def test_text_pieces_tokenize_as_the_whole_text(tmp_path, bpe):
    from zoo.data.corpus import text_chunks
    text = "".join(f"{w}{sep}" for w, sep in zip(["alpha", "b", "gamma😀", "dé", "x" * 30, "'s", "!!", "7"] * 6,
                                                 [" ", "  ", "\n", "\n\n", " \n ", "\t", "\u3000", ""] * 6))
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    whole = bpe.encode(text)
    for chunk_chars in (1, 3, 7, 64):
        pieces = list(text_chunks(path, chunk_chars=chunk_chars))
        assert "".join(pieces) == text and len(pieces) > 1
        assert [i for p in pieces for i in bpe.encode(p)] == whole, chunk_chars
    mark = len(text.encode()) // 2
    head = "".join(text_chunks(path, until_byte=mark, chunk_chars=5))
    assert text.startswith(head) and len(head.encode()) >= mark and len(head) < len(text)
    assert bpe.encode(head) == whole[:len(bpe.encode(head))], "the head ends where a token starts"


def _run_argv(data, out: Path, *args: str) -> list[str]:
    return [*LM_TINY, "--data", str(data), "--steps", "2", "--out", str(out), *args]


def test_bpe_run_saves_a_file_that_generates_text_alone_in_a_fresh_process(tmp_path, corpus):
    import zoo
    argv = _run_argv(corpus, tmp_path / "run", "--tokenizer", "bpe", "--vocab-size", "512")
    assert train("transformer_lm", argv) == 0
    weights = tmp_path / "run" / "model.safetensors"
    model = zoo.load("transformer_lm", pretrained=str(weights))
    assert model.config.vocab_size == 512 and model.pretrained_meta.preprocessing["tokenizer"]["kind"] == "bpe"
    prompt = "Kado ☃ 東"
    here = model.generate(prompt, 12, seed=0)
    code = ("import sys, zoo; sys.stdout.buffer.write(zoo.load('transformer_lm', pretrained=sys.argv[1])"
            ".generate(sys.argv[2], 12, seed=0).encode())")
    fresh = subprocess.run([sys.executable, "-c", code, weights.name, prompt], cwd=weights.parent, capture_output=True,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert fresh.returncode == 0, fresh.stderr.decode()[-2000:]
    assert fresh.stdout.decode() == here and here.startswith(prompt) and len(here) > len(prompt)


def _task(data, **extra):
    from zoo.train import TrainConfig, seed_everything
    options = dict(tokenizer=None, vocab_size=None, val_fraction=None, context=8, dim=16, n_layers=1, n_heads=2,
                   n_kv_heads=None, mlp_hidden=16, dropout=0.0, window=None)
    seed_everything(0)  # as run() does before build_task: the same initial weights
    return script("transformer_lm").build_task(TrainConfig(data=str(data), steps=2, extra={**options, **extra}))


def test_prepared_corpus_trains_from_memmap_as_the_text_does(tmp_path, corpus, capsys):
    folder = tmp_path / "tokens"
    assert train("transformer_lm", ["prepare", "--data", str(corpus), "--tokenizer", "bpe", "--vocab-size", "512",
                                    "--out", str(folder)]) == 0
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512 and meta["val_fraction"] == 0.1
    assert meta["source"]["sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    n = meta["tokens"]["train"] + meta["tokens"]["val"]
    assert meta["tokens"]["train"] == int(n * 0.9)
    assert (folder / "train.bin").stat().st_size == 2 * meta["tokens"]["train"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens"], "no temporary folder left beside it"

    from_text = _task(corpus, tokenizer="bpe", vocab_size=512)
    from_folder = _task(folder)
    assert from_folder.meta["preprocessing"] == from_text.meta["preprocessing"]
    # the dataset maps the file: each window read on demand, nothing copied into memory or into a pickle
    tokens = from_folder.train_data.ids
    assert isinstance(tokens.array, np.memmap) and len(pickle.dumps(from_folder.train_data)) < 1024
    assert torch.equal(tokens[:], from_text.train_data.ids)
    assert torch.equal(from_folder.eval_data.ids[:], from_text.eval_data.ids)
    assert len(from_folder.train_data) == len(from_text.train_data)
    # the training order differs (ShuffledBatches keeps no list of all start positions; the text's sampler does),
    # so take the folder's first batch of windows from both datasets: same windows, same weights, same loss
    for a, b in zip(from_folder.model.state_dict().values(), from_text.model.state_dict().values()):
        assert torch.equal(a, b)
    sampler = DistributedSampler(from_folder.train_data, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    first = next(iter(from_folder.batch_sampler(sampler, 4)))
    losses = [task.loss(task.model, default_collate([task.train_data[i] for i in first]))
              for task in (from_folder, from_text)]
    assert torch.equal(*losses)

    # a real run from the folder, its weights evaluated on the folder and on the text file: the same loss
    assert train("transformer_lm", _run_argv(folder, tmp_path / "run")) == 0
    weights = str(tmp_path / "run" / "model.safetensors")
    evaluated = []
    for data in (folder, corpus):
        capsys.readouterr()
        assert train("transformer_lm", ["--eval-only", "--pretrained", weights, "--data", str(data), *LM_TINY[10:],
                                        "--out", str(tmp_path / "eval")]) == 0
        evaluated.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval"])
    assert evaluated[0] == evaluated[1]


def test_shuffled_batches_give_every_window_once_per_epoch():
    from zoo.data.corpus import Permutation, ShuffledBatches
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        assert sorted(Permutation(n, (0, 0))[np.arange(n)].tolist()) == list(range(n))
    data = range(1001)
    epochs = []
    for epoch in (0, 0, 1):
        seen = []
        for rank in (0, 1):
            sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
            sampler.set_epoch(epoch)
            batches = list(ShuffledBatches(sampler, 8))
            assert len(batches) == len(ShuffledBatches(sampler, 8)) == 500 // 8
            seen += [i for b in batches for i in b]
        assert len(set(seen)) == len(seen) == 2 * 8 * (500 // 8) and max(seen) < 1001
        epochs.append(seen)
    assert epochs[0] == epochs[1] and epochs[0] != epochs[2]


# ------------------------------------------------------------------ bad input, one line each


def _prepared(d: Path, *args: str) -> Path:
    """A char-level prepared folder of test_bad_input's corpus (fast), d/tokens."""
    assert train("transformer_lm", ["prepare", "--data", bad.corpus(d), "--out", str(d / "tokens"), *args]) == 0
    return d / "tokens"


def _cut_train_bin(d: Path) -> Path:
    folder = _prepared(d)
    with open(folder / "train.bin", "r+b") as f:
        f.truncate(10)
    return folder


def _from(make, *args: str):
    """Training arguments on the folder `make(d)` returns."""
    return lambda d: [*LM_TINY, "--data", str(make(d)), "--steps", "2", "--out", str(d / "run"), *args]


def _prepare(*args: str, data=None):
    return lambda d: ["prepare", "--data", str(data(d)) if data else bad.corpus(d), "--out", str(d / "tokens"), *args]


def _empty(d: Path) -> Path:
    (d / "empty.txt").write_text("")
    return d / "empty.txt"


def _not_utf8(d: Path) -> Path:
    (d / "latin1.txt").write_bytes("the café of the king\n".encode("latin-1") * 20)
    return d / "latin1.txt"


def _meta_not_json(d: Path) -> Path:
    folder = _prepared(d)
    (folder / "meta.json").write_text("{not json")
    return folder


LM = bad.LM
CASES = [
    Case(17, "bpe --vocab-size too small", lambda d: bad.lm(d, "--steps", "2", "--tokenizer", "bpe", "--vocab-size",
                                                            "100"), LM, 2, "out of range for BPE"),
    Case(17, "bpe --vocab-size above any vocabulary", _prepare("--tokenizer", "bpe", "--vocab-size", "9999999"), LM, 2,
         "out of range for BPE"),
    Case(17, "bpe --vocab-size larger than the corpus repeats", lambda d: bad.lm(d, "--steps", "2", "--tokenizer",
                                                                                 "bpe", "--vocab-size", "5000"),
         LM, 2, "too large for this corpus"),
    Case(17, "bpe without --vocab-size", _prepare("--tokenizer", "bpe"), LM, 2, "needs --vocab-size"),
    Case(17, "--vocab-size with char", lambda d: bad.lm(d, "--steps", "2", "--vocab-size", "512"), LM, 2,
         "applies to --tokenizer bpe only"),
    Case(17, "--vocab-size with byte", _prepare("--tokenizer", "byte", "--vocab-size", "300"), LM, 2,
         "applies to --tokenizer bpe only"),
    Case(17, "a folder without meta.json", _from(lambda d: (d / "folder").mkdir() or d / "folder"), LM, 2,
         "has no meta.json"),
    Case(17, "a meta.json that is no JSON", _from(_meta_not_json), LM, 2, "is not the meta.json of a prepared corpus"),
    Case(17, "a .bin whose size disagrees with meta.json", _from(_cut_train_bin), LM, 2,
         "holds 10 bytes, but meta.json"),
    Case(17, "--tokenizer other than the folder's", _from(_prepared, "--tokenizer", "byte"), LM, 2,
         "holds char tokens, not byte"),
    Case(17, "--vocab-size on a char folder", _from(_prepared, "--vocab-size", "512"), LM, 2,
         "applies to --tokenizer bpe only"),
    Case(17, "--val-fraction other than the folder's", _from(_prepared, "--val-fraction", "0.2"), LM, 2,
         "was split with --val-fraction 0.1"),
    Case(17, "an empty corpus, prepare", _prepare(data=_empty), LM, 2, "is empty"),
    Case(17, "an empty corpus, training", lambda d: bad.lm(d, "--steps", "2", "--data", str(_empty(d))), LM, 2,
         "is empty"),
    Case(17, "a corpus that is not UTF-8", _prepare(data=_not_utf8), LM, 2, "not UTF-8"),
    Case(17, "prepare into a folder that holds files", lambda d: [*_prepare()(d)[:-1], str(_prepared(d))], LM, 2,
         "exists"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_corpus_input_is_refused_in_one_line_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    bad.test_bad_input_is_refused_in_one_line_and_writes_nothing(case, tmp_path, capsys, monkeypatch)
