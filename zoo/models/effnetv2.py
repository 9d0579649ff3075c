"""effnetv2_cls: EfficientNetV2 (Tan & Le, 2021) image classifier, variants b0-b3 and s/m/l.

Stages are typed rows that read like Table 4 of the paper. Weights map both ways to torchvision's
EfficientNetV2 (s/m/l) with a shape check on every key, and the model follows the timm contract:
forward_features, forward_head(pre_logits), reset_head, forward_intermediates / features_only,
set_grad_checkpointing. `stem_stride=1` keeps resolution for small images such as 32x32.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from zoo.blocks.layers import DropPath, Dropout
from zoo.models.base import ZooModel
from zoo.registry import register_model

__all__ = ["EffNetV2Config", "EfficientNetV2", "Stage", "VARIANTS", "from_torchvision", "to_torchvision"]


@dataclass(frozen=True)
class Stage:
    """One row of the paper's Table 4."""
    block: Literal["fused", "mb"]  # Fused-MBConv (one k x k conv) or MBConv (1x1, depthwise k x k, SE)
    expand: int  # expansion ratio of the hidden width
    kernel: int
    stride: int  # of the stage's first block
    channels: int
    layers: int
    se: float  # squeeze-excitation width as a fraction of the block's input channels; 0 = none


@dataclass(frozen=True)
class Variant:
    stem: int
    stages: tuple[Stage, ...]
    head: int
    dropout: float


def _b(width: float, depth: float, dropout: float) -> Variant:
    """The B variants: the base table (EfficientNetV2-B0) scaled in width and depth (timm's recipe)."""
    base = (Stage("fused", 1, 3, 1, 16, 1, 0), Stage("fused", 4, 3, 2, 32, 2, 0), Stage("fused", 4, 3, 2, 48, 2, 0),
            Stage("mb", 4, 3, 2, 96, 3, 0.25), Stage("mb", 6, 3, 1, 112, 5, 0.25), Stage("mb", 6, 3, 2, 192, 8, 0.25))
    return Variant(_divisible(32 * width), tuple(dataclasses.replace(
        s, channels=_divisible(s.channels * width), layers=math.ceil(s.layers * depth)) for s in base),
        _divisible(1280 * width), dropout)


def _divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


VARIANTS: dict[str, Variant] = {
    "b0": _b(1.0, 1.0, 0.2), "b1": _b(1.0, 1.1, 0.2), "b2": _b(1.1, 1.2, 0.3), "b3": _b(1.2, 1.4, 0.3),
    "s": Variant(24, (Stage("fused", 1, 3, 1, 24, 2, 0), Stage("fused", 4, 3, 2, 48, 4, 0),
                      Stage("fused", 4, 3, 2, 64, 4, 0), Stage("mb", 4, 3, 2, 128, 6, 0.25),
                      Stage("mb", 6, 3, 1, 160, 9, 0.25), Stage("mb", 6, 3, 2, 256, 15, 0.25)), 1280, 0.2),
    "m": Variant(24, (Stage("fused", 1, 3, 1, 24, 3, 0), Stage("fused", 4, 3, 2, 48, 5, 0),
                      Stage("fused", 4, 3, 2, 80, 5, 0), Stage("mb", 4, 3, 2, 160, 7, 0.25),
                      Stage("mb", 6, 3, 1, 176, 14, 0.25), Stage("mb", 6, 3, 2, 304, 18, 0.25),
                      Stage("mb", 6, 3, 1, 512, 5, 0.25)), 1280, 0.3),
    "l": Variant(32, (Stage("fused", 1, 3, 1, 32, 4, 0), Stage("fused", 4, 3, 2, 64, 7, 0),
                      Stage("fused", 4, 3, 2, 96, 7, 0), Stage("mb", 4, 3, 2, 192, 10, 0.25),
                      Stage("mb", 6, 3, 1, 224, 19, 0.25), Stage("mb", 6, 3, 2, 384, 25, 0.25),
                      Stage("mb", 6, 3, 1, 640, 7, 0.25)), 1280, 0.4),
}


@dataclass(frozen=True)
class EffNetV2Config:
    variant: str = "s"
    num_classes: int = 1000
    in_chans: int = 3
    stem_stride: int = 2  # 1 for small images (32x32): keeps four more pixels per feature-map side
    drop_rate: float | None = None  # dropout before the classifier; None = the variant's
    drop_path_rate: float = 0.2  # stochastic depth, growing linearly to this over the blocks
    bn_eps: float = 1e-3  # TF / torchvision EfficientNetV2 value
    bn_momentum: float = 0.1

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown EfficientNetV2 variant {self.variant!r}; choose {', '.join(VARIANTS)}")
        if self.stem_stride not in (1, 2):
            raise ValueError(f"stem_stride must be 1 or 2, got {self.stem_stride}")
        if self.num_classes < 0:
            raise ValueError("num_classes must be >= 0 (0: no classifier, features only)")


