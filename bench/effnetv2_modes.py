"""effnetv2_cls: what the fast inference modes cost in accuracy on the shipped CIFAR-10 weights.

    python bench/effnetv2_modes.py --data ../shared/data/cifar10/cifar10_small.npz --save
    python bench/effnetv2_modes.py --quick --no-compile --reps 2    # a smoke run: 64 test images, batch 16

Top-1 on the 2,000-image test split and the time of one batch of 200 (32x32), for eager fp32, the compiled
modes of `zoo bench` (frozen weights): fp32, bf16 weights (zoo.accel.cast) and int8 static (PT2E,
calibrated on 1,000 training images), all channels_last, and onnxruntime (the model through
zoo.accel.export_onnx, fp32) as the peer; the rows timed interleaved round by round, ratios to eager fp32
and to onnxruntime. bf16 rows run only where the CPU has bf16 kernels (--force-emulated times them anyway).
"""
import argparse
import copy
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel import cast, quantize  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.bench import (BenchRun, add_run_arguments, build_row, format_table, onnxruntime_row,  # noqa: E402
                       onnxruntime_settings, time_rows)
from zoo.data.images import load_image_split, tensor_eval_transform  # noqa: E402


def batches(images, transform, size) -> list[torch.Tensor]:
    x = transform(torch.from_numpy(images).permute(0, 3, 1, 2))
    return [x[i:i + size].contiguous(memory_format=torch.channels_last) for i in range(0, len(x), size)]


def top1(model, xs, labels) -> float:
    with torch.no_grad():
        predicted = torch.cat([model(x).argmax(-1) for x in xs])
    return float((predicted == labels).float().mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data/cifar10/cifar10_small.npz")
    parser.add_argument("--quick", action="store_true", help="64 test images, 32 to calibrate, batch 16")
    parser.add_argument("--no-compile", action="store_true", help="time the zoo rows eager (a smoke run)")
    add_run_arguments(parser)
    args = parser.parse_args()
    size, tests, calibrate = (16, 64, 32) if args.quick else (200, None, 1000)
    fp32 = zoo.load("effnetv2_cls", pretrained=True).float().eval().to(memory_format=torch.channels_last)
    pre = fp32.pretrained_meta.preprocessing
    transform = tensor_eval_transform(pre["resize"], small=True, mean=pre["mean"], std=pre["std"])
    x_test, y_test, _ = load_image_split(args.data, "test")
    x_train, _, _ = load_image_split(args.data, "train")
    xs, labels = batches(x_test[:tests], transform, size), torch.as_tensor(y_test[:tests])
    calibration = batches(x_train[:calibrate], transform, size)

    run = BenchRun(f"effnetv2_cls cifar10 weights ({fp32.config.variant}, stem stride {fp32.config.stem_stride}), "
                   f"{len(labels)} test images; time: batch {size} x 32x32"
                   + (", zoo rows eager (--no-compile)" if args.no_compile else ""), peaks=("fp32", "bf16", "int8"))
    run.say(onnxruntime_settings())

    def zoo_row(mode, build, dtype=None, compiled=True):
        columns = {}

        def make():
            model = build()
            if compiled and not args.no_compile:
                model = zoo_compile(model, freeze=True)
            columns["top-1"] = top1(model, xs, labels)  # also the compiled modes' warm-up
            return functools.partial(model, xs[0])
        row = build_row("zoo", mode, make, batch=size, dtype=dtype, context=torch.no_grad,
                        force_emulated=args.force_emulated)
        return {**row, **columns}

    built = [zoo_row("eager fp32", lambda: copy.deepcopy(fp32), compiled=False),
             zoo_row("compile fp32", lambda: copy.deepcopy(fp32)),
             zoo_row("compile bf16 weights", lambda: cast(copy.deepcopy(fp32), "bf16", force=True), torch.bfloat16),
             zoo_row("compile int8 static", lambda: quantize(fp32, "int8_static", calibration=calibration)),
             onnxruntime_row(fp32, (xs[0],), columns=lambda runtime: {"top-1": top1(runtime, xs, labels)})]
    rows = time_rows(built, rounds=args.reps, calls=1, peer="onnxruntime")
    run.finish()
    run.say(f"{args.reps} rounds, one batch of each row per round; ratio: to eager fp32, vs onnxruntime: to "
            f"onnxruntime fp32, medians over rounds")
    run.say(format_table(rows, peer="onnxruntime", columns={"top-1": ".4f"}))
    if args.save:
        run.save("effnetv2_cls_modes")


if __name__ == "__main__":
    main()
