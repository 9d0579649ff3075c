"""Train or fine-tune `effnetv2_cls` on an ImageFolder tree or an .npz of uint8 images.

    python train_scripts/effnetv2_cls.py --data ../shared/data/cifar10/cifar10_small.npz --variant b0 \
        --stem-stride 1 --epochs 30 --amp auto
    python train_scripts/effnetv2_cls.py --data DIR --pretrained default --num-classes 5 --freeze-backbone
    python train_scripts/effnetv2_cls.py --eval-only --pretrained default --data ../shared/data/cifar10/cifar10_small.npz

The .npz holds x_train/y_train and x_test/y_test (evaluated each epoch); an ImageFolder has train/
and test/ (or val/) sub-folders, or is one folder of classes. A folder's images may differ in size and
mode (JPEG, PNG, WebP, BMP; grey, palette, RGBA onto white, CMYK, 16-bit; EXIF orientation applied): each
is decoded when its batch is loaded (in the --workers), random-resized-cropped to --image-size for
training and resized + centre-cropped for evaluation. An undecodable file is skipped with a warning that
names it (--strict-data: an error). Data without a test split is evaluated on
--val-fraction of its training images, held out (seed 0). --eval-data takes the held-out set from another
file, e.g. train on cifar10_train50k.npz and test on cifar10_small.npz.

WebDataset tar shards (--data 'shards/train-{000000..000099}.tar', pip install webdataset) hold per sample
an image (KEY.jpg, .jpeg, .png, .webp or .bmp) and its class id (KEY.cls, an integer). Each process reads
whole shards (at least one each), its samples in a seeded order per epoch, every sample once per epoch with
shards of equal size; --resume continues after the samples consumed. Evaluation reads --eval-data shards.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import zoo
from zoo.blocks.tta import TTA_MODES, average_over_flips
from zoo.data.images import (ArrayImages, ProgressiveResize, image_folder_datasets, load_train_and_held_out,
                              run_counting_skipped, tensor_eval_transform, train_transform)
from zoo.data.shards import ShardStream, image_shards, is_shard_pattern
from zoo.train import Task, add_train_args, config_from_args, main_guard, run, setup_logging

CIFAR_MEAN, CIFAR_STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def build_task(cfg) -> Task:
    a = cfg.extra
    if cfg.data is None:
        raise ValueError("--data is required: an ImageFolder directory, an .npz with x_train/y_train or tar shards")
    shards = is_shard_pattern(cfg.data)
    folder = Path(cfg.data).is_dir() or shards  # images of any sizes, decoded per item in the DataLoader's workers
    if shards:  # samples indexed, read in the order and across the ranks that zoo.data.shards describes
        train_data, eval_data, names = image_shards(cfg.data, eval_pattern=a["eval_data"])
        size = a["image_size"]
    elif folder:  # files listed: any number
        train_data, eval_data, names = image_folder_datasets(
            cfg.data, val_fraction=a["val_fraction"], eval_path=a["eval_data"], strict=a["strict_data"])
        size = a["image_size"]  # else the model's preprocessing, below
    else:
        # --eval-data e.g. trains on cifar10_train50k.npz and tests on cifar10_small.npz's x_test
        x_train, y_train, x_test, y_test, names = load_train_and_held_out(
            cfg.data, val_fraction=a["val_fraction"], eval_path=a["eval_data"])
        train_data = ArrayImages(x_train, y_train)
        eval_data = ArrayImages(x_test, y_test) if x_test is not None else None
        size = a["image_size"] or x_train.shape[1]
    small = (size or (32 if a["stem_stride"] == 1 else 224)) <= 64
    mean, std = (CIFAR_MEAN, CIFAR_STD) if small else (IMAGENET_MEAN, IMAGENET_STD)
    resize = None

    table = {k: a[k] for k in TABLE_FLAGS if a[k] is not None}  # main() refused them with --pretrained
    if cfg.pretrained:
        overrides = {"num_classes": cfg.num_classes} if cfg.num_classes else {}
        model = zoo.load("effnetv2_cls", pretrained=cfg.pretrained, **overrides)
        meta = model.pretrained_meta
        if meta and meta.preprocessing.get("mean"):
            mean, std = meta.preprocessing["mean"], meta.preprocessing["std"]
        if folder and size is None and meta and meta.preprocessing.get("crop"):  # the weights' own sizes
            size, resize = meta.preprocessing["crop"], meta.preprocessing.get("resize")
        if cfg.eval_only and meta and meta.labels and len(meta.labels) == len(names):
            names = meta.labels
    else:
        model = zoo.load("effnetv2_cls", variant=a["variant"], stem_stride=a["stem_stride"],
                         num_classes=cfg.num_classes or len(names), drop_path_rate=a["drop_path"], **table)
    if model.config.num_classes != len(names):
        raise ValueError(f"the data has {len(names)} classes but the model {model.config.num_classes}; "
                         "pass --num-classes to re-initialise the head")
    if a["freeze_backbone"]:  # linear probe: only the classifier learns, BN statistics stay as loaded
        model.freeze_backbone()
    if a["channels_last"]:
        model = model.to(memory_format=torch.channels_last)

    k = len(names)
    mixup = _mixup(k, a["mixup"], a["cutmix"])
    # smaller images early in the run (EfficientNetV2's progressive learning), the data's own size at the end
    progressive = ProgressiveResize(a["progressive_resize"]) if a["progressive_resize"] else None

    def loss(m, batch):
        x, y = batch
        if progressive is not None:
            x = progressive(x)
        if mixup is not None:
            x, y = mixup(x, y)  # soft targets (B, k)
        logits = m(x.contiguous(memory_format=torch.channels_last) if a["channels_last"] else x)
        return F.cross_entropy(logits.float(), y, label_smoothing=a["label_smoothing"])

    flips = [(), (-1,)] if a["tta"] == "flip" else [()]

    def eval_step(m, batch):
        x, y = batch
        logits = average_over_flips(m, x, flips).float()  # --tta flip: the mean of the image's and its mirror's
        top5 = logits.topk(min(5, k), dim=1).indices
        pred = top5[:, 0]
        return {"confusion": torch.bincount(y * k + pred, minlength=k * k).view(k, k),
                "top5": (top5 == y[:, None]).any(1).sum()}

    def summarize(s):
        cm = s["confusion"]
        total = cm.sum()
        return {"top1": round(float(cm.diag().sum() / total), 4), "top5": round(float(s["top5"] / total), 4),
                "confusion": cm.tolist()}

    if size is None:  # a folder of any sizes: the model's own (32 with --stem-stride 1, else 224)
        size = model.preprocessing["crop"]
    # images of one size (an .npz) that are small are pad-cropped; a folder's, of any sizes, always
    # random-resized-cropped for training and resized + centre-cropped for evaluation
    crop_as_small = small and not folder
    if train_data is not None:
        train_data.transform = train_transform(size, small=crop_as_small, augment=a["augment"], mean=mean, std=std)
    if eval_data is not None:
        eval_data.transform = tensor_eval_transform(size, small=crop_as_small, mean=mean, std=std, resize=resize)
    if shards:
        train_data = ShardStream(train_data, train_data.index, seed=cfg.seed)
    return Task(
        class_dim=-1,  # logits over the last dimension: --teacher can distil into it
        name="effnetv2_cls", model=model,
        train_data=train_data if not cfg.eval_only else None,
        eval_data=eval_data,
        loss=loss, eval_step=eval_step, summarize=summarize, eval_batch_size=256,
        before_step=progressive.set_step if progressive is not None else None,
        meta={"labels": names, "dataset": str(cfg.data),
              "preprocessing": {"resize": resize or size, "crop": size, "mean": mean, "std": std, "interpolation": "bilinear"},
              **({"extra": {"eval_tta": a["tta"]}} if a["tta"] != "none" else {})},  # the metrics were measured so
    )


TABLE_FLAGS = ("widths", "depths", "strides")  # EffNetV2Config fields that replace the variant's stage table


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,2,1,1,2, got {text!r}")


def _mixup(num_classes: int, mixup: float, cutmix: float):
    from torchvision.transforms import v2 as T
    chosen = ([T.MixUp(alpha=mixup, num_classes=num_classes)] if mixup > 0 else []) + \
             ([T.CutMix(alpha=cutmix, num_classes=num_classes)] if cutmix > 0 else [])
    return T.RandomChoice(chosen) if chosen else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser, lr=3e-3, weight_decay=0.05, warmup=200, batch_size=128, out="runs/effnetv2_cls")
    g = parser.add_argument_group("effnetv2_cls")
    g.add_argument("--variant", default="b0", choices=["b0", "b1", "b2", "b3", "s", "m", "l"])
    g.add_argument("--stem-stride", type=int, default=None, help="1 keeps resolution for small images (default "
                   "for images <= 64 px)")
    for name, what in (("widths", "channels of the stem, of each stage and of the head conv"),
                       ("depths", "blocks per stage"), ("strides", "stride (1 or 2) of each stage's first block")):
        g.add_argument(f"--{name}", type=_ints, default=None, metavar="N,N,...",
                       help=f"{what}, replacing the variant's table (a new model only)")
    g.add_argument("--eval-data", default=None, help="held-out set (.npz x_test/y_test or ImageFolder test/) "
                   "when --data has none; with shards as --data, a shard pattern")
    g.add_argument("--val-fraction", type=float, default=0.1, help="share of the training images held out for "
                   "evaluation when the data has no test split (x_test, test/ or val/); 0: no evaluation")
    g.add_argument("--image-size", type=int, default=None, help="train/eval size (default: the .npz's; for an "
                   "ImageFolder the weights' preprocessing, else 32 with --stem-stride 1 and 224 otherwise)")
    g.add_argument("--strict-data", action="store_true", help="an ImageFolder file that cannot be decoded is "
                   "an error (default: skipped, named in one warning, counted at the end)")
    g.add_argument("--augment", default="trivial", choices=["trivial", "randaugment", "none"])
    g.add_argument("--label-smoothing", type=float, default=0.1)
    g.add_argument("--mixup", type=float, default=0.0, help="MixUp alpha (0 = off)")
    g.add_argument("--cutmix", type=float, default=0.0, help="CutMix alpha (0 = off)")
    g.add_argument("--drop-path", type=float, default=0.1)
    g.add_argument("--progressive-resize", default=None, metavar="SIZE:UNTIL,...",
                   help="train on smaller images first: e.g. 16:0.4,24:0.7 = 16 px for the first 40%% of the "
                        "steps, 24 px to 70%%, then the data's size (EfficientNetV2's progressive learning)")
    g.add_argument("--freeze-backbone", action="store_true", help="linear probe: train only the head")
    g.add_argument("--channels-last", action="store_true")
    g.add_argument("--tta", default="none", choices=TTA_MODES, help="test-time augmentation for evaluation: "
                   "flip averages the logits of each image and its horizontal mirror (twice the evaluation time)")
    args = parser.parse_args(argv)
    table = [f"--{k}" for k in TABLE_FLAGS if getattr(args, k) is not None]
    if args.pretrained and table:  # before any data is read
        parser.error(f"{'/'.join(table)} shape a new model; the --pretrained weights bring their own table "
                     "(drop the flag, or drop --pretrained to train from scratch)")
    if args.stem_stride is None:
        args.stem_stride = 1 if (args.image_size or 32) <= 64 else 2
    setup_logging()
    return run_counting_skipped(run, config_from_args(args), build_task)  # and the undecodable files' count


if __name__ == "__main__":
    sys.exit(main_guard(main))
