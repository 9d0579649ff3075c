"""WebDataset shards: samples read from uncompressed tar files named by a brace pattern.

    --data 'shards/train-{000000..000099}.tar'      # webdataset's notation; every named file must exist

A sample is the tar members that share a key, the path up to the first dot of the file name (0001.jpg and
0001.cls are sample 0001 with fields jpg and cls), as webdataset's ShardWriter and TarWriter write them.
Opening a set of shards reads their members' headers (no data) into an index, so the number of samples is
known before training starts and each sample can be read on its own.

Training reads a `ShardStream`, an iterable dataset: the shards are split across DDP ranks (rank r reads
shards r, r + world size, ...; fewer shards than ranks is refused). Each epoch, a rank visits its samples in
an order drawn from (seed, epoch, rank) and cut into batches, and its DataLoader workers take the batches in
turn, so no sample is read twice and the order does not depend on --workers. Every rank yields as many
samples per epoch as the rank with the fewest, in whole batches: with shards of equal size each sample is
seen once per epoch (the last partial batch left out); a rank with more samples leaves out the last ones of
each epoch's order, other ones each epoch. --resume continues exactly after the samples already consumed,
with the same augmentation (seeded per sample). Evaluation reads the samples as a map-style dataset
(`ShardImages`: an image .jpg/.jpeg/.png/.webp/.bmp and a .cls class id; `TextShards`: a .txt and a .cls
label), which the loop splits across ranks as any other. Reads are random within the shards, which suits
shards on local disks; compressed shards (.tar.gz) cannot be read that way and are refused.
"""
from __future__ import annotations

import io
import logging
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from zoo._deps import require
from zoo.data.seeding import rng_restored, sample_seed, seed_sample

__all__ = ["is_shard_pattern", "ShardIndex", "ShardStream", "ShardImages", "TextShards", "IMAGE_FIELDS",
           "image_shards"]

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "bmp")  # the first present is a sample's image
_OPEN_FILES = 64  # shards a reader keeps open at once
log = logging.getLogger(__name__)


def is_shard_pattern(spec: str | None) -> bool:
    """Whether --data names tar shards (a file or brace pattern ending in .tar) rather than another format."""
    return spec is not None and str(spec).endswith((".tar", ".tar.gz", ".tgz"))


def _webdataset():
    return require("webdataset", "reading WebDataset shards", "pip install webdataset")


@dataclass
class _Shard:
    path: Path
    keys: list[str]
    offsets: np.ndarray  # (samples, fields) int64: where each field's bytes start in the file
    sizes: np.ndarray  # (samples, fields) int64


