"""effnetv2_cls: EfficientNetV2 (Tan & Le, 2021) image classifier, variants b0-b3 and s/m/l.

Stages are typed rows that read like Table 4 of the paper. Weights map both ways to torchvision's
EfficientNetV2 (s/m/l) and to timm's (`tf_efficientnetv2_{b0..b3,s,m,l}`, `efficientnetv2_{s,m,l}`,
`efficientnetv2_rw_{t,s,m}`) with a shape check on every key; timm's TF ports need TensorFlow "same"
padding (`padding="same"`), set when their layout is detected. The model follows the timm contract:
forward_features, forward_head(pre_logits), reset_head, forward_intermediates (the stage outputs timm's
features_only model returns, reductions 2..32), set_grad_checkpointing. `stem_stride=1` keeps resolution
for small images such as 32x32.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from zoo.blocks.layers import DropPath, Dropout
from zoo.models.base import BATCH, ExportGraph, ZooModel, check_config
from zoo.registry import register_model

__all__ = ["EffNetV2Config", "EfficientNetV2", "Stage", "VARIANTS", "TIMM_ARCHS", "from_torchvision", "to_torchvision",
           "from_timm", "to_timm", "adapt_input_conv"]

log = logging.getLogger(__name__)


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
    bn_eps: float = 1e-3  # TF / torchvision EfficientNetV2 value (timm's non-TF models: 1e-5)
    bn_momentum: float = 0.1
    # "torch": symmetric (k-1)//2 padding; "same": TensorFlow's, asymmetric and computed per input size for the
    # strided convs (the extra pixel at the bottom/right), as timm's TF ports (tf_efficientnetv2_*) need
    padding: Literal["torch", "same"] = "torch"
    # (stem, one per stage..., head) channels and layers per stage, replacing the variant's table (e.g. timm's
    # tf_efficientnetv2_b3 rounds its first stage to 16, efficientnetv2_rw_t is S at 0.8 width); None: the variant's
    widths: tuple[int, ...] | None = None
    depths: tuple[int, ...] | None = None
    # the stride of each stage's first block (1 or 2), replacing the table's: (1, 2, 2, 1, 1, 2) runs b0's MBConv
    # stages on 8x8 and 4x4 maps of a 32x32 image (stem stride 1) instead of 4x4 and 2x2; None: the variant's
    strides: tuple[int, ...] | None = None
    # an expansion-1 Fused-MBConv keeps its 1x1 projection (timm's efficientnetv2_rw_s / rw_m first stage)
    fused_e1_project: bool = False

    def __post_init__(self):
        check_config(self, num_classes=">= 0", in_chans=">= 1", drop_rate="[0, 1)", drop_path_rate="[0, 1)",
                     bn_eps="> 0", bn_momentum="[0, 1]", widths=">= 1", depths=">= 1", strides=">= 1")
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown EfficientNetV2 variant {self.variant!r}; choose {', '.join(VARIANTS)}")
        if self.padding not in ("torch", "same"):
            raise ValueError(f"padding must be 'torch' (symmetric) or 'same' (TensorFlow's), got {self.padding!r}")
        if self.in_chans < 1:
            raise ValueError(f"in_chans must be >= 1, got {self.in_chans}")
        stages = len(VARIANTS[self.variant].stages)
        for name, value, size in (("widths", self.widths, stages + 2), ("depths", self.depths, stages)):
            if value is not None and (len(value) != size or not all(isinstance(n, int) and n > 0 for n in value)):
                raise ValueError(f"{name} for variant {self.variant!r} must be {size} positive ints "
                                 f"({'stem, one per stage, head' if name == 'widths' else 'one per stage'}), "
                                 f"got {value!r}")
        if self.strides is not None and (len(self.strides) != stages or not all(n in (1, 2) for n in self.strides)):
            raise ValueError(f"strides for variant {self.variant!r} must be {stages} values of 1 or 2 (one per "
                             f"stage), got {self.strides!r}")
        if self.stem_stride not in (1, 2):
            raise ValueError(f"stem_stride must be 1 or 2, got {self.stem_stride}")
        if self.num_classes < 0:
            raise ValueError("num_classes must be >= 0 (0: no classifier, features only)")


def arch(config: EffNetV2Config) -> Variant:
    """The stage table `config` builds: its variant's, with `widths` / `depths` / `strides` applied."""
    v = VARIANTS[config.variant]
    if config.widths is None and config.depths is None and config.strides is None:
        return v
    widths = config.widths or (v.stem, *(s.channels for s in v.stages), v.head)
    depths = config.depths or tuple(s.layers for s in v.stages)
    strides = config.strides or tuple(s.stride for s in v.stages)
    stages = tuple(dataclasses.replace(s, channels=w, layers=d, stride=st)
                   for s, w, d, st in zip(v.stages, widths[1:-1], depths, strides))
    return Variant(widths[0], stages, widths[-1], v.dropout)


