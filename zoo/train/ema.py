"""Exponential moving average of the weights, swapped in for evaluation and saving."""
from __future__ import annotations

import contextlib

import torch
from torch import nn


class EMA:
    """Shadow copies of the parameters; works on plain, DDP and FSDP2 (DTensor) parameters alike."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().clone() for p in self.params]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        # warm-up (as in timm/TF): early averages follow the fast-moving weights more closely
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - decay)

    @contextlib.contextmanager
    def swapped(self):
        """Inside, the model's parameters hold the EMA weights."""
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                tmp = p.detach().clone()
                p.copy_(s)
                s.copy_(tmp)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, self.shadow):
                    tmp = p.detach().clone()
                    p.copy_(s)
                    s.copy_(tmp)

    def state_dict(self) -> dict:
        return {"updates": torch.tensor(self.updates), **dict(zip(self.names, self.shadow))}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        with torch.no_grad():
            for name, s in zip(self.names, self.shadow):
                s.copy_(state[name])
