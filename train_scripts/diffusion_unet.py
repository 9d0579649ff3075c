"""Train `diffusion_unet` (class-conditional) on scikit-learn's digits, an .npz or an ImageFolder.

An ImageFolder's images may differ in size and mode; each is decoded when its batch is loaded, resized
and centre-cropped to --image-size (an undecodable file: skipped with one warning, --strict-data: an error).

    python train_scripts/diffusion_unet.py --data digits --image-size 16 --steps 6000 --ema 0.999
    python train_scripts/diffusion_unet.py --eval-only --pretrained default --data digits

Each evaluation writes samples.png (guided DDIM-50, one row per class) to --out. For the digits the
final weights are judged by a classifier trained on the real images: the share of guided samples it
recognises as the class asked for, and a Fréchet distance on its features against held-out digits.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import zoo
from zoo.data.images import run_counting_skipped
from zoo.models.base import unwrap
from zoo.train import Task, add_train_args, config_from_args, main_guard, run, setup_logging


def load_data(spec: str, size: int, val_fraction: float, strict: bool = False):
    """(training dataset, held-out dataset or None, channels, class names) of (image in [-1, 1] (C, size,
    size), label); the held-out set is the data's test split, else --val-fraction of the training images
    (None for 0). An ImageFolder is decoded lazily, each image resized + centre-cropped to `size`."""
    from torch.utils.data import TensorDataset
    if spec == "digits":
        from zoo.data.digits import load_digits_images
        x, y = load_digits_images(size, split="train")
        return TensorDataset(x, y), TensorDataset(*load_digits_images(size, split="test")), x.shape[1], \
            [str(i) for i in range(10)]
    if Path(spec).is_dir():  # any sizes and modes, decoded per item in the DataLoader's workers
        from torchvision.transforms import v2 as T
        from zoo.data.images import image_folder_datasets
        train, held_out, names = image_folder_datasets(spec, val_fraction=val_fraction, strict=strict)
        to_unit = T.Compose([T.Resize(size, antialias=True), T.CenterCrop(size), T.ToDtype(torch.float32, scale=True),
                             T.Normalize([0.5] * 3, [0.5] * 3)])  # [0, 1] -> [-1, 1]
        for data in (train, held_out):
            if data is not None:
                data.transform = to_unit
        return train, held_out, 3, names
    x, y, x_val, y_val, names = _load_arrays(spec, size, val_fraction)
    return TensorDataset(x, y), (TensorDataset(x_val, y_val) if x_val is not None else None), x.shape[1], names


def _load_arrays(spec: str, size: int, val_fraction: float):
    """An .npz's images as tensors in [-1, 1] (N, C, size, size), labels, and the held-out ones."""
    from zoo.data.images import load_train_and_held_out
    x, y, x_val, y_val, names = load_train_and_held_out(spec, val_fraction=val_fraction)

    def tensors(images, labels):
        if images is None:
            return None, None
        t = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
        if t.shape[-1] != size:
            t = torch.nn.functional.interpolate(t, size=(size, size), mode="bilinear", antialias=True)
        return t, torch.as_tensor(labels, dtype=torch.long)

    return (*tensors(x, y), *tensors(x_val, y_val), names)