class SameConv2d(nn.Conv2d):
    """A strided conv with TensorFlow's "SAME" padding (timm's Conv2dSame): per side pair a total of
    max((ceil(n / s) - 1) * s + k - n, 0), the odd pixel at the bottom/right; it depends on the input size."""

    def forward(self, x: Tensor) -> Tensor:
        pads = []
        for n, k, s in ((x.shape[-1], self.kernel_size[1], self.stride[1]), (x.shape[-2], self.kernel_size[0],
                                                                               self.stride[0])):
            total = max((-(-n // s) - 1) * s + k - n, 0)
            pads += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pads))


def _init_head(linear: nn.Linear) -> None:
    """uniform(1/sqrt(features)), nn.Linear's own bound: logits of std ~0.4 from unit features, a first loss
    near ln k. torchvision's uniform(1/sqrt(classes)) was made for 1000 classes; with 10 it draws logits of
    std ~4.6 (a first loss of 4.1, and a slower start: on CIFAR-10 at 16 px, train loss 2.58 after 400 steps
    against 2.04 with a zero classifier)."""
    bound = 1.0 / math.sqrt(linear.in_features)
    nn.init.uniform_(linear.weight, -bound, bound)
    nn.init.zeros_(linear.bias)


class DepthwiseConv2d(nn.Conv2d):
    """A depthwise conv that, when gradients are recorded on the CPU, pads explicitly for an input smaller
    than its kernel. oneDNN's depthwise backward is 5-10x slower there: CIFAR-sized images reach 2x2 and 1x1
    maps in the last stages, and at 16 px those few convs took 60% of a training step (2-core AVX2 EPYC).
    Padding first and convolving without padding, or at 1x1 multiplying by the centre tap (the others only
    meet zeros), gives the same products and sums. Inference and export keep the plain conv."""

    def forward(self, x: Tensor) -> Tensor:
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        if (not torch.is_grad_enabled() or x.device.type != "cpu" or not (ph or pw)
                or (x.shape[-2] >= kh and x.shape[-1] >= kw)):
            return super().forward(x)
        if x.shape[-2:] == (1, 1) and (kh, kw) == (2 * ph + 1, 2 * pw + 1):
            y = x * self.weight[:, 0, ph, pw].view(1, -1, 1, 1)
            return y if self.bias is None else y + self.bias.view(1, -1, 1, 1)
        return F.conv2d(F.pad(x, (pw, pw, ph, ph)), self.weight, self.bias, self.stride, 0, self.dilation,
                        self.groups)


class ConvBnAct(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True,
                 eps: float = 1e-3, momentum: float = 0.1, padding: str = "torch"):
        super().__init__()
        if padding == "same" and stride > 1:  # at stride 1 an odd kernel's "same" is the symmetric padding
            self.conv = SameConv2d(cin, cout, kernel, stride, 0, groups=groups, bias=False)
        else:
            conv = DepthwiseConv2d if groups == cin == cout and groups > 1 else nn.Conv2d
            self.conv = conv(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False)
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
    """k x k expansion conv (stride here), then a 1x1 projection when the width expanded (or `project_e1`)."""

    def __init__(self, cin: int, cout: int, s: Stage, stride: int, drop_path: float, bn: dict,
                 project_e1: bool = False):
        super().__init__()
        hidden = cin * s.expand
        self.residual = stride == 1 and cin == cout
        if hidden == cin and not project_e1:
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
                description="EfficientNetV2 image classifier (b0-b3, s/m/l; torchvision and timm weight interop)")
