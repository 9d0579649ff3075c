"""Parameters by depth: layer-wise learning-rate decay (--layer-decay) and progressive unfreezing (--unfreeze).

A family lists its parts from the input up with `depth_groups()` (zoo.models.base), the task head last.
A group's depth is its distance below the head: the head is 0, the part just under it 1, and so on.

    --layer-decay D      a group of depth d trains at lr * D**d (ELECTRA/BEiT; 1 = off)
    --unfreeze SPEC      e.g. "head@0,top:2@300,all@1000": from step 0 only the head trains, from step 300
                         also the 2 groups under it, from step 1000 everything (ULMFiT's gradual unfreezing)

A frozen group gets learning rate 0 and no gradient at the optimiser step (so no weight decay, no Adam
state, no share of the clipping norm), and its BatchNorm layers keep their running statistics (eval mode).
It still runs backward: that keeps DDP's and FSDP's gradient reduction the same at every step.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

__all__ = ["depth_param_groups", "Unfreezing"]


def depth_param_groups(model: nn.Module, lr: float, weight_decay: float, layer_decay: float = 1.0) -> list[dict]:
    """Optimiser groups, one or two per depth group (with / without weight decay; none on norms, biases and
    embedding tables), each with its `depth` and `lr = lr * layer_decay ** depth`."""
    parts = model.depth_groups()
    seen: set[int] = set()
    groups = []
    for index, (name, modules) in enumerate(parts):
        depth = len(parts) - 1 - index
        decay, no_decay = [], []
        for module in modules:
            for sub in module.modules():
                for p in sub.parameters(recurse=False):
                    if not p.requires_grad or id(p) in seen:
                        continue
                    seen.add(id(p))
                    (decay if p.dim() >= 2 and not isinstance(sub, nn.Embedding) else no_decay).append(p)
        for params, wd in ((decay, weight_decay), (no_decay, 0.0)):
            if params:
                groups.append({"params": params, "lr": lr * layer_decay ** depth, "weight_decay": wd,
                               "depth": depth, "name": name})
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise TypeError(f"{type(model).__name__}.depth_groups() leaves out {', '.join(missing[:5])}"
                        f"{' ...' if len(missing) > 5 else ''}: every parameter must be in one group")
    return groups


_STAGE = re.compile(r"^(head|all|top:(\d+))@(\d+)$")


@dataclass(frozen=True)
class Unfreezing:
    """When each depth trains: `stages` are (first step, deepest trainable depth, None for all)."""
    spec: str
    stages: tuple[tuple[int, int | None], ...]

    @classmethod
    def parse(cls, spec: str) -> "Unfreezing":
        stages = []
        for part in spec.replace(" ", "").split(","):
            m = _STAGE.match(part)
            if not m:
                raise ValueError(f"--unfreeze {spec!r}: {part!r} is not head@STEP, top:K@STEP or all@STEP "
                                 "(e.g. head@0,top:2@300,all@1000)")
            depth = 0 if m.group(1) == "head" else None if m.group(1) == "all" else int(m.group(2))
            stages.append((int(m.group(3)), depth))
        steps = [s for s, _ in stages]
        if steps[0] != 0:
            raise ValueError(f"--unfreeze {spec!r}: the first stage starts at step 0 (say what trains first)")
        if steps != sorted(set(steps)):
            raise ValueError(f"--unfreeze {spec!r}: stages must start at increasing steps")
        return cls(spec, tuple(stages))

    def deepest(self, step: int) -> int | None:
        """The deepest trainable depth at `step` (None: all)."""
        return [d for start, d in self.stages if start <= step][-1]

    def trains(self, depth: int, step: int) -> bool:
        deepest = self.deepest(step)
        return deepest is None or depth <= deepest

    def starts_a_stage(self, step: int) -> bool:
        return any(start == step for start, _ in self.stages)
