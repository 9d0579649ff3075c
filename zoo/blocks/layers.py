"""Small layers shared by several families."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["RMSNorm", "SwiGLU", "DropPath"]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 so bf16/fp16 autocast does not lose the statistics."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    """SiLU-gated MLP (Shazeer 2020): proj(silu(x W1) * x W3), gate and up projections fused."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.up = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.dropout(self.down(F.silu(gate) * up))


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample with probability `p` while training."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep
