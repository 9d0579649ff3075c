"""Pretrained weights served by another library's own API, converted to zoo's layout on load:
`zoo.load("effnetv2_cls", pretrained="torchvision")`. Each entry is function(config) -> (state dict in zoo's
keys, WeightsMeta); downloads happen here, not in the model files, and go to that library's own cache.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from zoo.weights.files import WeightsMeta

__all__ = ["EXTERNAL", "external_tags"]


def torchvision_effnetv2(config):
    """torchvision's ImageNet weights through its own weights API (downloads once into the torch hub cache)."""
    from zoo.models.effnetv2 import from_torchvision
    tables = (config.padding == "torch" and config.widths is None and config.depths is None
              and not config.fused_e1_project)
    if config.variant not in ("s", "m", "l") or config.stem_stride != 2 or not tables:
        raise ValueError(f"torchvision weights exist for variant s, m or l with stem_stride=2, padding='torch' and the "
                         f"variant's own widths/depths (asked: variant={config.variant!r}, stem_stride="
                         f"{config.stem_stride}, padding={config.padding!r}); e.g. zoo.load('effnetv2_cls', "
                         "pretrained='torchvision', variant='s', num_classes=5)")
    import torchvision
    weights = getattr(torchvision.models, f"EfficientNet_V2_{config.variant.upper()}_Weights").DEFAULT
    try:
        state_dict = weights.get_state_dict(progress=False)
    except Exception as e:  # URLError, offline hub, ...
        raise RuntimeError(f"could not fetch torchvision's {weights} ({type(e).__name__}: {e}); it needs network "
                           f"once, or the file {weights.url.rsplit('/', 1)[-1]} in "
                           f"{torch.hub.get_dir()}/checkpoints") from None
    t = weights.transforms()
    imagenet_head = config.num_classes == 1000  # else zoo.load re-initialises the head: its labels and metrics go
    meta = WeightsMeta(model="effnetv2_cls", config=dataclasses.asdict(config),
                       labels=list(weights.meta["categories"]) if imagenet_head else None,
                       preprocessing={"resize": t.resize_size[0], "crop": t.crop_size[0], "mean": list(t.mean),
                                      "std": list(t.std), "interpolation": t.interpolation.value},
                       dataset="ImageNet-1k (torchvision)", metrics=dict(weights.meta.get("_metrics", {}).get(
                           "ImageNet-1K", {})) if imagenet_head else {}, command=f"torchvision {weights}")
    return from_torchvision(state_dict, config), meta


EXTERNAL: dict[str, dict[str, Callable]] = {"effnetv2_cls": {"torchvision": torchvision_effnetv2}}


def external_tags(name: str) -> dict[str, Callable]:
    """tag -> loader of the weights another library serves for registry model `name`."""
    return EXTERNAL.get(name, {})