def build_task(cfg) -> Task:
    a = cfg.extra
    if cfg.data is None:
        raise ValueError("--data is required: 'digits', an .npz with x_train/y_train, or an ImageFolder")
    architecture = [f"--{k.replace('_', '-')}" for k in ("image_size", "widths") if a[k] is not None]
    if cfg.pretrained and architecture:
        raise ValueError(f"--pretrained {cfg.pretrained} brings its own architecture; {', '.join(architecture)} "
                         "would be ignored: drop them, or train from scratch without --pretrained")
    try:
        widths = tuple(int(w) for w in (a["widths"] or "64,128,128").split(","))
    except ValueError:
        raise ValueError(f"--widths takes channels per level as integers separated by commas, e.g. 64,128,128; "
                         f"got {a['widths']!r}") from None
    size = a["image_size"] or 16
    if cfg.pretrained:
        model = zoo.load("diffusion_unet", pretrained=cfg.pretrained)
        size = model.config.image_size
    else:  # a bad --widths or --image-size is refused before the data is read
        zoo.registry.build_config(zoo.registry.get_entry("diffusion_unet"), image_size=size, widths=widths)
    train_data, eval_data, channels, names = load_data(cfg.data, size, a["val_fraction"], a["strict_data"])
    if not cfg.pretrained:
        model = zoo.load("diffusion_unet", image_size=size, in_chans=channels, widths=widths,
                         num_classes=0 if a["unconditional"] else len(names), dropout=a["dropout"])
    k = model.config.num_classes

    def loss(m, batch):
        images, labels = batch
        # through `m`'s forward, so that a DDP wrapper all-reduces the gradients
        return m(images, y=labels if k else None, loss=True)

    def eval_step(m, batch):
        images, labels = batch
        g = torch.Generator().manual_seed(len(images))  # fixed t and noise: a comparable validation loss
        from zoo.blocks.diffusion import diffusion_loss
        plain = unwrap(m)
        value = diffusion_loss(lambda xt, t: m(xt, t, labels if k else None), images, plain.schedule,
                               prediction=plain.config.prediction, generator=g)
        return {"loss_sum": value * len(images), "n": torch.tensor(len(images))}

    def summarize(s):
        return {"val_loss": round(float(s["loss_sum"] / s["n"]), 5)}

    def after_eval(m, metrics, out, is_main):
        from torchvision.utils import save_image
        classes = [c for c in range(k) for _ in range(8)] if k else None
        images = m.sample(len(classes) if classes else 64, classes=classes, steps=50, guidance=a["guidance"], seed=0)
        if is_main:
            save_image(images, out / "samples.png", nrow=8)

    def final_eval(m):
        if cfg.data != "digits" or not k:
            return {}
        from zoo.data.digits import DigitsJudge
        judge = DigitsJudge(size)
        classes = torch.arange(10).repeat_interleave(a["judge_samples"] // 10)
        images = m.sample(len(classes), classes=classes, steps=50, sampler="ddim", guidance=a["guidance"], seed=1)
        images = images * 2 - 1
        return {"recognition": round(judge.recognition(images, classes), 4), "frechet": round(judge.frechet(images), 3),
                "judge_accuracy": round(judge.accuracy, 4), "guidance": a["guidance"], "judge_samples": len(classes)}

    return Task(
        name="diffusion_unet", model=model,
        train_data=train_data if not cfg.eval_only else None,
        eval_data=eval_data,
        loss=loss, eval_step=eval_step, summarize=summarize, after_eval=after_eval, final_eval=final_eval,
        eval_batch_size=256,
        meta={"labels": names if k else None, "dataset": f"{cfg.data} at {size}x{size}",
              "preprocessing": {"image_size": size, "range": "[-1, 1] inside, [0, 1] from sample()"}},
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser, lr=2e-3, weight_decay=0.0, warmup=200, batch_size=64, ema=0.999, clip=1.0,
                   out="runs/diffusion_unet", eval_every=1000)
    g = parser.add_argument_group("diffusion_unet")
    g.add_argument("--image-size", type=int, help="default: 16 (--pretrained: the weights')")
    g.add_argument("--widths", help="channels per level, default 64,128,128 (--pretrained: the weights')")
    g.add_argument("--dropout", type=float, default=0.1)
    g.add_argument("--val-fraction", type=float, default=0.1, help="share of the training images held out for "
                   "the validation loss when the data has no test split; 0: no evaluation")
    g.add_argument("--strict-data", action="store_true", help="an ImageFolder file that cannot be decoded is "
                   "an error (default: skipped, named in one warning, counted at the end)")
    g.add_argument("--unconditional", action="store_true", help="ignore class labels")
    g.add_argument("--guidance", type=float, default=2.0, help="classifier-free guidance scale for samples")
    g.add_argument("--judge-samples", type=int, default=500, help="samples judged at the end (digits)")
    setup_logging()
    return run_counting_skipped(run, config_from_args(parser.parse_args(argv)), build_task)


if __name__ == "__main__":
    sys.exit(main_guard(main))
