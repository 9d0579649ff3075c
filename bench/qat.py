"""PTQ vs QAT at equal fine-tuning steps (issue 20 item 4): fp32, int8 after training (post-training
quantization) and int8 of weights fine-tuned with `--qat int8`.

    # effnetv2_cls, CIFAR-10, int8 static: two fine-tunes of the shipped weights, the second with --qat int8
    python train_scripts/effnetv2_cls.py --data ../shared/data/cifar10/cifar10_small.npz \
        --pretrained weights/effnetv2_cls.cifar10.safetensors --steps 300 --lr 1e-4 --warmup 30 \
        --batch-size 64 --eval-every 300 --out runs/qat_table/effnet_fp32
    python train_scripts/effnetv2_cls.py ...the same... --qat int8 --out runs/qat_table/effnet_qat
    python bench/qat.py effnetv2_cls --fp32 runs/qat_table/effnet_fp32/model.safetensors \
        --qat runs/qat_table/effnet_qat/model.safetensors --calibration 4,8 --save \
        -- --data ../shared/data/cifar10/cifar10_small.npz

    # transformer_lm, Tiny Shakespeare, int8 dynamic: validation loss
    python train_scripts/transformer_lm.py --data ../shared/data/tinyshakespeare/input.txt \
        --pretrained weights/transformer_lm.tinyshakespeare.safetensors --steps 150 --lr 1e-4 --warmup 15 \
        --eval-every 150 --out runs/qat_table/lm_fp32
    python train_scripts/transformer_lm.py ...the same... --qat int8 --out runs/qat_table/lm_qat
    python bench/qat.py transformer_lm --fp32 runs/qat_table/lm_fp32/model.safetensors \
        --qat runs/qat_table/lm_qat/model.safetensors --save -- --data ../shared/data/tinyshakespeare/input.txt

The arguments after `--` are the train script's: each weights file is evaluated as that script evaluates it
(the Task its build_task makes with them and `--pretrained FILE`: its evaluation data, step and summary).
int8 is `zoo.accel.quantize` with the method the --qat run trained for (its metadata's qat_method:
int8_static for a convolutional model, calibrated on --calibration batches of the script's training data;
int8_dynamic for a Linear-only one, through PT2E's x86 quantizer as --qat simulates it unless --backend
torchao), i.e. the int8 model a user makes of each file. The QAT row also shows
the metric its run recorded, the fake-quantized model's evaluation. The two fine-tunes differ in one more
way than the fake quantizers: --qat trains without dropout and stochastic depth (zoo.train.qat says why).

The calibration batches are the training data's first ones, in order. Found with this bench (AVX2 EPYC,
session 9): training image 332 of cifar10_small drives the shipped effnetv2_cls's head convolution to 5,290
(the median image: 11), 47,800 after the fp32 fine-tune; a calibration that sees it (8 batches of 64) sets
per-tensor activation ranges ~25x too wide and PTQ falls to chance (0.10-0.27 over runs; the QAT weights'
int8 to 0.33-0.84: the batches are augmented at random), while 4 batches keep 0.848 (fp32 0.847). Hence
`--calibration 4,8`, both in the saved table. zoo.accel.quantize now warns of such a batch (session 10: batches
1, 3, 5 and 6 of those 8 drive stages.5.7's squeeze-excite 29-276x past the other batches' median).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import zoo  # noqa: E402
from zoo.bench import BenchRun  # noqa: E402
from zoo.train import Task  # noqa: E402
from zoo.train.qat import first_call, quantized_method  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def script_task(family: str, argv: list[str]) -> tuple[Task, object]:
    """(Task, TrainConfig) as `train_scripts/<family>.py argv` builds them, without training: the script's
    `run` is replaced by one that only calls its build_task."""
    spec = importlib.util.spec_from_file_location(f"train_script_{family}", ROOT / "train_scripts" / f"{family}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    built = {}

    def build_only(cfg, build_task):
        built.update(task=build_task(cfg), cfg=cfg)
        return {}
    script.run = build_only
    script.main(argv)
    return built["task"], built["cfg"]


def batches(task: Task, data, size: int):
    return DataLoader(data, batch_size=size, collate_fn=task.collate)


@torch.no_grad()
def evaluate(model, task: Task, size: int) -> dict:
    """The task's metrics of `model` on its evaluation data (one process, as Trainer.evaluate sums them)."""
    sums: dict = {}
    for batch in batches(task, task.eval_data, task.eval_batch_size or size):
        for k, v in task.eval_step(model, batch).items():
            v = v.double() if v.is_floating_point() else v.long()
            sums[k] = sums[k] + v if k in sums else v
    return task.summarize(sums)


