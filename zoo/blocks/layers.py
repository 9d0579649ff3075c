"""Small layers shared by several families."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["RMSNorm", "SwiGLU", "Dropout", "DropPath"]


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
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.dropout(self.down(F.silu(gate) * up))


class Dropout(nn.Dropout):
    """nn.Dropout with a cheaper CPU training path: each element's keep mask compares 16 random bits with
    a threshold. aten's Bernoulli sample cost 13-22 ms per (32, 128, 384) tensor on this CPU, and inductor's
    own random numbers as much (compiled BERT training was slower than eager); this takes 5-7 ms, and BERT's
    14 dropouts had been a quarter of its training step.

    The drop probability is rounded to a multiple of 2^-16 (0.1 -> 0.100006; CUDA's kernel rounds to
    2^-24) and kept elements are scaled by 1/(1 - that p), so the expectation stays exactly the input.
    Eval mode, p = 0 and other devices take F.dropout. Draws from torch's global generator, so
    torch.manual_seed makes it repeat.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu":
            return super().forward(x)
        return _dropout_16bit(x, self.p)


def _dropout_16bit(x: Tensor, p: float) -> Tensor:
    dropped = round(p * 65536)  # of the 65536 values a 16-bit lane takes, this many drop the element
    if dropped >= 65536:
        return x * 0  # what F.dropout returns for p = 1
    n = x.numel()
    # 64 random bits per word, four int16 lanes each (plain random_() would leave the sign bit 0). Compiled
    # graphs need the out-of-place randint, whose range stops one short of 2^63 - 1: a 2^-64 bias.
    if torch.compiler.is_compiling():
        words = torch.randint(-2 ** 63, 2 ** 63 - 1, ((n + 3) // 4,), dtype=torch.int64)
    else:
        words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-2 ** 63, None)
    lanes = words.view(torch.int16)[:n].view(x.shape)
    keep = lanes >= dropped - 32768
    return x * (keep.to(x.dtype) * (65536 / (65536 - dropped)))


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