class ShardIndex:
    """The samples of the shards a pattern names, each with where its fields' bytes lie.

    `fields` maps each field a sample must have to the tar extensions that may hold it, first found wins,
    e.g. {"image": IMAGE_FIELDS, "label": ("cls",)}. A pattern naming no existing file, a missing shard, a
    compressed or unreadable one, an empty one, and a sample without one of the fields are refused in one line.
    """

    def __init__(self, pattern: str, fields: dict[str, tuple[str, ...]]):
        wds = _webdataset()
        expand_urls, base_plus_ext = wds.shardlists.expand_urls, wds.tariterators.base_plus_ext
        self.pattern, self.fields = pattern, dict(fields)
        paths = [Path(p) for p in expand_urls(pattern)]
        present = [p for p in paths if p.is_file()]
        if not present:
            raise FileNotFoundError(f"the shard pattern {pattern!r} matches no file (it names {len(paths)}, "
                                    f"e.g. {str(paths[0])!r}); give tar files that exist, e.g. "
                                    "'shards/train-{000000..000009}.tar'")
        if len(present) < len(paths):
            missing = [p for p in paths if not p.is_file()]
            raise FileNotFoundError(f"{len(missing)} of the {len(paths)} shards of {pattern!r} do not exist, e.g. "
                                    f"{str(missing[0])!r}; fix the pattern's range")
        self.shards = [self._index(p, base_plus_ext) for p in paths]
        self.starts = np.cumsum([0] + [len(s.keys) for s in self.shards])  # sample k of shard j: starts[j] + k
        self._reader, self._reader_pid = None, None

    def _index(self, path: Path, base_plus_ext) -> _Shard:
        found: dict[str, dict[str, tarfile.TarInfo]] = {}
        try:
            with tarfile.open(path, "r:") as tar:  # headers only: tarfile seeks over the members' data
                for member in tar:
                    key, ext = base_plus_ext(member.name) if member.isfile() else (None, None)
                    if key is not None:
                        found.setdefault(key, {})[ext.lower()] = member
        except tarfile.ReadError as e:
            hint = ("compressed shards cannot be read by sample; decompress them (gunzip) or write them "
                    "uncompressed" if path.name.endswith((".gz", ".tgz")) else "is it a tar file?")
            raise ValueError(f"shard {str(path)!r} cannot be read as an uncompressed tar ({e}); {hint}") from None
        if not found:
            raise ValueError(f"shard {str(path)!r} holds no samples (no files named KEY.EXT)")
        keys = list(found)
        offsets = np.zeros((len(keys), len(self.fields)), dtype=np.int64)
        sizes = np.zeros_like(offsets)
        for i, key in enumerate(keys):
            members = found[key]
            for j, (field, extensions) in enumerate(self.fields.items()):
                ext = next((e for e in extensions if e in members), None)
                if ext is None:
                    raise ValueError(f"shard {str(path)!r}: sample {key!r} has {', '.join(sorted(members))} but no "
                                     f"{field} ({' or '.join('.' + e for e in extensions)}); each sample needs "
                                     f"{' and '.join(self.fields)}")
                offsets[i, j], sizes[i, j] = members[ext].offset_data, members[ext].size
        return _Shard(path, keys, offsets, sizes)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def values(self, field: str) -> list[bytes]:
        """One field of every sample, in index order (e.g. all labels, to know the classes up front)."""
        with _Reader(self) as reader:
            return [reader.field(s, i, field) for s, shard in enumerate(self.shards) for i in range(len(shard.keys))]

    def locate(self, k: int) -> tuple[int, int]:
        """(shard, position in it) of sample `k` of the index."""
        shard = int(np.searchsorted(self.starts, k, side="right")) - 1
        return shard, k - int(self.starts[shard])

    def sample(self, k: int) -> dict[str, Any]:
        """Sample `k`: its fields' bytes by field name, with "__key__" and "__shard__" (read in this process)."""
        if self._reader is None or self._reader_pid != os.getpid():  # a forked worker opens its own files
            self._reader, self._reader_pid = _Reader(self), os.getpid()
        shard, i = self.locate(k)
        s = self.shards[shard]
        return {"__key__": s.keys[i], "__shard__": str(s.path),
                **{f: self._reader.field(shard, i, f) for f in self.fields}}

    def __getstate__(self):
        return {**self.__dict__, "_reader": None, "_reader_pid": None}  # open files do not travel to workers


class _Reader:
    """Reads fields by (shard, position), keeping up to _OPEN_FILES shards open."""

    def __init__(self, index: ShardIndex):
        self.index, self.files = index, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self.files.values():
            f.close()
        self.files.clear()

    def field(self, shard: int, i: int, field: str) -> bytes:
        s = self.index.shards[shard]
        j = list(self.index.fields).index(field)
        f = self.files.pop(shard, None) or open(s.path, "rb")
        self.files[shard] = f  # most recently used last
        if len(self.files) > _OPEN_FILES:
            self.files.pop(next(iter(self.files))).close()
        f.seek(int(s.offsets[i, j]))
        return f.read(int(s.sizes[i, j]))


class ShardStream(IterableDataset):
    """`samples[k]` for the samples k of a `ShardIndex` (`samples` a map-style dataset over the index's samples,
    such as `ShardImages`), in the order described at the top of this module: the shared loop's `Stream`.
    Each sample is read with the generators seeded from (seed, epoch, k), for augmentation."""

    def __init__(self, samples: Dataset, index: ShardIndex, *, seed: int = 0):
        if len(samples) != len(index):
            raise ValueError(f"{len(samples)} samples for an index of {len(index)}")
        self.samples, self.index, self.seed = samples, index, seed
        self.split(rank=0, world_size=1, batch_size=1)
        self.epoch, self.skip = 0, 0

    def split(self, *, rank: int, world_size: int, batch_size: int) -> None:
        shards = len(self.index.shards)
        if shards < world_size:
            raise ValueError(f"{shards} shard(s) in {self.index.pattern!r} for {world_size} processes: each process "
                             f"reads whole shards, so write at least {world_size} shards (or run fewer processes)")
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        starts = self.index.starts
        self.mine = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in range(rank, shards, world_size)])
        fewest = min(int(sum(starts[j + 1] - starts[j] for j in range(r, shards, world_size)))
                     for r in range(world_size))
        self.length = fewest // batch_size * batch_size  # the same on every rank: DDP steps in lockstep

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        assert skip % self.batch_size == 0, (skip, self.batch_size)
        self.epoch, self.skip = epoch, skip

    def __len__(self) -> int:
        return self.length

    def order(self, epoch: int) -> np.ndarray:
        """This rank's samples of `epoch`, in the order they are yielded."""
        g = torch.Generator().manual_seed(sample_seed(self.seed, epoch, self.rank) % 2**63)
        return self.mine[torch.randperm(len(self.mine), generator=g)[:self.length].numpy()]

    def __iter__(self):
        worker = get_worker_info()
        workers, me = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        order = self.order(self.epoch)
        for position in range(self.skip, self.length):
            # batch b after the skip is worker b % workers's: the DataLoader asks its workers in turn from
            # worker 0 and yields their batches in that order, so they arrive in this order for any --workers
            if (position - self.skip) // self.batch_size % workers != me:
                continue
            k = int(order[position])
            with rng_restored():  # restored before the yield: the training step draws from its own stream
                seed_sample(sample_seed(self.seed, self.epoch, k))
                example = self.samples[k]
            yield example