class EfficientNetV2(ZooModel):
    """EfficientNetV2 classifier."""
    head_prefixes = ("head.",)
    variants = VARIANTS
    bench_batch = 32

    def __init__(self, config: EffNetV2Config = EffNetV2Config()):
        super().__init__()
        self.config = c = config
        v = arch(c)
        bn = {"eps": c.bn_eps, "momentum": c.bn_momentum, "padding": c.padding}
        self.stem = ConvBnAct(c.in_chans, v.stem, 3, c.stem_stride, **bn)
        total = sum(s.layers for s in v.stages)
        stages, cin, index = [], v.stem, 0
        for s in v.stages:
            blocks = []
            for i in range(s.layers):
                args = (cin, s.channels, s, s.stride if i == 0 else 1, c.drop_path_rate * index / total, bn)
                blocks.append(FusedMBConv(*args, project_e1=c.fused_e1_project) if s.block == "fused"
                              else MBConv(*args))
                cin, index = s.channels, index + 1
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.head_conv = ConvBnAct(cin, v.head, 1, **bn)
        self.num_features = v.head
        self.dropout = Dropout(v.dropout if c.drop_rate is None else c.drop_rate)
        self.head = nn.Linear(v.head, c.num_classes) if c.num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self):
        # as torchvision: kaiming-normal fan-out convs, unit BN; the classifier as _init_head says
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                _init_head(m)

    # ------------------------------------------------------------------ the timm contract

    @property
    def checkpoint_blocks(self) -> list[nn.Module]:
        return [block for stage in self.stages for block in stage]

    def depth_groups(self) -> list[tuple[str, list[nn.Module]]]:
        """Stem, each stage, the 1x1 head convolution, the classifier."""
        return [("stem", [self.stem]), *((f"stage {i}", [stage]) for i, stage in enumerate(self.stages)),
                ("head conv", [self.head_conv]), ("head", [self.head])]

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        from zoo.accel.checkpointing import checkpointing
        checkpointing(self, "blocks" if enable else "none")

    def forward_intermediates(self, x: Tensor, indices: int | Sequence[int] | None = None) -> list[Tensor]:
        """Feature maps at each resolution (the last block of each stride; reductions 2, 4, 8, 16, 32 with the
        default stem), the maps timm's `features_only=True` model returns, for detection/segmentation.
        indices: None (all), n (the last n) or positions in `feature_info()` (negative from the end)."""
        info = self.feature_info()
        if indices is None:
            wanted = list(range(len(info)))
        elif isinstance(indices, int):
            if not 0 < indices <= len(info):
                raise ValueError(f"indices={indices}: this model has {len(info)} feature maps")
            wanted = list(range(len(info) - indices, len(info)))
        else:
            wanted = [i + len(info) if i < 0 else i for i in indices]
            if not all(0 <= i < len(info) for i in wanted):
                raise ValueError(f"indices {list(indices)} out of range for {len(info)} feature maps")
        stage_of = {info[i]["stage"]: i for i in wanted}
        feats, x = {}, self.stem(x)
        for i, stage in enumerate(self.stages[:max(stage_of) + 1]):  # stop after the deepest map wanted
            x = stage(x)
            if i in stage_of:
                feats[stage_of[i]] = x
        return [feats[i] for i in wanted]

    def feature_info(self) -> list[dict]:
        """Channels and reduction (stride) of each map `forward_intermediates` returns."""
        info, reduction = [], self.config.stem_stride
        stages = arch(self.config).stages
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
            _init_head(self.head)
            self.head.to(next(self.parameters()).device)
        self.config = dataclasses.replace(self.config, num_classes=num_classes)

    # ------------------------------------------------------------------ foreign checkpoints

    @classmethod
    def convert_foreign(cls, state_dict: dict[str, Tensor], folder=None) -> tuple[dict[str, Tensor], dict]:
        """A state dict without zoo metadata, its layout detected: torchvision's `efficientnet_v2_{s,m,l}`, timm's
        EfficientNetV2 family (its `state_dict()` saved with torch.save or safetensors, or an hf://timm/<name>
        folder whose config.json names the architecture) or zoo's own keys; the config comes from the shapes."""
        if "stem.conv.weight" in state_dict:
            layout, convert = "zoo", _check_zoo_layout
            num_classes = state_dict["head.weight"].shape[0] if "head.weight" in state_dict else 0
            extra = {"in_chans": state_dict["stem.conv.weight"].shape[1]}
        elif "features.0.0.weight" in state_dict and "classifier.1.weight" in state_dict:
            layout, convert, extra = "torchvision", from_torchvision, {}
            num_classes = state_dict["classifier.1.weight"].shape[0]
        elif "conv_stem.weight" in state_dict and "blocks.0.0.bn1.weight" in state_dict:
            return _convert_timm(state_dict, folder)
        else:
            keys = sorted(state_dict)
            raise ValueError(f"state dict with keys {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''} is neither "
                             "zoo's EfficientNetV2, torchvision's nor timm's; effnetv2_cls loads a zoo weights file, a "
                             "torchvision efficientnet_v2_{s,m,l} state dict, a timm tf_efficientnetv2_* / "
                             "efficientnetv2_* state dict (or hf://timm/<name>), or pretrained='torchvision'")
        tried = []
        for variant in (("s", "m", "l") if layout == "torchvision" else tuple(VARIANTS)):
            config = EffNetV2Config(variant=variant, num_classes=num_classes, **extra)
            try:
                return convert(state_dict, config), {"variant": variant, "num_classes": num_classes, **extra}
            except ValueError as e:
                tried.append(f"{variant}: {e}")
        loads = ({"zoo": "zoo's own keys load for the variants' tables as they are (b0-b3, s, m, l); a model of "
                  "other widths/depths loads from the file zoo.save writes (its config travels in the metadata)",
                  "torchvision": "torchvision's efficientnet_v2_s/m/l state dicts load as torchvision writes them"}
                 [layout])
        raise ValueError(f"{layout} EfficientNetV2 state dict fits no variant; " + "; ".join(tried) + f". {loads}")

    def adapt_state_dict(self, state_dict: dict[str, Tensor], source: str) -> dict[str, Tensor]:
        """Weights for another number of input channels than this model's `in_chans` get their stem adapted as
        timm does (1 channel: the kernel summed over the input channels; more: repeated and rescaled), with a
        warning."""
        weight = state_dict.get("stem.conv.weight")
        if weight is None or weight.ndim != 4 or weight.shape[1] == self.config.in_chans:
            return state_dict
        warnings.warn(f"{type(self).__name__}: stem.conv.weight of {source} is for {weight.shape[1]} input channels; "
                      f"adapted to in_chans={self.config.in_chans} ("
                      f"{'summed over its channels' if self.config.in_chans == 1 else 'repeated and rescaled'})",
                      UserWarning, stacklevel=3)
        return {**state_dict, "stem.conv.weight": adapt_input_conv(self.config.in_chans, weight)}

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
    def predict(self, images, top_k: int = 5, *, tta: str = "none") -> list[list[tuple[str, float]]]:
        """Top-k (label, probability) for each image (paths or PIL images). tta="flip": the softmax of the logits
        averaged over the image and its horizontal mirror."""
        from zoo.blocks.tta import average_over_flips, check_tta
        from zoo.data.images import open_image
        flips = [(), (-1,)] if check_tta(tta) == "flip" else [()]
        transform = self.transforms()
        x = torch.stack([transform(open_image(im)) for im in images]).to(next(self.parameters()).device)
        was_training = self.training
        probs = average_over_flips(self.eval(), x, flips).float().softmax(-1)
        self.train(was_training)
        top = probs.topk(min(top_k, probs.shape[1]), dim=1)
        return [[(self.labels[i], round(float(p), 4)) for p, i in zip(ps, ids)] for ps, ids in zip(top.values, top.indices)]

    # ------------------------------------------------------------------ benchmarking

    def example_inputs(self, batch: int = 32, size: int = 224) -> tuple[Tensor]:
        return (torch.randn(batch, self.config.in_chans, size, size, generator=torch.Generator().manual_seed(0)),)

    def export_graphs(self, batch: int = 2, size: int | None = None) -> dict[str, ExportGraph]:
        """An image batch at the weights' crop (else 224), the batch dynamic."""
        meta = self.pretrained_meta
        size = size or (meta.preprocessing.get("crop") if meta else None) or 224
        return {"model": ExportGraph(self, self.example_inputs(batch, size), ("image",), ({0: BATCH},), ("logits",))}


