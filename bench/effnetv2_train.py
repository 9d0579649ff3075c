"""effnetv2_cls training step against torchvision's EfficientNetV2, side by side in one process.

    python bench/effnetv2_train.py                      # variant s, batch 32, 64x64 (the issue's setting)
    python bench/effnetv2_train.py --variant b0 --size 32 --batch 128 --stem-stride 1   # the CIFAR recipe
    python bench/effnetv2_train.py --no-compile

One step = forward, cross-entropy, backward, fused AdamW update; medians after warm-up; every ratio is
to torchvision's eager fp32 step (for b0, which torchvision lacks, to zoo's eager fp32).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.bench import time_call, train_step  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="s")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--stem-stride", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))

    def zoo_model():
        return zoo.load("effnetv2_cls", variant=args.variant, num_classes=10, stem_stride=args.stem_stride).train()

    rows = []
    if args.variant in ("s", "m", "l"):
        import torchvision
        rows.append(("torchvision", "eager fp32",
                     lambda: getattr(torchvision.models, f"efficientnet_v2_{args.variant}")(num_classes=10).train(),
                     False, False, False))
    rows += [("zoo", "eager fp32", zoo_model, False, False, False),
             ("zoo", "channels_last", zoo_model, True, False, False),
             ("zoo", "bf16 autocast", zoo_model, False, True, False),
             ("zoo", "bf16+channels_last", zoo_model, True, True, False)]
    if not args.no_compile:
        rows += [("zoo", "compile+channels_last", zoo_model, True, False, True),
                 ("zoo", "compile+bf16+channels_last", zoo_model, True, True, True)]
    print(f"effnetv2 {args.variant} training step, batch {args.batch} x {args.size}^2, stem stride "
          f"{args.stem_stride}, {torch.get_num_threads()} threads")
    print(f"{'model':<12} {'mode':<28} {'s/step':>8} {'img/s':>8} {'ratio':>7}")
    baseline = None
    for label, mode, build, channels_last, bf16, compiled in rows:
        model = build()
        inputs = x
        if channels_last:
            model, inputs = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        if compiled:
            model = zoo_compile(model)
        seconds = time_call(train_step(model, (inputs,), y, bf16), warmup=3 if compiled else 1, reps=args.reps)
        baseline = baseline or seconds
        print(f"{label:<12} {mode:<28} {seconds:8.3f} {args.batch / seconds:8.1f} {baseline / seconds:6.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
