"""Train `unet3d_seg` on generated volumes or a folder of NAME.npy / NAME_label.npy pairs.

    python train_scripts/unet3d_seg.py --data synthetic --steps 2000 --amp auto --checkpointing blocks
    python train_scripts/unet3d_seg.py --data synthetic-random --steps 6000 --train-volumes 4000
    python train_scripts/unet3d_seg.py --eval-only --pretrained default --data synthetic-random

--data synthetic trains on `synthetic_volume` (classes told apart by a fixed intensity); synthetic-random
on `randomised_volume` (nested organ / lesion shapes, appearance drawn per volume; see zoo/data/volumes.py).
Training takes random crops with flips; evaluation runs sliding-window inference over whole held-out
volumes of the training generator (seeds 10000+) and reports their mean foreground Dice (mean_dice, the
dice_C per class, fg_dice for all foreground classes merged into one) and, for generated data, the same on
volumes of `independent_volume`, a generator never trained on (mean_dice_unseen, dice_C_unseen,
fg_dice_unseen; --unseen-volumes 0 leaves them out).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import zoo
from zoo.blocks.tta import TTA_MODES
from zoo.data.volumes import GENERATORS, SyntheticVolumes, VolumeFolder
from zoo.models.unet3d import UNet3dConfig, dice_ce_loss, dice_per_class, smallest_window
from zoo.models.base import unwrap
from zoo.train import Task, add_train_args, config_from_args, main_guard, run, setup_logging


class RandomCropFlip:
    """A random crop of `size` (padding volumes smaller than it) and random flips along each axis."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image, label):
        pad = [max(0, self.size - s) for s in label.shape]
        if any(pad):
            flat = [p for d in reversed(pad) for p in (0, d)]
            image, label = F.pad(image, flat), F.pad(label, flat)
        starts = [int(torch.randint(0, s - self.size + 1, (1,))) for s in label.shape]
        region = tuple(slice(s, s + self.size) for s in starts)
        image, label = image[(slice(None), *region)], label[region]
        for axis in range(3):
            if torch.rand(()) < 0.5:
                image, label = image.flip(axis + 1), label.flip(axis)
        return image.contiguous(), label.contiguous()


class Sources(torch.utils.data.Dataset):
    """Several evaluation sets as one: item i of the whole is (image, label, index of its set)."""

    def __init__(self, *sets):
        self.sets = [d for d in sets]
        self.offsets = [0]
        for d in self.sets:
            self.offsets.append(self.offsets[-1] + len(d))

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, i):
        source = max(j for j, start in enumerate(self.offsets[:-1]) if start <= i)
        image, label = self.sets[source][i - self.offsets[source]]
        return image, label, source