def int8_model(model, method: str, task: Task, size: int, n: int, backend: str):
    """zoo.accel.quantize's `method` model of `model`, traced (PT2E) on the script's training batches as its loss
    calls the model, every dimension but the batch also free to take other sizes (sequence lengths)."""
    calls = [first_call(task.loss, b)[0] for b in itertools.islice(batches(task, task.train_data, size), n)]
    free = {i: tuple(range(1, t.dim())) for i, t in enumerate(calls[0]) if isinstance(t, torch.Tensor) and t.dim() > 1}
    if method == "int8_static":
        return zoo.accel.quantize(model, method, calibration=calls, dynamic_dims=free)
    if backend == "torchao":
        return zoo.accel.quantize(model, method, backend="torchao")
    return zoo.accel.quantize(model, method, backend="pt2e", example_inputs=calls[0], dynamic_dims=free)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=zoo.list_models())
    parser.add_argument("--fp32", required=True, help="weights fine-tuned without --qat")
    parser.add_argument("--qat", required=True, help="weights fine-tuned with --qat int8 (the same steps)")
    parser.add_argument("--metric", default=None, help="the metric shown (default: the script's first number)")
    parser.add_argument("--calibration", default="8",
                        help="training batches int8_static calibrates on; a comma-separated list gives an int8 "
                             "column per count (e.g. 4,8: one unusual image can set a range, see the docstring)")
    parser.add_argument("--backend", default="pt2e", choices=["pt2e", "torchao"],
                        help="int8_dynamic's: pt2e is the x86 quantizer --qat trains for (per-tensor activation "
                             "ranges); torchao quantizes activations per token")
    parser.add_argument("--save", action="store_true", help="write bench/results/<family>_qat.<cpu class>.txt")
    args, script_argv = parser.parse_known_args()
    script_argv = [a for a in script_argv if a != "--"]
    calibrations = [int(n) for n in args.calibration.split(",")]
    torch.manual_seed(0)
    run = BenchRun(f"{args.family}: fp32, int8 PTQ and int8 QAT at equal fine-tuning steps", peaks=("fp32",))
    rows = []
    with tempfile.TemporaryDirectory() as out:  # the script claims no folder without training, but wants --out
        for label, path in (("fp32 fine-tune, PTQ", args.fp32), ("QAT fine-tune", args.qat)):
            task, cfg = script_task(args.family, [*script_argv, "--pretrained", path, "--steps", "1", "--out", out])
            model = task.model.eval()
            extra = model.pretrained_meta.extra if model.pretrained_meta else {}
            method = extra.get("qat_method") or quantized_method(model)
            fp32 = evaluate(model, task, cfg.batch_size)
            # int8_dynamic calibrates nothing: one column whatever the counts
            counts = calibrations if method == "int8_static" else calibrations[-1:]
            int8 = [evaluate(int8_model(model, method, task, cfg.batch_size, n, args.backend), task, cfg.batch_size)
                    for n in counts]
            recorded = model.pretrained_meta.metrics if extra.get("qat") else {}
            rows.append((label, path, extra.get("train_steps", "-"), method, fp32, int8, recorded))
    run.finish()
    numbers = [k for k, v in rows[0][4].items() if isinstance(v, (int, float))]
    metric = args.metric or numbers[0]
    static = rows[0][3] == "int8_static"
    heads = [f"int8 {metric} ({n} cal)" for n in calibrations] if static else [f"int8 {metric}"]
    run.say(f"{'weights':<20} {'file':<44} {'steps':>6} {'int8 method':<13} {'fp32 ' + metric:>14} "
            + " ".join(f"{h:>18}" for h in heads) + f" {'run (fake int8)':>16}")
    for label, path, steps, method, fp32, int8, recorded in rows:
        run.say(f"{label:<20} {path[-44:]:<44} {steps:>6} {method:<13} {fp32[metric]:>14.4f} "
                + " ".join(f"{r[metric]:>18.4f}" for r in int8) + f" {recorded.get(metric, '-'):>16}")
    if args.save:
        run.save(f"{args.family}_qat")


if __name__ == "__main__":
    main()
