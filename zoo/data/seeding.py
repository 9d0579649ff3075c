"""Each training sample's randomness as a function of (seed, epoch, sample), not of the process that reads it.

A DataLoader worker's random stream is seeded once and then advances with every sample that worker
transforms, so which augmentation a sample gets depends on the number of workers and on which worker read
it. After a resume, which skips the batches already consumed, the workers hand out the remaining batches
in another order, and the run no longer repeats the uninterrupted one. Seeding torch, NumPy and `random`
from the sample's own key before each sample makes its augmentation the same in any process, for any
number of workers, before and after a resume.
"""
from __future__ import annotations

import contextlib
import hashlib
import random

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["sample_seed", "seed_sample", "rng_restored", "SeededSamples"]


def sample_seed(*key: int | str) -> int:
    """A 64-bit seed from a sample's key, well mixed: neighbouring keys give unrelated streams (NumPy's
    legacy seed keeps 32 bits, which for `seed * K + index` would repeat across epochs)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def seed_sample(seed: int) -> None:
    """Seed the generators that transforms draw from: torch's CPU generator (torchvision), NumPy's global one
    and Python's `random`. CUDA's generators are left alone: transforms run on the CPU."""
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@contextlib.contextmanager
def rng_restored():
    """The caller's torch (CPU), NumPy and `random` states are back on exit: reading samples in the main
    process (`--workers 0`) leaves the stream that dropout draws from where it was."""
    saved = torch.default_generator.get_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


class SeededSamples(Dataset):
    """A map-style dataset read by keys (epoch, index): item `index` of `dataset`, transformed with every
    generator seeded from (seed, epoch, index). The DataLoader hands a batch's keys to `__getitems__`, so
    the caller's random state is saved and restored once per batch, not per sample."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        with rng_restored():
            samples = []
            for epoch, index in keys:
                seed_sample(sample_seed(self.seed, epoch, index))
                samples.append(self.dataset[index])
            return samples
