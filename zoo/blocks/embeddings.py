"""Embeddings shared by the families."""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["timestep_embedding"]


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding of (possibly fractional) timesteps, (B,) -> (B, dim), as in the Transformer and DDPM."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None]  # (B, half)
    emb = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return torch.nn.functional.pad(emb, (0, dim % 2))
