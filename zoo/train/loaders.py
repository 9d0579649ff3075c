"""The data side of the training loop: one rank's training batches (shuffled per epoch, resumable mid-epoch,
each sample's augmentation seeded) and its shard of the evaluation data."""
from __future__ import annotations

import itertools
import math
import os
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from zoo.data.seeding import SeededSamples
from zoo.train.config import TrainConfig
from zoo.train.distributed import DistContext

if TYPE_CHECKING:
    from zoo.train.trainer import Task

__all__ = ["TrainBatches", "eval_batches", "to_device", "default_workers"]


def default_workers(world_size: int) -> int:
    # On a 2-core machine worker processes only steal cycles from the math; elsewhere leave one core free.
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_process = cpus // max(1, world_size)
    return 0 if per_process <= 2 else min(8, per_process - 1)


def to_device(batch, device):
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def loader_options(task: Task, workers: int, device: torch.device, prefetch_factor: int | None = None) -> dict:
    # pinned host memory makes the copies to the GPU asynchronous (non_blocking in to_device); workers
    # persist across epochs, so an epoch does not start by forking and importing again
    opts = {"num_workers": workers, "collate_fn": task.collate, "pin_memory": device.type == "cuda"}
    if workers > 0:
        opts.update(persistent_workers=True, prefetch_factor=prefetch_factor)
    return opts


class _ResumableBatches:
    """A batch sampler that can skip the batches already consumed in this epoch (exact resume), yielding each
    index as the key (epoch, index) that `SeededSamples` seeds the sample's augmentation from."""

    def __init__(self, batches):
        self.batches, self.skip, self.epoch = batches, 0, 0

    def __iter__(self):
        for batch in itertools.islice(iter(self.batches), self.skip, None):
            yield [(self.epoch, i) for i in batch]

    def __len__(self):
        return len(self.batches) - self.skip


class TrainBatches:
    """This rank's training loader (`.loader`); `start_epoch` sets an epoch's order, after the batches of it
    already consumed. A map-style dataset is shuffled by a DistributedSampler (also for one process: one code
    path, and set_epoch reshuffles reproducibly); an iterable one splits itself (see `Stream`)."""

    def __init__(self, task: Task, cfg: TrainConfig, ctx: DistContext, workers: int):
        self.task, self.batch_size = task, cfg.batch_size
        options = loader_options(task, workers, ctx.device, cfg.prefetch_factor)
        self.is_stream = isinstance(task.train_data, IterableDataset)
        if self.is_stream:
            self.loader = self._stream_loader(ctx, options)
            return
        self.sampler = DistributedSampler(task.train_data, num_replicas=ctx.world_size, rank=ctx.rank,
                                          shuffle=True, seed=cfg.seed, drop_last=True)
        if task.batch_sampler is not None:
            batches = task.batch_sampler(self.sampler, cfg.batch_size)
        else:
            batches = torch.utils.data.BatchSampler(self.sampler, cfg.batch_size, drop_last=True)
        self.batches = _ResumableBatches(batches)
        # Each sample's augmentation is seeded from (seed, epoch, index), so it is the same in any worker, for
        # any --workers and after a resume. The loader draws its workers' base seed (unused by the data now)
        # whenever an iterator starts, also mid-epoch after a resume: from its own generator, that draw does
        # not shift the global RNG that dropout uses.
        self.loader = DataLoader(SeededSamples(task.train_data, cfg.seed), batch_sampler=self.batches,
                                 generator=torch.Generator(), **options)

    def _stream_loader(self, ctx: DistContext, options: dict) -> DataLoader:
        """An iterable training set splits itself across the ranks (no DistributedSampler), says how many
        examples each rank yields per epoch, and resumes by skipping the ones consumed; see `Stream`."""
        stream = self.task.train_data
        missing = [name for name in ("split", "set_epoch", "__len__") if not hasattr(stream, name)]
        if missing:
            raise ValueError(f"the iterable training dataset {type(stream).__name__} has no {', '.join(missing)}: "
                             "zoo.train splits, counts and resumes a stream through them (see "
                             "zoo.data.shards.ShardStream), or give a map-style dataset")
        stream.split(rank=ctx.rank, world_size=ctx.world_size, batch_size=self.batch_size)
        # not persistent: each epoch's workers start after set_epoch, holding the epoch and the skip
        return DataLoader(stream, batch_size=self.batch_size, drop_last=True, generator=torch.Generator(),
                          **{**options, "persistent_workers": False})

    def start_epoch(self, epoch: int, batch_in_epoch: int) -> None:
        if self.is_stream:
            self.task.train_data.set_epoch(epoch, skip=batch_in_epoch * self.batch_size)
        else:
            self.sampler.set_epoch(epoch)
            self.batches.epoch, self.batches.skip = epoch, batch_in_epoch


def eval_batches(task: Task, cfg: TrainConfig, ctx: DistContext, workers: int) -> Iterable[tuple[Any, bool]]:
    """(batch, counted): this rank's shard of the evaluation data (every example once, no padding), then
    uncounted repeats of the data's first batch until every rank has run as many batches as rank 0,
    which holds the largest shard. A rank with fewer examples, or none (fewer examples than processes),
    so still takes part in each forward pass that FSDP gathers weights for, and its sums get the keys
    and shapes of the others'."""
    data = task.eval_data
    if len(data) == 0:
        raise ValueError("the evaluation data is empty; give held-out examples or no evaluation set")
    size = task.eval_batch_size or cfg.batch_size
    loader = DataLoader(data, batch_size=size, sampler=range(ctx.rank, len(data), ctx.world_size),
                        **loader_options(task, workers, ctx.device, cfg.prefetch_factor))
    yield from ((batch, True) for batch in loader)
    missing = math.ceil(math.ceil(len(data) / ctx.world_size) / size) - len(loader)
    if missing > 0:
        first = next(iter(DataLoader(data, batch_size=size, sampler=range(min(size, len(data))),
                                     collate_fn=task.collate)))
        for _ in range(missing):
            yield first, False
