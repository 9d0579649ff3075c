"""unet3d_seg: a 3D UNet for volumetric segmentation whose depth is a config choice.

Levels of residual conv blocks, strided-conv or pooling down, transposed-conv or trilinear up,
instance/group/batch norm, optional deep supervision. Activation checkpointing comes from
`zoo.accel.checkpointing` (config field `checkpointing`); large volumes go through
`zoo.blocks.sliding_window.sliding_window_inference` (`model.predict_volume`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.models.base import BATCH, Dynamic, ExportGraph, ZooModel, check_config
from zoo.registry import register_model

__all__ = ["UNet3dConfig", "UNet3d", "ResBlock3d", "dice_ce_loss", "dice_per_class"]

PRESETS = {
    # name: (channels per level, residual blocks per level)
    "small": ((8, 16, 32), 1),
    "base": ((16, 32, 64, 128), 2),
    "deep": ((16, 32, 64, 128, 256), 3),  # 3 blocks x 2 convs x 9 levels + down/up/skip/head convs = 72 conv layers
}


@dataclass(frozen=True)
class UNet3dConfig:
    preset: str = "base"  # fills channels and blocks when they are left as None
    channels: tuple[int, ...] | None = None
    blocks: int | None = None  # residual blocks per level, encoder and decoder
    in_chans: int = 1
    num_classes: int = 3  # including background 0
    norm: Literal["instance", "group", "batch"] = "instance"
    down: Literal["conv", "pool"] = "conv"
    up: Literal["transpose", "trilinear"] = "transpose"
    deep_supervision: bool = False  # also return coarser logits while training
    checkpointing: str = "none"  # a zoo.accel.checkpointing policy: none, blocks, every_k, selective

    def __post_init__(self):
        check_config(self, channels=">= 1", blocks=">= 1", in_chans=">= 1", num_classes=">= 1")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose {', '.join(PRESETS)}")
        channels, blocks = PRESETS[self.preset]
        if self.channels is None:
            object.__setattr__(self, "channels", channels)
        if self.blocks is None:
            object.__setattr__(self, "blocks", blocks)
        if self.norm not in ("instance", "group", "batch") or self.down not in ("conv", "pool") \
                or self.up not in ("transpose", "trilinear"):
            raise ValueError("norm must be instance|group|batch, down conv|pool, up transpose|trilinear")


def smallest_window(config: UNet3dConfig) -> int:
    """The smallest window (or training crop) side whose deepest feature map keeps 2 voxels per side (instance
    norm needs more than one)."""
    side = 2
    for _ in config.channels[1:]:
        side = 2 * side if config.down == "pool" else 2 * side - 1  # conv k3 s2 p1 gives ceil(side / 2)
    return side


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "instance":
        return nn.InstanceNorm3d(channels, affine=True)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    return nn.BatchNorm3d(channels)


class ResBlock3d(nn.Module):
    """conv-norm-act-conv-norm plus a (projected) skip, then act."""

    def __init__(self, cin: int, cout: int, norm: str):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv3d(cin, cout, 3, padding=1, bias=False), _norm(norm, cout)
        self.conv2, self.norm2 = nn.Conv3d(cout, cout, 3, padding=1, bias=False), _norm(norm, cout)
        self.skip = nn.Conv3d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        y = F.leaky_relu(self.norm1(self.conv1(x)), 0.01)
        return F.leaky_relu(self.norm2(self.conv2(y)) + self.skip(x), 0.01)


@register_model("unet3d_seg", config=UNet3dConfig,
                weights={"synthetic-random": "unet3d_seg.synthetic-random.safetensors",
                         "synthetic": "unet3d_seg.synthetic.safetensors"},
                default="synthetic-random",  # trained on randomised volumes: segments ones it has never seen
                description="Deep 3D UNet for volumetric segmentation (checkpointing, sliding-window inference)")
class UNet3d(ZooModel):
    """Residual 3D UNet."""
    head_prefixes = ("head.", "aux_heads.")
    variants = PRESETS
    bench_batch = 1

    def __init__(self, config: UNet3dConfig = UNet3dConfig()):
        super().__init__()
        self.config = c = config
        ch = c.channels
        self.encoder = nn.ModuleList()
        self.downs = nn.ModuleList()
        cin = c.in_chans
        for i, w in enumerate(ch):
            self.encoder.append(nn.Sequential(*(ResBlock3d(cin if j == 0 else w, w, c.norm) for j in range(c.blocks))))
            cin = w
            if i < len(ch) - 1:
                self.downs.append(nn.Conv3d(w, w, 2, stride=2) if c.down == "conv" else nn.MaxPool3d(2))
        self.ups, self.decoder = nn.ModuleList(), nn.ModuleList()
        for i in reversed(range(len(ch) - 1)):
            w = ch[i]
            self.ups.append(nn.ConvTranspose3d(cin, w, 2, stride=2) if c.up == "transpose" else
                            nn.Sequential(nn.Upsample(scale_factor=2.0, mode="trilinear"), nn.Conv3d(cin, w, 1)))
            self.decoder.append(nn.Sequential(*(ResBlock3d(2 * w if j == 0 else w, w, c.norm) for j in range(c.blocks))))
            cin = w
        self.head = nn.Conv3d(cin, c.num_classes, 1)
        # deep supervision: logits from the two coarser decoder levels too
        self.aux_heads = nn.ModuleList(nn.Conv3d(ch[i], c.num_classes, 1) for i in (1, 2)[: len(ch) - 2]) \
            if c.deep_supervision else nn.ModuleList()
        if c.checkpointing != "none":
            from zoo.accel.checkpointing import checkpointing
            checkpointing(self, c.checkpointing)

    @property
    def checkpoint_blocks(self) -> list[nn.Module]:
        return [b for level in (*self.encoder, *self.decoder) for b in level]

    @property
    def divisor(self) -> int:
        """Spatial sizes must be multiples of this (one halving per level below the top)."""
        return 2 ** (len(self.config.channels) - 1)

    def forward(self, x: Tensor) -> Tensor | list[Tensor]:
        """x (B, C, D, H, W) -> logits (B, K, D, H, W); odd sizes are padded and cropped back.
        With deep supervision in training mode: [full-resolution logits, coarser logits...]."""
        size = x.shape[2:]
        pad = [(-s) % self.divisor for s in size]
        if any(pad):
            x = F.pad(x, [p for d in reversed(pad) for p in (0, d)])
        skips = []
        for i, level in enumerate(self.encoder):
            x = level(x)
            if i < len(self.downs):
                skips.append(x)
                x = self.downs[i](x)
        aux = []
        for up, level in zip(self.ups, self.decoder):
            x = level(torch.cat([up(x), skips.pop()], dim=1))
            aux.append(x)
        logits = self.head(x)[(slice(None), slice(None), *(slice(0, s) for s in size))]
        if self.aux_heads and self.training:
            coarse = aux[::-1][1:1 + len(self.aux_heads)]  # decoder outputs at 1/2, 1/4 resolution
            return [logits] + [head(f) for head, f in zip(self.aux_heads, coarse)]
        return logits

    def reset_head(self, num_classes: int) -> None:
        self.head = nn.Conv3d(self.head.in_channels, num_classes, 1).to(self.head.weight.device)
        self.aux_heads = nn.ModuleList(nn.Conv3d(h.in_channels, num_classes, 1) for h in self.aux_heads)
        self.config = dataclasses.replace(self.config, num_classes=num_classes)

    def smallest_window(self) -> int:
        return smallest_window(self.config)

    @torch.no_grad()
    def predict_volume(self, volume: Tensor, *, window: int | tuple[int, int, int] = 64, overlap: float = 0.25,
                       blend: str = "gaussian", batch_size: int = 2, device=None, tta: str = "none") -> Tensor:
        """Label volume (D, H, W) for an image (C, D, H, W) of any size, by sliding-window inference.
        tta="flip" averages the class probabilities over the 8 flips of the three spatial axes (8 passes)."""
        from zoo.blocks.sliding_window import sliding_window_inference
        from zoo.blocks.tta import all_flips, average_over_flips, check_tta
        flips = all_flips((-3, -2, -1)) if check_tta(tta) == "flip" else [()]
        if volume.dim() != 4:
            raise ValueError(f"expected an image (channels, D, H, W); got shape {tuple(volume.shape)}")
        window = (window,) * 3 if isinstance(window, int) else tuple(window)
        smallest = self.smallest_window()
        if min(window) < smallest:
            raise ValueError(f"window {window} is too small for this model: its {len(self.config.channels) - 1} "
                             f"downsamplings need at least {smallest} voxels per side (give --window {smallest} "
                             "or more)")
        device = device or next(self.parameters()).device

        def scores(x: Tensor) -> Tensor:  # (1, K, D, H, W); probabilities to average, one pass's logits as they are
            logits = sliding_window_inference(self, x, window, overlap=overlap, blend=blend, batch_size=batch_size,
                                              device=device)
            return logits.softmax(1) if len(flips) > 1 else logits
        was_training = self.training
        self.eval()
        result = average_over_flips(scores, volume[None].float(), flips, spatial=True)
        self.train(was_training)
        return result[0].argmax(0)

    def example_inputs(self, batch: int = 1, size: int = 64) -> tuple[Tensor]:
        return (torch.randn(batch, self.config.in_chans, size, size, size, generator=torch.Generator().manual_seed(0)),)

    def export_graphs(self, batch: int = 2, size: int | None = None) -> dict[str, ExportGraph]:
        """The volume (B, C, D, H, W) with the batch and each side dynamic, sides in multiples of the total
        stride from the smallest window up (sides forward needs no padding for); traced at the weights'
        window, rounded up to a multiple."""
        meta = self.pretrained_meta
        step = self.divisor
        smallest = -(-self.smallest_window() // step) * step
        size = size or (meta.preprocessing.get("window") if meta else None) or 64
        size = max(smallest, -(-size // step) * step)
        sides = {d: Dynamic(name, min=smallest, multiple_of=step)
                 for d, name in enumerate(("depth", "height", "width"), start=2)}
        return {"model": ExportGraph(self, self.example_inputs(batch, size), ("volume",), ({0: BATCH, **sides},),
                                     ("logits",))}

    def example_loss(self, x: Tensor) -> Tensor:
        """Dice + CE against an all-background target: a fixed training step for benchmarks."""
        out = self(x)
        logits = out[0] if isinstance(out, list) else out
        background = torch.zeros(logits.shape[0], *logits.shape[2:], dtype=torch.long, device=logits.device)
        return dice_ce_loss(logits, background)


def dice_ce_loss(logits: Tensor, target: Tensor, *, dice_weight: float = 1.0, eps: float = 1e-5) -> Tensor:
    """Cross-entropy plus soft Dice over the foreground classes (batch Dice: empty classes do not blow up)."""
    ce = F.cross_entropy(logits.float(), target)
    probs = logits.float().softmax(1)
    onehot = F.one_hot(target, logits.shape[1]).movedim(-1, 1).float()
    dims = (0, *range(2, logits.dim()))
    inter = (probs * onehot).sum(dims)[1:]
    denom = (probs + onehot).sum(dims)[1:]
    dice = (2 * inter + eps) / (denom + eps)
    return ce + dice_weight * (1 - dice.mean())


def dice_per_class(pred: Tensor, target: Tensor, num_classes: int) -> dict[int, float]:
    """Hard Dice per foreground class; a class absent from both prediction and target is left out
    (not counted as 1 or 0); absent from the target but predicted scores 0."""
    scores = {}
    for c in range(1, num_classes):
        p, t = pred == c, target == c
        total = int(p.sum() + t.sum())
        if total == 0:
            continue
        scores[c] = 2 * int((p & t).sum()) / total
    return scores
