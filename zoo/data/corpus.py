"""Language-model corpora on disk: read in pieces, tokenised once into memory-mapped token files.

`prepare` writes a folder as nanoGPT does: train.bin and val.bin (the token ids, uint16 when the
vocabulary fits, else uint32) and meta.json (the tokenizer, dtype, token counts, the source's sha256 and
the split). Training then reads windows straight from the files through `np.memmap` (`TokenFile`) and
shuffles them without a list of all start positions (`ShuffledBatches`), so a corpus larger than memory
trains. The split is the text files' own: the last `val_fraction` of the tokens are validation; a BPE
tokenizer learns from the first 1 - `val_fraction` of the text only.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from zoo._io import existing
from zoo.data.bpe import BPETokenizer, check_vocab_size
from zoo.data.text import ByteTokenizer, CharTokenizer, tokenizer_from_spec

__all__ = ["VAL_FRACTION", "FORMAT", "check_val_fraction", "check_tokenizer_args", "text_chunks", "new_tokenizer",
           "prepare", "PreparedCorpus", "open_prepared", "TokenFile", "ShuffledBatches", "Permutation"]

VAL_FRACTION = 0.1  # the end of a corpus held out for validation, unless the caller says otherwise
FORMAT = "zoo-lm-tokens/1"  # meta.json's "format": what this module writes and reads
CHUNK_CHARS = 1 << 16  # characters read at a time (tokenizers buffers 256 pieces while it learns)
# A GPT-2 pre-token starts at a space or newline that follows a non-space ("word| next", "end|\n"), whatever
# comes after: the pre-token before it cannot take in whitespace and the regex looks only ahead. Python's \S
# excludes every character Rust's \s (the tokenizers library's) matches, so this never cuts inside a pre-token.
_WORD_START = re.compile(r"\S[ \n]")


def _last_cut(text: str) -> int:
    """The last index where a pre-token starts (see _WORD_START), searched from the end; 0 if there is none."""
    window = 4096
    while True:
        start = max(0, len(text) - window)
        last = None
        for last in _WORD_START.finditer(text, start):
            pass
        if last is not None:
            return last.start() + 1
        if start == 0:
            return 0
        window *= 16


def _pieces(path: Path, chunk_chars: int) -> Iterator[str]:
    carry = ""
    with open(path, encoding="utf-8") as f:  # universal newlines, as read_corpus reads the whole text
        while piece := f.read(chunk_chars):
            text = carry + piece
            cut = _last_cut(text)  # 0: no word start yet (one unbroken line is held whole); read on
            yield text[:cut]
            carry = text[cut:]
    yield carry


def text_chunks(path: str | os.PathLike, *, until_byte: int | None = None,
                chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """The corpus's text in pieces of about `chunk_chars` characters, cut only where a pre-token starts, so the
    pieces tokenised one by one give the tokens of the whole text. `until_byte`: end at the first pre-token
    start at or after that many UTF-8 bytes (the part a BPE tokenizer learns from)."""
    path = Path(path)
    done = 0  # UTF-8 bytes yielded so far
    try:
        for piece in _pieces(path, chunk_chars):
            if not piece:
                continue
            size = len(piece.encode("utf-8")) if until_byte is not None else 0
            if until_byte is None or done + size < until_byte:
                done += size
                yield piece
                continue
            at = len(piece.encode("utf-8")[:until_byte - done].decode("utf-8", errors="ignore"))
            if at > 0:
                word = _WORD_START.search(piece, at - 1)
                yield piece[:word.start() + 1] if word else piece
            return
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {str(path)!r} is not UTF-8 text ({e.reason}); convert it to UTF-8") from None


def check_val_fraction(value: float) -> float:
    if not 0 < value < 1:
        raise ValueError(f"--val-fraction is the share of the corpus held out for validation (its end), between 0 "
                         f"and 1 exclusive; got {value}")
    return value


def check_tokenizer_args(kind: str, vocab_size: int | None) -> None:
    if kind not in ("char", "byte", "bpe"):
        raise ValueError(f"--tokenizer must be char, byte or bpe, got {kind!r}")
    if kind == "bpe":
        check_vocab_size(vocab_size)
    elif vocab_size is not None:
        raise ValueError(f"--vocab-size applies to --tokenizer bpe only; the {kind} tokenizer's vocabulary is "
                         + ("the corpus's characters" if kind == "char" else "the 256 byte values"))


def _corpus_file(path: str | os.PathLike) -> Path:
    path = existing(path, "file", "corpus", "a UTF-8 text file with --data")
    if path.stat().st_size == 0:
        raise ValueError(f"corpus {str(path)!r} is empty")
    return path


def new_tokenizer(kind: str, path: str | os.PathLike, *, vocab_size: int | None = None,
                  val_fraction: float = VAL_FRACTION):
    """A tokenizer for the corpus at `path`, read in pieces: char's alphabet is every character of the file,
    byte needs none, bpe learns `vocab_size` tokens from the first 1 - `val_fraction` of the text's bytes."""
    check_tokenizer_args(kind, vocab_size)
    path = _corpus_file(path)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        chars: set[str] = set()
        for piece in text_chunks(path):
            chars.update(piece)
        return CharTokenizer("".join(sorted(chars)))
    training_part = int(path.stat().st_size * (1 - val_fraction))
    return BPETokenizer.train(text_chunks(path, until_byte=training_part), vocab_size)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ---------------------------------------------------------------------- writing