# ---------------------------------------------------------------------- torchvision interop


def _torchvision_key_map(config: EffNetV2Config) -> dict[str, str]:
    """zoo module prefix -> torchvision module prefix, for every conv/bn/linear of the model."""
    v = arch(config)
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
    with torch.device("meta"):  # shapes only: no memory, no init; the weights' own in_chans (adapted on load)
        reference = EfficientNetV2(dataclasses.replace(config, num_classes=state_dict["classifier.1.weight"].shape[0],
                                                       in_chans=state_dict["features.0.0.weight"].shape[1]))
    out, problems = _renamed(state_dict, _torchvision_key_map(config), reference.state_dict())
    if problems:
        raise ValueError(f"torchvision state dict does not fit EfficientNetV2-{config.variant.upper()}: "
                         f"{'; '.join(problems[:6])}; is it EfficientNetV2-{config.variant.upper()}?")
    return out


def _renamed(state_dict: dict[str, Tensor], key_map: dict[str, str], own: dict[str, Tensor]
             ) -> tuple[dict[str, Tensor], list[str]]:
    """`state_dict` under this model's keys, by `key_map` (zoo module prefix -> peer's), checked against `own`'s
    keys and shapes; with every problem found (a missing key, a wrong shape, a key with no place)."""
    out, used, problems = {}, set(), []
    for ours, theirs in key_map.items():
        for leaf in _LEAVES:
            key = f"{ours}.{leaf}"
            if key not in own:
                continue
            source = f"{theirs}.{leaf}"
            if source not in state_dict:
                problems.append(f"lacks {source} (for {key})")
            elif state_dict[source].shape != own[key].shape:
                problems.append(f"{source} has shape {tuple(state_dict[source].shape)} but {key} needs "
                                f"{tuple(own[key].shape)}")
            else:
                out[key] = state_dict[source]
                used.add(source)
    unused = sorted(set(state_dict) - used)
    if unused:
        problems.append(f"keys with no place: {', '.join(unused[:10])}{' ...' if len(unused) > 10 else ''}")
    return out, problems


