"""Process groups and model wrapping for DDP and FSDP2 under torchrun (gloo on CPU, NCCL on CUDA)."""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

from zoo.models.base import ZooModel

__all__ = ["DistContext", "init_distributed", "fingerprint"]


@torch.no_grad()
def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Three float64 numbers that change when an element of any tensor changes: the sum of all elements,
    their sum weighted by position inside each tensor, and the tensor sums weighted by the tensor's place.
    Equal weights give equal bits, so replicas can be compared exactly."""
    total = weighted = ordered = torch.zeros((), dtype=torch.float64)
    for i, t in enumerate(tensors, start=1):
        flat = t.detach().double().flatten().cpu()
        position = torch.arange(1, flat.numel() + 1, dtype=torch.float64) / flat.numel()
        total = total + flat.sum()
        weighted = weighted + (flat * position).sum()
        ordered = ordered + i * flat.sum()
    return torch.stack([total, weighted, ordered])


class DistContext:
    """Who we are in the job; a single process is rank 0 of 1."""

    def __init__(self, mode: str, device: torch.device, rank: int = 0, world_size: int = 1, local_rank: int = 0):
        self.mode, self.device = mode, device
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            t = t.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t`, stacked in rank order on the CPU: (world_size, *t.shape)."""
        if not self.enabled:
            return t[None].cpu()
        t = t.to(self.device)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        return torch.stack(parts).cpu()

    def wrap(self, model: ZooModel, *, param_dtype: torch.dtype | None = None,
             reduce_dtype: torch.dtype | None = None, offload: bool = False) -> nn.Module:
        """DDP wraps the model; FSDP2 shards each of its `checkpoint_blocks`, then the root (parameters
        become DTensors, the model object stays the same). For FSDP, `param_dtype` / `reduce_dtype` are its
        MixedPrecisionPolicy (the shards stay fp32), `offload` its CPUOffloadPolicy."""
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids)
        if self.mode == "fsdp":
            try:
                from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
            except ImportError:  # torch 2.5 keeps FSDP2 under _composable
                from torch.distributed._composable.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                                OffloadPolicy, fully_shard)
            options = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                       # pinned host memory only helps (and only exists) with a GPU to copy to
                       "offload_policy": CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if offload
                       else OffloadPolicy()}
            for block in model.checkpoint_blocks:
                fully_shard(block, **options)
            fully_shard(model, **options)
        return model

    def no_sync(self, model: nn.Module):
        """Skip the gradient all-reduce on micro-batches that only accumulate."""
        if self.mode == "ddp":
            return model.no_sync()
        if self.mode == "fsdp":
            return _fsdp_no_sync(model)
        return contextlib.nullcontext()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def pick_device(spec: str, local_rank: int = 0) -> torch.device:
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec} asked for CUDA, but no CUDA device is available; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def init_distributed(mode: str, device_spec: str = "auto") -> DistContext:
    """Join the torchrun job for --dist ddp|fsdp; a clear error when not launched by torchrun."""
    if mode == "none":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("launched with several processes but --dist none: pass --dist ddp or --dist fsdp")
        return DistContext("none", pick_device(device_spec))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(f"--dist {mode} needs torchrun to start the processes, e.g. "
                           f"`torchrun --nproc_per_node=2 train_scripts/<family>.py --dist {mode} ...`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_spec, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        # Under torchrun --max-restarts the workers of every restart meet in the agent's one store, where the
        # previous attempt's process-group keys are still there: a worker of the new attempt can read its dead
        # peer's address and fail with gloo's "connectFullMesh failed ... Connection refused" (seen in 2 of 5
        # trials). A prefix per attempt gives each its own keys.
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"zoo/attempt_{attempt}", store), rank=rank,
                                world_size=world, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
    return DistContext(mode, device, rank, world, local_rank)
