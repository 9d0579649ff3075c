"""effnetv2_cls: what the fast inference modes cost in accuracy on the shipped CIFAR-10 weights.

    python bench/effnetv2_modes.py --data ../shared/data/cifar10/cifar10_small.npz

Top-1 on the 2,000-image test split and the time of one batch of 200 (32x32), for eager fp32 and the
compiled modes of `zoo bench` (frozen weights): fp32, bf16 weights (zoo.accel.cast) and int8 static
(PT2E, calibrated on 1,000 training images), all channels_last; ratios to eager fp32.
"""
import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel import cast, quantize  # noqa: E402
from zoo.bench import time_call  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.data.images import load_image_split, tensor_eval_transform  # noqa: E402

BATCH = 200


def batches(images, transform) -> list[torch.Tensor]:
    x = transform(torch.from_numpy(images).permute(0, 3, 1, 2))
    return [x[i:i + BATCH].contiguous(memory_format=torch.channels_last) for i in range(0, len(x), BATCH)]


def top1(model, xs, labels) -> float:
    with torch.no_grad():
        predicted = torch.cat([model(x).argmax(-1) for x in xs])
    return float((predicted == labels).float().mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data/cifar10/cifar10_small.npz")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    fp32 = zoo.load("effnetv2_cls", pretrained=True).float().eval().to(memory_format=torch.channels_last)
    pre = fp32.pretrained_meta.preprocessing
    transform = tensor_eval_transform(pre["resize"], small=True, mean=pre["mean"], std=pre["std"])
    x_test, y_test, _ = load_image_split(args.data, "test")
    x_train, _, _ = load_image_split(args.data, "train")
    xs, labels = batches(x_test, transform), torch.as_tensor(y_test)
    calibration = batches(x_train[:1000], transform)

    variants = {
        "eager fp32": lambda: copy.deepcopy(fp32),
        "compile fp32": lambda: zoo_compile(copy.deepcopy(fp32), freeze=True),
        "compile bf16 weights": lambda: zoo_compile(cast(copy.deepcopy(fp32), "bf16", force=True), freeze=True),
        "compile int8 static": lambda: zoo_compile(quantize(fp32, "int8_static", calibration=calibration),
                                                   freeze=True),
    }
    print(f"effnetv2_cls cifar10 weights ({fp32.config.variant}, stem stride {fp32.config.stem_stride}), "
          f"{len(labels)} test images; time: batch {BATCH} x 32x32, {torch.get_num_threads()} threads")
    print(f"{'mode':<24} {'top-1':>7} {'ms/batch':>9} {'speed':>6}")
    base = None
    for name, build in variants.items():
        model = build()
        accuracy = top1(model, xs, labels)  # also the compiled modes' warm-up
        with torch.no_grad():
            seconds = time_call(lambda: model(xs[0]), warmup=1, reps=args.reps)
        base = base or seconds
        print(f"{name:<24} {accuracy:7.4f} {seconds * 1e3:9.1f} {base / seconds:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