def _check_zoo_layout(state_dict: dict[str, Tensor], config: EffNetV2Config) -> dict[str, Tensor]:
    """zoo's own keys (e.g. `torch.save(model.state_dict())`), if they fit `config`'s variant exactly."""
    with torch.device("meta"):
        own = EfficientNetV2(config).state_dict()
    if set(own) != set(state_dict):
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        raise ValueError(f"{len(missing) + len(unexpected)} keys differ (missing {_few(missing)}; "
                         f"unexpected {_few(unexpected)})")
    wrong = [k for k in own if own[k].shape != state_dict[k].shape]
    if wrong:
        raise ValueError(f"{wrong[0]} has shape {tuple(state_dict[wrong[0]].shape)}, not {tuple(own[wrong[0]].shape)}")
    return state_dict


def _few(keys: list[str], limit: int = 3) -> str:
    return (", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")) or "none"


def to_torchvision(model: EfficientNetV2) -> dict[str, Tensor]:
    """This model's weights in torchvision's EfficientNetV2 layout (s/m/l)."""
    if model.config.variant not in ("s", "m", "l"):
        raise ValueError(f"torchvision has no EfficientNetV2-{model.config.variant.upper()}; only s, m and l")
    c = model.config
    if c.stem_stride != 2 or c.in_chans != 3:
        raise ValueError("torchvision's EfficientNetV2 has a stride-2 stem on 3 channels")
    if c.padding != "torch" or c.widths is not None or c.depths is not None or c.fused_e1_project:
        raise ValueError("torchvision's EfficientNetV2 has symmetric padding and the s/m/l tables as they are "
                         f"(this model: padding={c.padding!r}, widths={c.widths}, depths={c.depths}, "
                         f"fused_e1_project={c.fused_e1_project}); to_timm writes timm's layout")
    own = model.state_dict()
    out = {}
    for ours, theirs in _torchvision_key_map(model.config).items():
        for leaf in _LEAVES:
            if f"{ours}.{leaf}" in own:
                out[f"{theirs}.{leaf}"] = own[f"{ours}.{leaf}"]
    return out


# ---------------------------------------------------------------------- timm interop

