"""Byte-level BPE (GPT-2's scheme), learned from a corpus with the Hugging Face `tokenizers` library.

The tokenizer is its tokenizer.json text, kept in the weights' preprocessing metadata as
{"kind": "bpe", "json": ...}: a saved model reads and writes text from its file alone, and
`tokenizers.Tokenizer.from_str(spec["json"])` is the same tokenizer for anyone else.
"""
from __future__ import annotations

import functools
from typing import Iterable

from zoo._deps import require

__all__ = ["BPETokenizer", "check_vocab_size", "MIN_VOCAB", "MAX_VOCAB"]

MIN_VOCAB = 257  # the 256 byte tokens and at least one merge (256 alone is the byte tokenizer)
MAX_VOCAB = 1 << 20  # 4x the largest released LM vocabulary (Gemma's 256k): beyond it, a typo
MIN_FREQUENCY = 2  # a pair seen once is memorised text, not a token worth an embedding row


def check_vocab_size(vocab_size: int | None) -> int:
    if vocab_size is None:
        raise ValueError(f"--tokenizer bpe needs --vocab-size N, the tokens to learn (e.g. 4096; at least {MIN_VOCAB})")
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"--vocab-size {vocab_size} is out of range for BPE: at least {MIN_VOCAB} (the 256 byte "
                         f"tokens and one merge), at most {MAX_VOCAB}")
    return vocab_size


def _tokenizers():
    return require("tokenizers", "the BPE tokenizer", "pip install tokenizers")


@functools.lru_cache(maxsize=8)
def _parse(json_text: str):
    # model.tokenizer builds one per call: parse a given tokenizer.json once
    return _tokenizers().Tokenizer.from_str(json_text)


class BPETokenizer:
    """encode(str) -> ids and decode(ids) -> str over a byte-level BPE tokenizer.json; any text encodes (every
    byte is a token), and decode(encode(text)) == text."""

    def __init__(self, json_text: str):
        self.json = json_text
        self._tokenizer = _parse(json_text)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        """Learn `vocab_size` tokens from `texts` (pieces of one corpus, e.g. `zoo.data.corpus.text_chunks`).
        The same texts and vocab_size give the same tokenizer, byte for byte."""
        check_vocab_size(vocab_size)
        tk = _tokenizers()
        tokenizer = tk.Tokenizer(tk.models.BPE())
        # no prefix space: pieces of a text cut where a word starts encode as the whole text does
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, special_tokens=[],
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False)
        tokenizer.train_from_iterator(texts, trainer)
        learned = tokenizer.get_vocab_size()
        if learned < vocab_size:
            raise ValueError(f"--vocab-size {vocab_size} is too large for this corpus: its training text repeats "
                             f"enough pairs for {learned} BPE tokens only; give --vocab-size {learned} or less, "
                             "or more text")
        return cls(tokenizer.to_str())

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def spec(self) -> dict:
        return {"kind": "bpe", "json": self.json}

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        # a sampled id sequence may end inside a character: the ByteLevel decoder writes U+FFFD there
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