class ConvBnAct(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True,
                 eps: float = 1e-3, momentum: float = 0.1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=eps, momentum=momentum)
        self.act = nn.SiLU(inplace=True) if act else nn.Identity()


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeeze, 1)
        self.expand = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        s = x.mean((2, 3), keepdim=True)  # (B, C, 1, 1)
        return x * self.expand(nn.functional.silu(self.reduce(s))).sigmoid()


class FusedMBConv(nn.Module):
    """k x k expansion conv (stride here), then a 1x1 projection when the width expanded."""

    def __init__(self, cin: int, cout: int, s: Stage, stride: int, drop_path: float, bn: dict):
        super().__init__()
        hidden = cin * s.expand
        self.residual = stride == 1 and cin == cout
        if hidden == cin:
            self.conv, self.project = ConvBnAct(cin, cout, s.kernel, stride, **bn), None
        else:
            self.conv = ConvBnAct(cin, hidden, s.kernel, stride, **bn)
            self.project = ConvBnAct(hidden, cout, 1, act=False, **bn)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        if self.project is not None:
            y = self.project(y)
        return x + self.drop_path(y) if self.residual else y


class MBConv(nn.Module):
    """Inverted residual: 1x1 expansion, k x k depthwise (stride here), squeeze-excitation, 1x1 projection."""

    def __init__(self, cin: int, cout: int, s: Stage, stride: int, drop_path: float, bn: dict):
        super().__init__()
        hidden = _divisible(cin * s.expand)
        self.residual = stride == 1 and cin == cout
        self.expand = ConvBnAct(cin, hidden, 1, **bn) if hidden != cin else None
        self.dw = ConvBnAct(hidden, hidden, s.kernel, stride, groups=hidden, **bn)
        self.se = SqueezeExcite(hidden, max(1, int(cin * s.se))) if s.se > 0 else None
        self.project = ConvBnAct(hidden, cout, 1, act=False, **bn)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        y = self.expand(x) if self.expand is not None else x
        y = self.dw(y)
        if self.se is not None:
            y = self.se(y)
        y = self.project(y)
        return x + self.drop_path(y) if self.residual else y


@register_model("effnetv2_cls", config=EffNetV2Config, weights={"cifar10": "effnetv2_cls.cifar10.safetensors"},
                default="cifar10",
                description="EfficientNetV2 image classifier (b0-b3, s/m/l; torchvision weight interop)")
