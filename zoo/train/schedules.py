"""Learning-rate schedules: a factor of the peak rate for each optimiser step.

Every schedule warms up linearly over `warmup` steps, then:
    cosine    half a cosine from 1 down to `min_ratio` at the last step
    linear    a straight line from 1 down to `min_ratio`
    constant  1 to the end
    wsd       warm-up, stable, decay: 1 until the last `decay_fraction` of the steps, then a straight line
              to `min_ratio` (a run can be extended from a stable-phase checkpoint without a restart bump)
"""
from __future__ import annotations

import math
from typing import Callable

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def lr_schedule(name: str, warmup: int, total: int, min_ratio: float,
                decay_fraction: float = 0.2) -> Callable[[int], float]:
    """The factor for step `step` (0-based, the step about to be taken)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    decay_start = max(warmup, total - round(decay_fraction * total)) if name == "wsd" else warmup

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if name == "constant" or step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
        if name == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1 - (1 - min_ratio) * progress  # linear, and wsd's decay phase
    return factor
