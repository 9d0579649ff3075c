"""bert_cls distillation: a student against its teacher, on SST-2 dev (issue 21, the distillation table).

    python bench/distill.py --dev ../shared/data/sst2/dev.tsv --teacher default \
        --student runs/student_kd/model.safetensors --student runs/student_plain/model.safetensors --save

For each model: SST-2 dev accuracy (batches of 32 padded to their longest sentence), parameters, the
training time and steps recorded in its weights, and the eager fp32 time of a batch of 32 dev sentences,
the rows timed interleaved in one process (ratio: teacher time / row time). The header names the CPU
class and this run's fp32 matmul peak before and after the rows.
"""
from __future__ import annotations

import argparse

import torch

import zoo
from zoo.accel.variants import Variant
from zoo.bench import BenchRun, add_run_arguments, build_rows, time_rows
from zoo.data.tables import read_labelled_texts


def dev_batches(model, path: str, size: int = 32):
    texts, labels = read_labelled_texts(path, "sentence", "label")
    for i in range(0, len(texts), size):
        enc = model.tokenizer(texts[i:i + size], truncation=True, max_length=128, padding=True, return_tensors="pt")
        yield enc["input_ids"], enc["attention_mask"], labels[i:i + size]


def accuracy(model, path: str) -> float:
    names = model.labels
    raw = {"0": "negative", "1": "positive"}
    correct = total = 0
    with torch.inference_mode():
        for ids, mask, want in dev_batches(model, path):
            predicted = model(ids, mask).argmax(-1).tolist()
            correct += sum(names[p] == raw.get(y, y) for p, y in zip(predicted, want))
            total += len(want)
    return correct / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--teacher", default="default")
    parser.add_argument("--student", action="append", required=True, help="weights of a student (repeatable)")
    add_run_arguments(parser, reps=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    run = BenchRun("bert_cls distillation on SST-2 dev", peaks=("fp32",))
    models = {"teacher": zoo.load("bert_cls", pretrained=args.teacher).eval()}
    for i, path in enumerate(args.student):
        models[f"student {i + 1}"] = zoo.load("bert_cls", pretrained=path).eval()
    first = next(dev_batches(models["teacher"], args.dev))
    inputs = (first[0], first[1])
    eager = Variant("eager fp32", lambda m, x: (m, x))
    built = [row for label, m in models.items() for row in build_rows(m, inputs, [eager], label=label)]
    rows = time_rows(built, rounds=args.reps, calls=3)
    run.finish()
    run.say(f"rows interleaved, {args.reps} rounds x 3 calls, medians; batch {tuple(inputs[0].shape)}")
    run.say(f"{'model':<10} {'weights':<44} {'layers':>6} {'params':>7} {'dev acc':>8} {'steps':>6} {'train s':>8} "
            f"{'ms/batch':>9} {'speed':>6}  teacher")
    sources = [args.teacher, *args.student]
    for (label, m), row, source in zip(models.items(), rows, sources):
        extra = (m.pretrained_meta.extra if m.pretrained_meta else {}) or {}
        teacher = extra.get("teacher", {}).get("spec", "-") if isinstance(extra.get("teacher"), dict) else "-"
        params = sum(p.numel() for p in m.parameters()) / 1e6
        run.say(f"{label:<10} {source[-44:]:<44} {m.config.layers:>6} {params:6.1f}M {accuracy(m, args.dev):8.4f} "
                f"{extra.get('train_steps', '-'):>6} {extra.get('train_time_s', '-'):>8} {row['ms']:9.1f} "
                f"{row['ratio']:5.2f}x  {teacher}")
    if args.save:
        run.save("bert_cls_distillation")


if __name__ == "__main__":
    main()