# timm's EfficientNetV2 architectures as zoo configs: layout (shapes) + the padding and BatchNorm eps they use.
# The tf_ ports of Google's weights use TensorFlow "same" padding and eps 1e-3; timm's own models are symmetric
# with eps 1e-5. tests/test_interop_effnetv2.py checks every row against timm's own model.
_TF, _TIMM = {"padding": "same", "bn_eps": 1e-3}, {"padding": "torch", "bn_eps": 1e-5}
TIMM_ARCHS: dict[str, dict] = {
    **{f"tf_efficientnetv2_{v}": {"variant": v, **_TF} for v in ("b0", "b1", "b2", "s", "m", "l")},
    # the first stage rounds 16 * 1.2 down to 16 (timm's round_limit=0), zoo's b3 table to 24
    "tf_efficientnetv2_b3": {"variant": "b3", "widths": (40, 16, 40, 56, 112, 136, 232, 1536), **_TF},
    **{f"efficientnetv2_{v}": {"variant": v, **_TIMM} for v in ("s", "m", "l")},
    "efficientnetv2_rw_t": {"variant": "s", "widths": (24, 24, 40, 48, 104, 128, 208, 1024),
                            "depths": (2, 4, 4, 6, 9, 14), **_TIMM},
    "efficientnetv2_rw_s": {"variant": "s", "widths": (24, 24, 48, 64, 128, 160, 272, 1792),
                            "fused_e1_project": True, **_TIMM},
    "efficientnetv2_rw_m": {"variant": "s", "widths": (32, 32, 56, 80, 152, 192, 328, 2152),
                            "depths": (3, 5, 5, 8, 15, 24), "fused_e1_project": True, **_TIMM},
}


def _signature(config: EffNetV2Config) -> tuple:
    """What a state dict shows of a config: widths, depths and whether stage 0 has a projection."""
    v = arch(config)
    return ((v.stem, *(s.channels for s in v.stages), v.head), tuple(s.layers for s in v.stages),
            config.fused_e1_project)


def _timm_signature(state_dict: dict[str, Tensor]) -> tuple:
    stages = sorted({int(k.split(".")[1]) for k in state_dict if k.startswith("blocks.")})
    depths, channels = [], []
    for i in stages:
        depths.append(len({k.split(".")[2] for k in state_dict if k.startswith(f"blocks.{i}.")}))
        first = f"blocks.{i}.0."
        out = next((first + name for name in ("conv_pwl.weight", "conv.weight") if first + name in state_dict), None)
        channels.append(state_dict[out].shape[0] if out else 0)
    head = state_dict["conv_head.weight"].shape[0] if "conv_head.weight" in state_dict else 0
    return ((state_dict["conv_stem.weight"].shape[0], *channels, head), tuple(depths),
            "blocks.0.0.conv_exp.weight" in state_dict)


def _convert_timm(state_dict: dict[str, Tensor], folder: Path | None) -> tuple[dict[str, Tensor], dict]:
    """timm's layout -> zoo's keys and config. The architecture is the one config.json names (hf://timm/...), else
    the one whose shapes fit; where a tf_ port and timm's own model share shapes, the tf_ port (the one with
    published weights) is assumed, with a log line saying how to choose the other."""
    num_classes = state_dict["classifier.weight"].shape[0] if "classifier.weight" in state_dict else 0
    in_chans = state_dict["conv_stem.weight"].shape[1]
    named = _timm_architecture(folder)
    signature = _timm_signature(state_dict)
    fits = [name for name, row in TIMM_ARCHS.items() if _signature(EffNetV2Config(**row)) == signature]
    if named is not None:
        if named not in TIMM_ARCHS:
            raise ValueError(f"{folder}/config.json names timm architecture {named!r}; effnetv2_cls loads "
                             f"{', '.join(TIMM_ARCHS)}")
        if named not in fits:
            fit = (f"their shapes are timm's {' / '.join(fits)}, which loads with config.json's architecture set to "
                   "it (or without config.json)" if fits else "their shapes are none of the timm architectures "
                   f"effnetv2_cls loads ({', '.join(TIMM_ARCHS)})")
            raise ValueError(f"the weights in {folder} do not have the shapes of timm's {named} (widths, depths: "
                             f"{signature[0]}, {signature[1]}, read from conv_stem, "
                             f"blocks.<stage>.0.conv_pwl / conv and conv_head weights); is config.json from another model? {fit}")
        name = named
    elif fits:
        name = fits[0]
        if len(fits) > 1:
            log.info("timm EfficientNetV2 state dict: shapes of %s; loaded as %s (padding=%r, bn_eps=%g); pass "
                     "padding='torch', bn_eps=1e-5 for timm's own %s", " / ".join(fits), name,
                     TIMM_ARCHS[name]["padding"], TIMM_ARCHS[name]["bn_eps"], fits[1])
    else:
        raise ValueError(f"timm EfficientNetV2 state dict with widths {signature[0]} and depths {signature[1]} is "
                         f"none of the timm architectures effnetv2_cls loads ({', '.join(TIMM_ARCHS)}); other "
                         "channel or depth multipliers convert with zoo.models.effnetv2.from_timm(state_dict, "
                         "EffNetV2Config(widths=..., depths=..., padding=..., bn_eps=...)) into an "
                         "EfficientNetV2 of that config (load_state_dict), then zoo.save keeps the config")
    values = {**TIMM_ARCHS[name], "num_classes": num_classes, "in_chans": in_chans}
    return from_timm(state_dict, EffNetV2Config(**values)), values