def build_task(cfg) -> Task:
    a = cfg.extra
    if cfg.qat:  # found only at the first evaluation otherwise, after training steps
        raise ValueError("--qat trains a traced graph of the model's forward, and unet3d_seg evaluates by "
                         "sliding-window inference (the model's predict_volume), which that graph lacks: train "
                         "without --qat")
    if cfg.data is None:
        raise ValueError("--data is required: 'synthetic', 'synthetic-random' or a folder of NAME.npy / "
                         "NAME_label.npy pairs")
    architecture = [f"--{k.replace('_', '-')}" for k in ("preset", "norm", "deep_supervision") if a[k]]
    if cfg.pretrained and architecture:
        raise ValueError(f"--pretrained {cfg.pretrained} brings its own architecture; {', '.join(architecture)} "
                         "would be ignored: drop them, or train from scratch without --pretrained")
    smallest = smallest_window(UNet3dConfig(preset=a["preset"] or "base"))
    if a["crop"] < smallest and not cfg.pretrained:
        raise ValueError(f"--crop {a['crop']} is too small for preset {a['preset'] or 'base'}: its downsamplings "
                         f"need at least {smallest} voxels per side")
    crop = RandomCropFlip(a["crop"])
    generated = cfg.data in GENERATORS and cfg.data != "unseen"
    if generated:
        shape, num_classes = (a["volume"],) * 3, cfg.num_classes or 3
        train = SyntheticVolumes(a["train_volumes"], first_seed=0, shape=shape, num_classes=num_classes,
                                 transform=crop, generator=cfg.data)
        own = SyntheticVolumes(a["val_volumes"], first_seed=10_000, shape=shape, num_classes=num_classes,
                               generator=cfg.data)  # held-out seeds
        unseen = SyntheticVolumes(a["unseen_volumes"], first_seed=10_000, shape=shape, num_classes=num_classes,
                                  generator="unseen")  # never trained on, by any --data
        val = Sources(own, unseen)
    elif cfg.data == "unseen":
        raise ValueError("--data unseen is the evaluation-only generator: train on synthetic or synthetic-random")
    else:
        train, val = VolumeFolder(cfg.data, transform=crop), Sources(VolumeFolder(a["eval"] or cfg.data))
        num_classes = cfg.num_classes or int(max(int(val[i][1].max()) for i in range(len(val)))) + 1
    if cfg.pretrained:
        model = zoo.load("unet3d_seg", pretrained=cfg.pretrained, checkpointing=a["checkpointing"])
        if a["crop"] < model.smallest_window():
            raise ValueError(f"--crop {a['crop']} is too small for {cfg.pretrained}: its downsamplings need at "
                             f"least {model.smallest_window()} voxels per side")
    else:
        model = zoo.load("unet3d_seg", preset=a["preset"] or "base", num_classes=num_classes,
                         norm=a["norm"] or "instance",
                         deep_supervision=a["deep_supervision"], checkpointing=a["checkpointing"])
    k = model.config.num_classes

    def loss(m, batch):
        image, label = batch
        out = m(image)
        if not isinstance(out, list):
            return dice_ce_loss(out, label)
        total = dice_ce_loss(out[0], label)
        for i, aux in enumerate(out[1:], start=1):  # deep supervision, weights 1/2, 1/4
            small = F.interpolate(label[:, None].float(), size=aux.shape[2:], mode="nearest")[:, 0].long()
            total = total + 0.5 ** i * dice_ce_loss(aux, small)
        return total

    def eval_step(m, batch):
        images, labels, sources = batch
        plain = unwrap(m)  # sliding-window inference is a method; evaluation needs no gradient all-reduce
        sums = torch.zeros(2, 2, k)  # per source (own generator, unseen one), per class: Dice sum, volumes with it
        merged = torch.zeros(2, 2)  # per source: Dice of all foreground merged into one class, volumes
        for image, label, source in zip(images, labels, sources.tolist()):
            pred = plain.predict_volume(image, window=a["crop"], tta=a["tta"]).cpu()  # --tta flip: 8 flips averaged
            label = label.cpu()
            for c, d in dice_per_class(pred, label, k).items():
                sums[source, 0, c] += d
                sums[source, 1, c] += 1
            for d in dice_per_class((pred > 0).long(), (label > 0).long(), 2).values():
                merged[source] += torch.tensor([d, 1.0])
        return {"dice": sums, "fg_dice": merged}

    def summarize(s):
        metrics = {}
        for source, suffix in enumerate(("", "_unseen")):
            if s["fg_dice"][source, 1] == 0:  # no volumes from this source
                continue
            per_class = (s["dice"][source, 0] / s["dice"][source, 1].clamp_min(1))[1:]
            metrics.update({f"mean_dice{suffix}": round(float(per_class.mean()), 4),
                            **{f"dice_{c + 1}{suffix}": round(float(v), 4) for c, v in enumerate(per_class)},
                            f"fg_dice{suffix}": round(float(s["fg_dice"][source, 0] / s["fg_dice"][source, 1]), 4)})
        return metrics

    return Task(
        name="unet3d_seg", model=model, train_data=train if not cfg.eval_only else None, eval_data=val,
        loss=loss, eval_step=eval_step, summarize=summarize, eval_batch_size=1,
        meta={"labels": ["background"] + [f"class {c}" for c in range(1, k)],
              "dataset": (f"{'synthetic' if cfg.data == 'synthetic' else 'randomised synthetic'} volumes "
                          f"{a['volume']}^3, train seeds 0..{a['train_volumes'] - 1}, held-out seeds "
                          f"10000..{10_000 + a['val_volumes'] - 1}"
                          + (f"; independent (unseen) generator seeds 10000..{10_000 + a['unseen_volumes'] - 1}"
                             if a["unseen_volumes"] else "")) if generated else cfg.data,
              "preprocessing": {"window": a["crop"], "overlap": 0.25, "blend": "gaussian"},
              **({"extra": {"eval_tta": a["tta"]}} if a["tta"] != "none" else {})},  # the metrics were measured so
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser, lr=2e-3, weight_decay=1e-4, warmup=50, batch_size=2, out="runs/unet3d_seg")
    g = parser.add_argument_group("unet3d_seg")
    g.add_argument("--eval", default=None, help="folder of held-out pairs (folder data)")
    g.add_argument("--preset", choices=["small", "base", "deep"], help="default: base (--pretrained: the weights')")
    g.add_argument("--norm", choices=["instance", "group", "batch"], help="default: instance")
    g.add_argument("--deep-supervision", action="store_true")
    g.add_argument("--checkpointing", default="none", help="none | blocks | every_k | selective")
    g.add_argument("--crop", type=int, default=48, help="training crop and inference window")
    g.add_argument("--volume", type=int, default=64, help="synthetic volume side")
    g.add_argument("--train-volumes", type=int, default=200)
    g.add_argument("--val-volumes", type=int, default=8, help="held-out volumes of the training generator")
    g.add_argument("--unseen-volumes", type=int, default=8,
                   help="volumes of the independent evaluation generator (generated --data only; 0: none)")
    g.add_argument("--tta", default="none", choices=TTA_MODES, help="test-time augmentation for evaluation: flip "
                   "averages the class probabilities over the 8 flips of the three axes (8x the evaluation time)")
    setup_logging()
    return run(config_from_args(parser.parse_args(argv)), build_task)


if __name__ == "__main__":
    sys.exit(main_guard(main))
