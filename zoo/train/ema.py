"""Exponential moving average of the weights, swapped in for evaluation and saving."""
from __future__ import annotations

import contextlib

import torch
from torch import nn


class EMA:
    """Shadow copies of the trainable parameters and of the floating-point buffers the state dict holds
    (BatchNorm's running mean and variance), as timm's ModelEmaV3 keeps them: a BatchNorm net evaluated with
    the averaged weights must also normalise with averaged statistics, not with those of the live weights'
    activations. Works on plain, DDP and FSDP2 (DTensor) parameters alike."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        persistent = set(model.state_dict())  # non-persistent buffers (caches rebuilt on the fly) stay live
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        named += [(n, b) for n, b in model.named_buffers() if b.is_floating_point() and n in persistent]
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]  # the parameters first, then the buffers
        self.buffer_names = {n for n, t in named if not isinstance(t, nn.Parameter)}
        self.shadow = [t.detach().clone() for t in self.tensors]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        # warm-up (as in timm/TF): early averages follow the fast-moving weights more closely
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.shadow, [t.detach() for t in self.tensors], 1.0 - decay)

    @torch.no_grad()
    def reset_to_live(self) -> None:
        """Make the averages the model's current tensors (after loading other weights into it)."""
        for s, t in zip(self.shadow, self.tensors):
            s.copy_(t)

    @contextlib.contextmanager
    def swapped(self):
        """Inside, the model's parameters and BatchNorm statistics hold the averages."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for t, s in zip(self.tensors, self.shadow):
            tmp = t.detach().clone()
            t.copy_(s)
            s.copy_(tmp)

    def state_dict(self) -> dict:
        return {"updates": torch.tensor(self.updates), **dict(zip(self.names, self.shadow))}

    def load_state_dict(self, state: dict) -> None:
        """`state` may lack the buffers (checkpoints written before the EMA kept them): those averages start
        from the model's loaded buffers."""
        missing = [n for n in self.names if n not in state and n not in self.buffer_names]
        if missing:
            raise KeyError(f"the EMA state lacks the averages of {', '.join(missing[:5])}"
                           f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}: it is another model's")
        self.updates = int(state["updates"])
        with torch.no_grad():
            for name, s, t in zip(self.names, self.shadow, self.tensors):
                s.copy_(state[name] if name in state else t)
