"""Sliding-window inference for inputs larger than what fits: any predictor, any number of spatial dims.

    out = sliding_window_inference(model, volume, window=(96, 96, 96), overlap=0.5, blend="gaussian",
                                   batch_size=4, device="cuda")   # output gathered on the CPU

Input (B, C, *spatial); the predictor maps (N, C, *window) -> (N, K, *window). Inputs smaller than the
window are padded and the output cropped back; where one window covers the whole input the result is
exactly the direct forward pass.
"""
from __future__ import annotations

import itertools
from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sliding_window_inference", "window_starts", "gaussian_importance"]


def window_starts(size: int, window: int, overlap: float) -> list[int]:
    """Start offsets covering [0, size) with windows of `window`, the last one flush with the end."""
    if size <= window:
        return [0]
    step = max(1, int(window * (1 - overlap)))
    starts = list(range(0, size - window + 1, step))
    if starts[-1] != size - window:
        starts.append(size - window)
    return starts


def gaussian_importance(window: Sequence[int], sigma_scale: float = 0.125) -> Tensor:
    """Weights peaking at the window centre (sigma = sigma_scale * window), so overlaps blend smoothly."""
    axes = []
    for n in window:
        x = torch.arange(n, dtype=torch.float32) - (n - 1) / 2
        axes.append(torch.exp(-0.5 * (x / max(sigma_scale * n, 1e-6)) ** 2))
    w = axes[0]
    for a in axes[1:]:
        w = w[..., None] * a
    w = w / w.max()
    return w.clamp(min=1e-3)  # never exactly zero: every voxel keeps a defined weight


@torch.no_grad()
def sliding_window_inference(predictor: Callable[[Tensor], Tensor], inputs: Tensor, window: Sequence[int], *,
                             overlap: float = 0.25, blend: Literal["gaussian", "constant"] = "gaussian",
                             batch_size: int = 4, device: str | torch.device | None = None,
                             out_device: str | torch.device = "cpu", pad_value: float = 0.0) -> Tensor:
    """Run `predictor` over overlapping windows of `inputs` (B, C, *spatial) and blend the outputs."""
    spatial = inputs.shape[2:]
    window = tuple(int(w) for w in window)
    if len(window) != len(spatial):
        raise ValueError(f"window {window} has {len(window)} dims but the input has {len(spatial)} spatial dims "
                         f"(input shape {tuple(inputs.shape)}: expected (batch, channels, *spatial))")
    if not 0 <= overlap < 1:
        raise ValueError(f"overlap must be in [0, 1), got {overlap}")
    if blend not in ("gaussian", "constant"):
        raise ValueError(f"blend must be gaussian or constant, got {blend!r}")
    device = torch.device(device) if device is not None else inputs.device
    # pad dims smaller than the window at the far end; cropped back at the end
    pads = [max(0, w - s) for w, s in zip(window, spatial)]
    if any(pads):
        flat = [p for pad in reversed(pads) for p in (0, pad)]
        inputs = F.pad(inputs, flat, value=pad_value)
    size = inputs.shape[2:]
    starts = [window_starts(s, w, overlap) for s, w in zip(size, window)]
    corners = list(itertools.product(*starts))
    importance = (gaussian_importance(window) if blend == "gaussian" else torch.ones(window)).to(out_device)
    output = weights = None
    for b in range(inputs.shape[0]):
        for first in range(0, len(corners), batch_size):
            chunk = corners[first:first + batch_size]
            crops = torch.stack([inputs[b][(slice(None), *(slice(c, c + w) for c, w in zip(corner, window)))]
                                 for corner in chunk]).to(device)
            pred = predictor(crops).to(out_device, torch.float32)  # (n, K, *window)
            if output is None:
                output = torch.zeros((inputs.shape[0], pred.shape[1], *size), device=out_device)
                weights = torch.zeros(size, device=out_device)
            for corner, p in zip(chunk, pred):
                region = tuple(slice(c, c + w) for c, w in zip(corner, window))
                output[(b, slice(None), *region)] += p * importance
                if b == 0:
                    weights[region] += importance
    output = output / weights
    return output[(slice(None), slice(None), *(slice(0, s) for s in spatial))]