class _MemberFile(io.BytesIO):
    """A tar member's bytes, named "shard.tar:key.ext" in messages (open_image names what it cannot decode)."""

    def __init__(self, data: bytes, name: str):
        super().__init__(data)
        self.name = name

    def __str__(self):
        return self.name


class ShardImages(Dataset):
    """The (image, class id) samples of image shards (IMAGE_FIELDS + cls) as a map-style dataset, as
    `ImageFiles` is for a folder: each image goes through `open_image` (any mode, EXIF orientation) to a uint8
    (C, H, W) tensor, then `transform`. `classes` is the number of classes (the largest cls + 1)."""

    FIELDS = {"image": IMAGE_FIELDS, "label": ("cls",)}

    def __init__(self, index: ShardIndex, transform=None):
        self.index, self.transform = index, transform
        self.labels = [_class_id(v, index) for v in index.values("label")]
        self.classes = max(self.labels) + 1

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k: int):
        from zoo.data.images import open_image
        sample = self.index.sample(k)
        name = f"{sample['__shard__']}:{sample['__key__']}"
        x = torch.from_numpy(np.array(open_image(_MemberFile(sample["image"], name)))).permute(2, 0, 1)
        return (self.transform(x) if self.transform else x), self.labels[k]


def _class_id(value: bytes, index: ShardIndex) -> int:
    text = value.decode("utf-8", "replace").strip()
    if not text.isdigit():
        raise ValueError(f"a .cls of {index.pattern!r} holds {text[:20]!r}; it holds the class id, an integer >= 0")
    return int(text)


class TextShards(Dataset):
    """The (text, raw label) samples of text shards (txt + cls) as a map-style dataset with `TextTable`'s
    interface (`labels` summarises the labels, `path` names the data), so bert_cls reads them as it reads a
    table."""

    FIELDS = {"text": ("txt",), "label": ("cls",)}

    def __init__(self, index: ShardIndex):
        from zoo.data.tables import LabelSummary
        self.index, self.path = index, index.pattern
        self.raw_labels = [v.decode("utf-8").strip() for v in index.values("label")]
        self.labels = LabelSummary.of(self.raw_labels, source=f"the .cls of {index.pattern}")

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k: int):
        return self.index.sample(k)["text"].decode("utf-8").strip(), self.raw_labels[k]


def image_shards(pattern: str, *, eval_pattern: str | None = None):
    """(training ShardImages, evaluation ShardImages or None, class names "0".."K-1") of image shards; the
    evaluation set from `eval_pattern` (shards too), else none: shards have no held-out split to take."""
    train = ShardImages(ShardIndex(pattern, ShardImages.FIELDS))
    held = None
    if eval_pattern is None:
        log.info("%s: no --eval-data shards given, so no evaluation (shards hold no held-out split)", pattern)
    elif not is_shard_pattern(eval_pattern):
        raise ValueError(f"--eval-data {eval_pattern!r}: with shards as --data, give the held-out set as shards "
                         "too, e.g. 'shards/val-{000000..000003}.tar'")
    else:
        held = ShardImages(ShardIndex(eval_pattern, ShardImages.FIELDS))
        if held.classes > train.classes:
            raise ValueError(f"{eval_pattern!r} holds class id {held.classes - 1} but the training shards only "
                             f"0..{train.classes - 1}")
    log.info("%s: %d samples in %d shard(s), %d classes", pattern, len(train), len(train.index.shards),
             train.classes)
    return train, held, [str(i) for i in range(train.classes)]