class EfficientNetV2(ZooModel):
    """EfficientNetV2 classifier."""
    head_prefixes = ("head.",)
    variants = VARIANTS
    bench_batch = 32

    def __init__(self, config: EffNetV2Config = EffNetV2Config()):
        super().__init__()
        self.config = c = config
        v = VARIANTS[c.variant]
        bn = {"eps": c.bn_eps, "momentum": c.bn_momentum}
        self.stem = ConvBnAct(c.in_chans, v.stem, 3, c.stem_stride, **bn)
        total = sum(s.layers for s in v.stages)
        stages, cin, index = [], v.stem, 0
        for s in v.stages:
            blocks = []
            for i in range(s.layers):
                block = FusedMBConv if s.block == "fused" else MBConv
                blocks.append(block(cin, s.channels, s, s.stride if i == 0 else 1,
                                    c.drop_path_rate * index / total, bn))
                cin, index = s.channels, index + 1
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.head_conv = ConvBnAct(cin, v.head, 1, **bn)
        self.num_features = v.head
        self.dropout = Dropout(v.dropout if c.drop_rate is None else c.drop_rate)
        self.head = nn.Linear(v.head, c.num_classes) if c.num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self):
        # as torchvision: kaiming-normal fan-out convs, unit BN, uniform(1/sqrt(out)) classifier
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                bound = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -bound, bound)
                nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------ the timm contract

    @property
    def checkpoint_blocks(self) -> list[nn.Module]:
        return [block for stage in self.stages for block in stage]

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        from zoo.accel.checkpointing import checkpointing
        checkpointing(self, "blocks" if enable else "none")

    def forward_intermediates(self, x: Tensor) -> list[Tensor]:
        """Feature maps at each resolution (the last block of each stride), for detection/segmentation."""
        feats, x = [], self.stem(x)
        for i, stage in enumerate(self.stages):
            x = stage(x)
            last_of_stride = i + 1 == len(self.stages) or VARIANTS[self.config.variant].stages[i + 1].stride > 1
            if last_of_stride:
                feats.append(x)
        return feats

    def feature_info(self) -> list[dict]:
        """Channels and reduction (stride) of each map `forward_intermediates` returns."""
        info, reduction = [], self.config.stem_stride
        stages = VARIANTS[self.config.variant].stages
        for i, s in enumerate(stages):
            reduction *= s.stride
            if i + 1 == len(stages) or stages[i + 1].stride > 1:
                info.append({"channels": s.channels, "reduction": reduction, "stage": i})
        return info

    def forward_features(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head_conv(x)  # (B, num_features, H/32, W/32)

    def forward_head(self, x: Tensor, *, pre_logits: bool = False) -> Tensor:
        x = self.dropout(x.mean((2, 3)))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def freeze_backbone(self, freeze: bool = True) -> None:
        """Linear probing: only `head` learns; the backbone's BatchNorm layers stay in eval mode (their
        running statistics are part of the frozen features) even when the model is put in train mode."""
        self._backbone_frozen = freeze
        for name, p in self.named_parameters():
            p.requires_grad = not freeze or name.startswith("head.")
        self.train(self.training)

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and getattr(self, "_backbone_frozen", False):
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def reset_head(self, num_classes: int) -> None:
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            bound = 1.0 / math.sqrt(num_classes)
            nn.init.uniform_(self.head.weight, -bound, bound)
            nn.init.zeros_(self.head.bias)
            self.head.to(next(self.parameters()).device)
        self.config = dataclasses.replace(self.config, num_classes=num_classes)

    # ------------------------------------------------------------------ foreign checkpoints

    @classmethod
    def convert_foreign(cls, state_dict: dict[str, Tensor], folder=None) -> tuple[dict[str, Tensor], dict]:
        """A state dict without zoo metadata, its layout detected: torchvision's `efficientnet_v2_{s,m,l}` (its
        `state_dict()` saved with torch.save) or zoo's own keys; the variant and num_classes come from the shapes."""
        if "stem.conv.weight" in state_dict:
            layout, convert = "zoo", _check_zoo_layout
            num_classes = state_dict["head.weight"].shape[0] if "head.weight" in state_dict else 0
            extra = {"in_chans": state_dict["stem.conv.weight"].shape[1]}
        elif "features.0.0.weight" in state_dict and "classifier.1.weight" in state_dict:
            layout, convert, extra = "torchvision", from_torchvision, {}
            num_classes = state_dict["classifier.1.weight"].shape[0]
        else:
            keys = sorted(state_dict)
            raise ValueError(f"state dict with keys {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''} is neither "
                             "zoo's EfficientNetV2 nor torchvision's; effnetv2_cls loads a zoo weights file, a "
                             "torchvision efficientnet_v2_{s,m,l} state dict, or pretrained='torchvision' "
                             "(timm layouts are not supported yet)")
        tried = []
        for variant in (("s", "m", "l") if layout == "torchvision" else tuple(VARIANTS)):
            config = EffNetV2Config(variant=variant, num_classes=num_classes, **extra)
            try:
                return convert(state_dict, config), {"variant": variant, "num_classes": num_classes, **extra}
            except ValueError as e:
                tried.append(f"{variant}: {e}")
        raise ValueError(f"{layout} EfficientNetV2 state dict fits no variant; " + "; ".join(tried))

    # ------------------------------------------------------------------ use

    def transforms(self):
        """Inference preprocessing of the loaded weights (resize, crop, mean/std): PIL image -> (C, H, W)."""
        from zoo.data.images import eval_transform
        return eval_transform(self.preprocessing)

    @property
    def preprocessing(self) -> dict:
        meta = getattr(self, "pretrained_meta", None)
        if meta is not None and meta.preprocessing:
            return dict(meta.preprocessing)
        size = 32 if self.config.stem_stride == 1 else 224
        return {"resize": size, "crop": size, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                "interpolation": "bilinear"}

    @torch.no_grad()
    def predict(self, images, top_k: int = 5) -> list[list[tuple[str, float]]]:
        """Top-k (label, probability) for each image (paths or PIL images)."""
        from zoo.data.images import open_image
        transform = self.transforms()
        x = torch.stack([transform(open_image(im)) for im in images]).to(next(self.parameters()).device)
        was_training = self.training
        probs = self.eval()(x).float().softmax(-1)
        self.train(was_training)
        top = probs.topk(min(top_k, probs.shape[1]), dim=1)
        return [[(self.labels[i], round(float(p), 4)) for p, i in zip(ps, ids)] for ps, ids in zip(top.values, top.indices)]

    # ------------------------------------------------------------------ benchmarking

    def example_inputs(self, batch: int = 32, size: int = 224) -> tuple[Tensor]:
        return (torch.randn(batch, self.config.in_chans, size, size, generator=torch.Generator().manual_seed(0)),)


# ---------------------------------------------------------------------- torchvision interop


def _torchvision_key_map(config: EffNetV2Config) -> dict[str, str]:
    """zoo module prefix -> torchvision module prefix, for every conv/bn/linear of the model."""
    v = VARIANTS[config.variant]
    m = {"stem.conv": "features.0.0", "stem.bn": "features.0.1"}
    cin = v.stem
    for si, s in enumerate(v.stages):
        for bi in range(s.layers):
            ours, theirs = f"stages.{si}.{bi}", f"features.{si + 1}.{bi}.block"
            if s.block == "fused":
                parts = ["conv"] + (["project"] if cin * s.expand != cin else [])
            else:
                hidden = _divisible(cin * s.expand)
                parts = (["expand"] if hidden != cin else []) + ["dw", "se", "project"]
            for i, part in enumerate(parts):
                if part == "se":
                    m[f"{ours}.se.reduce"] = f"{theirs}.{i}.fc1"
                    m[f"{ours}.se.expand"] = f"{theirs}.{i}.fc2"
                else:
                    m[f"{ours}.{part}.conv"] = f"{theirs}.{i}.0"
                    m[f"{ours}.{part}.bn"] = f"{theirs}.{i}.1"
            cin = s.channels
    last = len(v.stages) + 1
    m.update({"head_conv.conv": f"features.{last}.0", "head_conv.bn": f"features.{last}.1", "head": "classifier.1"})
    return m


_LEAVES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def from_torchvision(state_dict: dict[str, Tensor], config: EffNetV2Config | None = None) -> dict[str, Tensor]:
    """A torchvision EfficientNetV2 state dict -> this model's keys, checking every key and shape."""
    config = config or EffNetV2Config()
    with torch.device("meta"):  # shapes only: no memory, no init
        reference = EfficientNetV2(dataclasses.replace(config, num_classes=state_dict["classifier.1.weight"].shape[0]))
    own = reference.state_dict()
    out, used = {}, set()
    for ours, theirs in _torchvision_key_map(config).items():
        for leaf in _LEAVES:
            key = f"{ours}.{leaf}"
            if key not in own:
                continue
            source = f"{theirs}.{leaf}"
            if source not in state_dict:
                raise ValueError(f"torchvision state dict lacks {source} (for {key}); is it EfficientNetV2-"
                                 f"{config.variant.upper()}?")
            if state_dict[source].shape != own[key].shape:
                raise ValueError(f"{source} has shape {tuple(state_dict[source].shape)} but {key} needs "
                                 f"{tuple(own[key].shape)}; is it EfficientNetV2-{config.variant.upper()}?")
            out[key] = state_dict[source]
            used.add(source)
    unused = sorted(set(state_dict) - used)
    if unused:
        raise ValueError(f"torchvision keys with no place in EfficientNetV2-{config.variant.upper()}: "
                         f"{', '.join(unused[:10])}")
    return out


def _check_zoo_layout(state_dict: dict[str, Tensor], config: EffNetV2Config) -> dict[str, Tensor]:
    """zoo's own keys (e.g. `torch.save(model.state_dict())`), if they fit `config`'s variant exactly."""
    with torch.device("meta"):
        own = EfficientNetV2(config).state_dict()
    if set(own) != set(state_dict):
        raise ValueError(f"{len(set(own) ^ set(state_dict))} keys differ")
    wrong = [k for k in own if own[k].shape != state_dict[k].shape]
    if wrong:
        raise ValueError(f"{wrong[0]} has shape {tuple(state_dict[wrong[0]].shape)}, not {tuple(own[wrong[0]].shape)}")
    return state_dict


def to_torchvision(model: EfficientNetV2) -> dict[str, Tensor]:
    """This model's weights in torchvision's EfficientNetV2 layout (s/m/l)."""
    if model.config.variant not in ("s", "m", "l"):
        raise ValueError(f"torchvision has no EfficientNetV2-{model.config.variant.upper()}; only s, m and l")
    if model.config.stem_stride != 2 or model.config.in_chans != 3:
        raise ValueError("torchvision's EfficientNetV2 has a stride-2 stem on 3 channels")
    own = model.state_dict()
    out = {}
    for ours, theirs in _torchvision_key_map(model.config).items():
        for leaf in _LEAVES:
            if f"{ours}.{leaf}" in own:
                out[f"{theirs}.{leaf}"] = own[f"{ours}.{leaf}"]
    return out