def _timm_architecture(folder: Path | None) -> str | None:
    """The `architecture` a timm Hub folder's config.json names (None: no such file)."""
    path = Path(folder) / "config.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("architecture")
    except (json.JSONDecodeError, AttributeError):
        return None


def _timm_key_map(model: EfficientNetV2) -> dict[str, str]:
    """zoo module prefix -> timm module prefix, for every conv/bn/linear of `model`."""
    m = {"stem.conv": "conv_stem", "stem.bn": "bn1"}
    for si, stage in enumerate(model.stages):
        for bi, block in enumerate(stage):
            ours, theirs = f"stages.{si}.{bi}", f"blocks.{si}.{bi}"
            if isinstance(block, FusedMBConv) and block.project is None:  # timm's ConvBnAct block
                parts = {"conv.conv": "conv", "conv.bn": "bn1"}
            elif isinstance(block, FusedMBConv):  # EdgeResidual
                parts = {"conv.conv": "conv_exp", "conv.bn": "bn1", "project.conv": "conv_pwl", "project.bn": "bn2"}
            else:  # InvertedResidual
                parts = {"dw.conv": "conv_dw", "dw.bn": "bn2", "se.reduce": "se.conv_reduce",
                         "se.expand": "se.conv_expand", "project.conv": "conv_pwl", "project.bn": "bn3"}
                if block.expand is not None:
                    parts.update({"expand.conv": "conv_pw", "expand.bn": "bn1"})
            m.update({f"{ours}.{a}": f"{theirs}.{b}" for a, b in parts.items()})
    m.update({"head_conv.conv": "conv_head", "head_conv.bn": "bn2", "head": "classifier"})
    return m


def from_timm(state_dict: dict[str, Tensor], config: EffNetV2Config) -> dict[str, Tensor]:
    """A timm EfficientNetV2 state dict -> this model's keys for `config`, checking every key and shape."""
    num_classes = state_dict["classifier.weight"].shape[0] if "classifier.weight" in state_dict else 0
    with torch.device("meta"):
        reference = EfficientNetV2(dataclasses.replace(config, num_classes=num_classes,
                                                       in_chans=state_dict["conv_stem.weight"].shape[1]))
    out, problems = _renamed(state_dict, _timm_key_map(reference), reference.state_dict())
    if problems:
        raise ValueError(f"timm state dict does not fit EfficientNetV2 {config.variant} (widths={config.widths}, "
                         f"depths={config.depths}): {'; '.join(problems[:6])}")
    return out


def to_timm(model: EfficientNetV2) -> dict[str, Tensor]:
    """This model's weights in timm's EfficientNetV2 layout (`timm.create_model(<its TIMM_ARCHS name>)`)."""
    if model.config.stem_stride != 2:
        raise ValueError("timm's EfficientNetV2 has a stride-2 stem; this model has stem_stride=1")
    own = model.state_dict()
    return {f"{theirs}.{leaf}": own[f"{ours}.{leaf}"] for ours, theirs in _timm_key_map(model).items()
            for leaf in _LEAVES if f"{ours}.{leaf}" in own}


def adapt_input_conv(in_chans: int, weight: Tensor) -> Tensor:
    """A first conv's kernel (out, in, kh, kw) for `in_chans` input channels, as timm's adapt_input_conv: summed
    over the input channels for 1 (a grey image's response equals the colour image's of the same grey), else
    repeated to `in_chans` and scaled by in / in_chans (the same response to a constant image)."""
    dtype, weight = weight.dtype, weight.float()
    if in_chans == 1:
        out = weight.sum(dim=1, keepdim=True)
    else:
        repeat = math.ceil(in_chans / weight.shape[1])
        out = weight.repeat(1, repeat, 1, 1)[:, :in_chans] * (weight.shape[1] / in_chans)
    return out.to(dtype)
