"""Test-time augmentation by flips: a prediction averaged over flipped copies of the input.

    logits = average_over_flips(model, images, [(), (-1,)])                                 # image + mirror
    probs = average_over_flips(predict_probs, volume, all_flips((-3, -2, -1)), spatial=True)   # 8 flips
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from torch import Tensor

__all__ = ["TTA_MODES", "check_tta", "all_flips", "average_over_flips"]

TTA_MODES = ("none", "flip")


def check_tta(tta: str) -> str:
    if tta not in TTA_MODES:
        raise ValueError(f"tta {tta!r} is not one of {', '.join(TTA_MODES)} (--tta flip averages over flips)")
    return tta


def all_flips(dims: Sequence[int]) -> list[tuple[int, ...]]:
    """Every subset of `dims`, the empty one (the input as it is) first: 2 ** len(dims) flips."""
    return [combo for n in range(len(dims) + 1) for combo in itertools.combinations(dims, n)]


def average_over_flips(predict: Callable[[Tensor], Tensor], x: Tensor, flips: Sequence[tuple[int, ...]], *,
                       spatial: bool = False) -> Tensor:
    """The mean of `predict` over `x` flipped along each tuple of dims in `flips` (() is `x` itself).
    `spatial`: the prediction is laid out like `x` on the flipped dims (a segmentation), so each is flipped
    back before the mean; otherwise (class logits) it is averaged as it is."""
    total = None
    for dims in flips:
        y = predict(x.flip(dims) if dims else x)
        if spatial and dims:
            y = y.flip(dims)
        total = y if total is None else total + y
    return total / len(flips)
