"""`zoo demo`: each family with shipped weights on a built-in input, and what its weights measured.

A demo takes the loaded model and returns a short report. No photo, text corpus or volume ships with the
package, so the demos draw or generate their inputs.
"""
from __future__ import annotations

import tempfile
from typing import Callable

from zoo.predict import ADAPTERS


def _metric(model, key: str):
    return model.pretrained_meta.metrics.get(key) if model.pretrained_meta else None


def bert_cls(model) -> str:
    texts = ["a gripping , beautifully acted film", "a waste of two hours", "it 's not bad at all"]
    _, text = ADAPTERS["bert_cls"](model, texts)
    return f"SST-2 dev accuracy of these weights: {_metric(model, 'accuracy')}\n{text}"


def effnetv2_cls(model) -> str:
    # a grey hull on a blue sea under a pale sky
    from PIL import Image, ImageDraw
    size = model.preprocessing.get("resize", 224)
    image = Image.new("RGB", (size, size), (150, 190, 235))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, size * 5 // 8, size, size], fill=(30, 70, 140))
    draw.polygon([(size // 6, size * 5 // 8), (size * 5 // 6, size * 5 // 8), (size * 2 // 3, size * 3 // 4),
                  (size // 3, size * 3 // 4)], fill=(90, 90, 95))
    top = model.predict([image], top_k=3)[0]
    return (f"test top-1 of these weights: {_metric(model, 'top1')}\ntop-3 for a drawn ship at sea "
            f"({size}x{size}): " + ", ".join(f"{label} {p:.3f}" for label, p in top))


def transformer_lm(model) -> str:
    text = model.generate("ROMEO:", 200, temperature=0.8, seed=0)
    return f"sample (200 chars, T=0.8, seed 0; validation loss {_metric(model, 'val_loss')}):\n{text}"


def unet3d_seg(model) -> str:
    from zoo.data.volumes import synthetic_volume
    from zoo.models.unet3d import dice_per_class
    image, label = synthetic_volume(10_000, (64, 64, 64), model.config.num_classes)
    pred = model.predict_volume(image, window=48)
    dice = dice_per_class(pred, label, model.config.num_classes)
    return "held-out synthetic volume (seed 10000), Dice per foreground class: " + ", ".join(
        f"{k}: {v:.3f}" for k, v in dice.items())


def diffusion_unet(model) -> str:
    path = f"{tempfile.gettempdir()}/zoo_diffusion_demo.png"
    ADAPTERS["diffusion_unet"](model, [], classes="0,1,2,3,4,5,6,7,8,9", n=20, out=path, steps=50)
    return (f"20 guided DDIM-50 samples of the digits 0-9 in {path}; "
            f"recognition rate {_metric(model, 'recognition')}")


DEMOS: dict[str, Callable[[object], str]] = {fn.__name__: fn for fn in (bert_cls, effnetv2_cls, transformer_lm,
                                                                         unet3d_seg, diffusion_unet)}


def demo(name: str, model) -> str:
    """The family's demo, or (for a family without one) what its shipped weights measured."""
    if name in DEMOS:
        return DEMOS[name](model)
    return f"metrics of the shipped weights: {model.pretrained_meta.metrics if model.pretrained_meta else {}}"