def prepare(source: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str, vocab_size: int | None = None,
            val_fraction: float = VAL_FRACTION) -> dict:
    """Tokenise the corpus `source` into `out`/train.bin, val.bin and meta.json; returns the meta. Memory stays
    bounded (the text is read in pieces); the folder appears only when complete (written beside it, renamed)."""
    from zoo.weights.files import file_sha256
    check_tokenizer_args(tokenizer, vocab_size)
    check_val_fraction(val_fraction)
    source, out = _corpus_file(source), Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists; give a new folder for the prepared corpus, or remove it")
    tok = new_tokenizer(tokenizer, source, vocab_size=vocab_size, val_fraction=val_fraction)
    dtype = token_dtype(tok.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the folder should get the usual permissions
        total = 0
        with open(tmp / "train.bin", "wb") as f:
            for piece in text_chunks(source):
                ids = np.asarray(tok.encode(piece), dtype=dtype)
                f.write(ids.tobytes())
                total += len(ids)
        n_train = int(total * (1 - val_fraction))
        _move_tail(tmp / "train.bin", tmp / "val.bin", n_train * dtype.itemsize)
        meta = {"format": FORMAT, "tokenizer": tok.spec(), "vocab_size": tok.vocab_size, "dtype": dtype.name,
                "tokens": {"train": n_train, "val": total - n_train}, "val_fraction": val_fraction,
                "split": f"the last {val_fraction:.0%} of the tokens are validation"
                         + (f"; the tokenizer learned from the first {1 - val_fraction:.0%} of the text's bytes"
                            if tokenizer == "bpe" else ""),
                "source": {"path": str(source), "bytes": source.stat().st_size, "sha256": file_sha256(source)}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _move_tail(src: Path, dst: Path, offset: int) -> None:
    """Move src's bytes from `offset` on into dst, a few MB at a time, and cut src there."""
    with open(src, "r+b") as f, open(dst, "wb") as g:
        f.seek(offset)
        while block := f.read(16 << 20):
            g.write(block)
        f.truncate(offset)


# ---------------------------------------------------------------------- reading


class TokenFile:
    """A .bin of token ids read through np.memmap: a slice reads only its tokens (as an int64 tensor), so a
    file larger than memory serves training. It pickles as its path, so DataLoader workers map the file
    themselves rather than receive a copy of the tokens."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype, length: int):
        self.path, self.dtype, self.length = Path(path), np.dtype(dtype), length
        self._array = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:  # an empty file cannot be mapped
            self._array = (np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.length,)) if self.length
                           else np.empty(0, self.dtype))
        return self._array

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> torch.Tensor:
        return torch.from_numpy(self.array[index].astype(np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_array": None}


@dataclass(frozen=True)
class PreparedCorpus:
    folder: Path
    meta: dict
    train: TokenFile
    val: TokenFile

    @property
    def tokenizer(self):
        return tokenizer_from_spec(self.meta["tokenizer"])


def open_prepared(folder: str | os.PathLike) -> PreparedCorpus:
    """A folder `prepare` wrote, its files checked against meta.json."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    remedy = (f"make one with `python train_scripts/transformer_lm.py prepare --data CORPUS.txt --out {folder}`, "
              "or give a text file")
    if not meta_path.is_file():
        raise FileNotFoundError(f"{folder} has no meta.json, so it is no prepared corpus; {remedy}")
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        dtype, tokens = np.dtype(meta["dtype"]), meta["tokens"]
        files = {split: TokenFile(folder / f"{split}.bin", dtype, int(tokens[split])) for split in ("train", "val")}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path} is not the meta.json of a prepared corpus ({e}); {remedy}") from None
    for split, f in files.items():
        size = f.path.stat().st_size if f.path.is_file() else None
        if size != f.length * dtype.itemsize:
            found = "is missing" if size is None else f"holds {size} bytes"
            raise ValueError(f"{f.path} {found}, but meta.json says {f.length} {dtype.name} tokens "
                             f"({f.length * dtype.itemsize} bytes): the folder is incomplete or was changed; "
                             "prepare it again")
    return PreparedCorpus(folder, meta, files["train"], files["val"])


# ---------------------------------------------------------------------- shuffling


class Permutation:
    """A seeded pseudo-random permutation of range(n), any position evaluated on its own in O(1) memory: a
    4-round Feistel network on the smallest square power of two >= n, cycle-walking the values past n back
    in (each walk stays in the network's domain, at most 4n, so few walks are needed)."""

    def __init__(self, n: int, seed: tuple[int, ...]):
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # bits of each Feistel half
        self.keys = np.random.default_rng(list(seed)).integers(0, 2**63, size=4, dtype=np.uint64)

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        x = self._network(np.asarray(positions, dtype=np.uint64))
        outside = x >= self.n
        while outside.any():
            x[outside] = self._network(x[outside])
            outside = x >= self.n
        return x

    def _network(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64((1 << self.half) - 1)
        left, right = x >> half, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << half) | right


def _mix(z: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: every input bit flips about half the output bits (uint64 arithmetic wraps)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class ShuffledBatches:
    """`Task.batch_sampler` for data of very many windows: the batches a DistributedSampler's shuffled epoch
    gives (every index once, this rank's every world_size-th, the remainder dropped), without the sampler's
    list of all indices (8 bytes and more per token of a token file). Deterministic per (seed, epoch)."""

    def __init__(self, sampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self) -> int:
        return self.sampler.num_samples // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        s = self.sampler
        order = Permutation(len(s.dataset), (s.seed, s.epoch))
        for b in range(len(self)):
            j = np.arange(b * self.batch_size, (b + 1) * self.batch_size, dtype=np.uint64)
            yield order[j * np.uint64(s.num_replicas) + np.uint64(s.rank)].tolist()
