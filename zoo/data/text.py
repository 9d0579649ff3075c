"""Character- and byte-level tokenisers and the language-model block dataset."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["CharTokenizer", "ByteTokenizer", "tokenizer_from_spec", "BlockDataset", "read_corpus"]


class CharTokenizer:
    """One id per distinct character of the training text; the character list is saved with the weights."""

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer characters must be distinct")
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def spec(self) -> dict:
        return {"kind": "char", "chars": self.chars}

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters not in the model's vocabulary: {''.join(unknown)!r}; "
                             f"the model knows {self.chars!r}")
        return [self.index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class ByteTokenizer:
    """UTF-8 bytes as ids: any text, vocabulary 256."""
    vocab_size = 256

    def spec(self) -> dict:
        return {"kind": "byte"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def tokenizer_from_spec(spec: dict):
    if spec.get("kind") == "char":
        return CharTokenizer(spec["chars"])
    if spec.get("kind") == "byte":
        return ByteTokenizer()
    if spec.get("kind") == "bpe":
        from zoo.data.bpe import BPETokenizer  # the tokenizers library, imported only for a model that uses it
        return BPETokenizer(spec["json"])
    raise ValueError(f"unknown tokenizer spec {spec.get('kind')!r}; expected kind 'char', 'byte' or 'bpe'")


def read_corpus(path: str | Path) -> str:
    from zoo._io import existing
    path = existing(path, "file", "corpus", "a UTF-8 text file with --data")
    text = path.read_text(encoding="utf-8")
    if len(text) < 2:
        raise ValueError(f"corpus {str(path)!r} is empty")
    return text


class BlockDataset(Dataset):
    """Item i: the contiguous block of `context` + 1 tokens starting at token i (input, shifted target).

    A shuffled sampler over all start positions gives random contiguous blocks; the dataset itself
    holds no randomness, so resuming a run replays exactly the same blocks.
    """

    def __init__(self, ids: torch.Tensor, context: int):
        if len(ids) <= context + 1:
            raise ValueError(f"{len(ids)} tokens are too few for blocks of {context}; use a smaller context")
        self.ids, self.context = ids, context

    def __len__(self) -> int:
        return len(self.ids) - self.context - 1

    def __getitem__(self, i: int):
        block = self.ids[i:i + self.context + 1]
        return block[:-1], block[1:]


class LengthGroupedBatches:
    """Batches of similar length (less padding): shuffled indices from `sampler`, sorted by length within
    chunks of `group` batches, cut into batches whose order is shuffled again. Deterministic per epoch."""

    def __init__(self, sampler, lengths, batch_size: int, *, group: int = 50, seed: int = 0, drop_last: bool = True):
        self.sampler, self.lengths, self.batch_size = sampler, lengths, batch_size
        self.group, self.seed, self.drop_last = group, seed, drop_last

    def __iter__(self):
        indices = list(self.sampler)
        chunk = self.batch_size * self.group
        batches = []
        for start in range(0, len(indices), chunk):
            part = sorted(indices[start:start + chunk], key=lambda i: self.lengths[i])
            batches += [part[i:i + self.batch_size] for i in range(0, len(part), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        g = torch.Generator().manual_seed(self.seed + 7919 * getattr(self.sampler, "epoch", 0))
        return iter([batches[i] for i in torch.randperm(len(batches), generator=g).tolist()])

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
