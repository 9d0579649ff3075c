"""effnetv2_cls training step against torchvision's EfficientNetV2, side by side in one process.

    python bench/effnetv2_train.py --save               # variant s, batch 32, 64x64 (the issue's setting)
    python bench/effnetv2_train.py --variant b0 --size 32 --batch 128 --stem-stride 1   # the CIFAR recipe
    python bench/effnetv2_train.py --variant b0 --size 32 --batch 2 --no-compile --reps 2   # a smoke run
    python bench/effnetv2_train.py --variant b0 --size 16 --batch 128 --stem-stride 1 --no-compile --save \
        --save-as effnetv2_cls_train_16px   # the small-map depthwise path against the plain conv

One step = forward, cross-entropy, backward, fused AdamW update; rows interleaved (one step of each per
round, the order rotating), medians over rounds; ratios to zoo's eager fp32 step and to torchvision's
(variants s/m/l; torchvision has no b0-b3) within each round. bf16 rows run only where the CPU has bf16
kernels (--force-emulated times them anyway). "plain depthwise conv" is channels_last with the depthwise
convs' small-map training path off (zoo.models.effnetv2.DepthwiseConv2d): what it saves where maps shrink
below the kernel (CIFAR-sized images).
"""
import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.bench import BenchRun, add_run_arguments, build_row, format_table, time_rows, train_step  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="s")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--stem-stride", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--save-as", default="effnetv2_cls_train", help="results file name (before the CPU tag)")
    add_run_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))

    def zoo_model():
        return zoo.load("effnetv2_cls", variant=args.variant, num_classes=10, stem_stride=args.stem_stride).train()

    def plain_depthwise_model():
        from zoo.models.effnetv2 import DepthwiseConv2d
        model = zoo_model()
        for m in model.modules():
            if isinstance(m, DepthwiseConv2d):
                m.__class__ = torch.nn.Conv2d  # same parameters, the plain forward
        return model

    def torchvision_model():
        import torchvision
        return getattr(torchvision.models, f"efficientnet_v2_{args.variant}")(num_classes=10).train()

    # (model, mode, builder, channels_last, bf16, compiled)
    specs = [("zoo", "eager fp32", zoo_model, False, False, False),
             ("zoo", "channels_last", zoo_model, True, False, False),
             ("zoo", "plain depthwise conv", plain_depthwise_model, True, False, False),
             ("zoo", "bf16 autocast", zoo_model, False, True, False),
             ("zoo", "bf16+channels_last", zoo_model, True, True, False)]
    if not args.no_compile:
        specs += [("zoo", "compile+channels_last", zoo_model, True, False, True),
                  ("zoo", "compile+bf16+channels_last", zoo_model, True, True, True)]
    peer = "torchvision" if args.variant in ("s", "m", "l") else None
    if peer:
        specs.insert(1, ("torchvision", "eager fp32", torchvision_model, False, False, False))

    def step(build, channels_last, bf16, compiled):
        model, inputs = build(), x
        if channels_last:
            model, inputs = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        return train_step(zoo_compile(model) if compiled else model, (inputs,), y, bf16)

    run = BenchRun(f"effnetv2 {args.variant} training step, batch {args.batch} x {args.size}^2, stem stride "
                   f"{args.stem_stride}")
    built = [build_row(label, mode, lambda s=spec: step(*s), batch=args.batch,
                       dtype=torch.bfloat16 if spec[2] else None, warmup=3 if spec[3] else 1,
                       context=contextlib.nullcontext, force_emulated=args.force_emulated)
             for label, mode, *spec in specs]
    rows = time_rows(built, rounds=args.reps, calls=1, peer=peer)
    run.finish()
    run.say(f"{args.reps} rounds, one step of each row per round; ratio: to zoo eager fp32"
            + (", vs torchvision: to torchvision eager fp32" if peer else "") + ", medians over rounds")
    run.say(format_table(rows, peer=peer, unit="step", items="img"))
    if args.save:
        run.save(args.save_as)


if __name__ == "__main__":
    main()
