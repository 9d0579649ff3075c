"""Activation checkpointing by wrapping blocks (not by `if`s in forward): one helper for every model.

    zoo.accel.checkpointing(model, "blocks")         # every block of model.checkpoint_blocks
    zoo.accel.checkpointing(model, "every_k", k=2)   # every 2nd block
    zoo.accel.checkpointing(model, lambda m: isinstance(m, ResBlock3d))
    zoo.accel.checkpointing(model, "selective")      # save matmul/conv outputs, recompute pointwise ops
    zoo.accel.checkpointing(model, "none")           # undo

A chosen block's `forward` is wrapped on the instance, so the module tree and the state-dict keys
stay exactly as they were (checkpoints, DDP/FSDP and torch.distributed.checkpoint see no change).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpointing", "checkpointed_modules", "POLICIES"]

POLICIES = ("none", "blocks", "every_k", "selective")
_MARK = "_zoo_checkpoint"


def _save_compute_heavy():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    # Outputs of these are expensive to recompute; everything else (activations, norms, adds) is cheap.
    heavy = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_flash_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in heavy else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _wrap(module: nn.Module, selective: bool) -> None:
    plain_forward = type(module).forward.__get__(module)

    @functools.wraps(plain_forward)
    def forward(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return plain_forward(*args, **kwargs)
        extra = {"context_fn": _save_compute_heavy()} if selective else {}
        return checkpoint(plain_forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward
    setattr(module, _MARK, "selective" if selective else "full")


def _unwrap(module: nn.Module) -> None:
    if hasattr(module, _MARK):
        del module.forward
        delattr(module, _MARK)


def checkpointed_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, _MARK)]


def _block_list(model: nn.Module) -> list[nn.Module]:
    from zoo.models.base import ZooModel
    if not isinstance(model, ZooModel):
        raise ValueError(f"{type(model).__name__} is not a zoo model, so it does not list its blocks "
                         "(ZooModel.checkpoint_blocks); pass a callable policy such as "
                         "lambda m: isinstance(m, MyBlock)")
    return list(model.checkpoint_blocks)


def checkpointing(model: nn.Module, policy: str | Callable[[nn.Module], bool] = "blocks", *, k: int = 2) -> nn.Module:
    """Apply an activation-checkpointing policy in place (replacing any earlier one); returns the model.

    Gradients are identical to the plain model's: only what is kept for backward changes.
    """
    from zoo.models.base import unwrap
    model = unwrap(model)
    for m in model.modules():
        _unwrap(m)
    if policy == "none":
        return model
    if callable(policy):
        chosen, selective = [m for m in model.modules() if m is not model and policy(m)], False
        # a module inside an already chosen one would be checkpointed twice
        inner = {id(d) for m in chosen for d in m.modules() if d is not m}
        chosen = [m for m in chosen if id(m) not in inner]
    elif policy in ("blocks", "selective"):
        chosen, selective = _block_list(model), policy == "selective"
    elif policy == "every_k":
        if k < 1:
            raise ValueError(f"every_k needs k >= 1, got {k}")
        chosen, selective = _block_list(model)[::k], False
    else:
        raise ValueError(f"unknown checkpointing policy {policy!r}; choose {', '.join(POLICIES)} or a callable")
    if not chosen:
        raise ValueError(f"checkpointing policy {policy!r} selected no module of {type(model).__name__}")
    for m in chosen:
        _wrap(m, selective)
    return model
