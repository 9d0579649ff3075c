"""bert_cls: what int8 costs and buys on the shipped SST-2 weights (issue: bert_cls).

    python bench/bert_int8.py --dev ../shared/data/sst2/dev.tsv --save
    python bench/bert_int8.py --quick --no-compile --reps 2     # a smoke run: 64 sentences, batch 4 x 32

For fp32, bf16 (autocast, and zoo.accel.cast's weights in bf16), zoo.accel.quantize's int8 variants and
onnxruntime (the model through zoo.accel.export_onnx, fp32 and onnxruntime's own dynamic int8): SST-2 dev
accuracy (batches of 32 padded to their longest sentence; the zoo rows eager), the serialised size, and the
time of a batch of 32 x 128 tokens compiled with frozen weights (int8 kernels are only fast under
inductor), the rows timed interleaved round by round; ratios to fp32 and to onnxruntime fp32. bf16 rows run
only where the CPU has bf16 kernels (--force-emulated times them anyway).
"""
import argparse
import copy
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel import cast, model_size_bytes, quantize, with_autocast  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.bench import (BenchRun, add_run_arguments, build_row, format_table, onnxruntime_row,  # noqa: E402
                       onnxruntime_settings, time_rows)
from zoo.data.tables import read_labelled_texts  # noqa: E402

ANY_LENGTH = {0: (1,), 1: (1,)}  # batch and sequence length dynamic in both inputs (ids, mask)


def accuracy(model, names, batches, labels) -> float:
    correct = 0
    with torch.no_grad():  # not inference_mode: torchao's quantized embedding refuses inference tensors
        for enc, want in zip(batches, labels):
            predicted = model(enc["input_ids"], enc["attention_mask"]).argmax(-1).tolist()
            correct += sum(names[p] == y for p, y in zip(predicted, want))
    return correct / sum(len(w) for w in labels)


def pt2e(fp32, ids, mask, embeddings=False):
    """int8_dynamic through PT2E: a graph module for any batch size and sentence length."""
    return quantize(fp32, "int8_dynamic", backend="pt2e", example_inputs=(ids, mask), dynamic_dims=ANY_LENGTH,
                    embeddings=embeddings)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev", default="../shared/data/sst2/dev.tsv")
    parser.add_argument("--quick", action="store_true", help="the first 64 dev sentences, time batch 4 x 32")
    parser.add_argument("--no-compile", action="store_true", help="time the zoo rows eager (a smoke run)")
    add_run_arguments(parser)
    args = parser.parse_args()
    texts, labels = read_labelled_texts(args.dev, "sentence", "label")
    if args.quick:
        texts, labels = texts[:64], labels[:64]
    fp32 = zoo.load("bert_cls", pretrained=True).float().eval()
    raw = sorted(set(labels))  # the train script names the sorted raw labels (0, 1 -> negative, positive)
    if len(raw) != len(fp32.labels):
        raise ValueError(f"dev labels {raw} do not match the model's labels {fp32.labels}")
    labels = [fp32.labels[raw.index(y)] for y in labels]
    # tokenised once for every variant, in batches of 32 padded to their longest sentence
    batches = [fp32.encode(texts[i:i + 32]) for i in range(0, len(texts), 32)]
    labels = [labels[i:i + 32] for i in range(0, len(labels), 32)]
    batch, length = (4, 32) if args.quick else (32, 128)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    base_size = model_size_bytes(fp32)

    run = BenchRun(f"bert_cls sst2 weights, {len(texts)} dev sentences; time: batch {batch} x {length}, "
                   f"{'eager' if args.no_compile else 'compiled with frozen weights'}", peaks=("fp32", "bf16", "int8"))
    run.say(onnxruntime_settings())

    def zoo_row(mode, build, dtype=None):
        """Accuracy and size of the built model (eager), then its compiled call as the timed row."""
        columns = {}

        def make():
            model = build()
            columns.update({"dev acc": accuracy(model, fp32.labels, batches, labels),
                            "size MB": model_size_bytes(model) / 1e6, "smaller": base_size / model_size_bytes(model)})
            return functools.partial(model if args.no_compile else zoo_compile(model, freeze=True), ids, mask)
        row = build_row("zoo", mode, make, batch=batch, dtype=dtype, warmup=1 if args.no_compile else 3,
                        context=torch.no_grad, force_emulated=args.force_emulated)
        return {**row, **columns}

    def runtime_columns(runtime):
        return {"dev acc": accuracy(runtime, fp32.labels, batches, labels), "size MB": runtime.size_bytes / 1e6,
                "smaller": base_size / runtime.size_bytes}

    # copies: compile and with_autocast change a model in place, quantize copies by itself
    built = [zoo_row("fp32", lambda: copy.deepcopy(fp32)),
             zoo_row("bf16 autocast", lambda: with_autocast(copy.deepcopy(fp32), "cpu", "bf16", force=True),
                     torch.bfloat16),
             zoo_row("bf16 cast (weights in bf16)", lambda: cast(copy.deepcopy(fp32), "bf16", force=True),
                     torch.bfloat16),
             zoo_row("int8_dynamic", lambda: quantize(fp32, "int8_dynamic")),
             zoo_row("int8_dynamic + int8 embeddings", lambda: quantize(fp32, "int8_dynamic", embeddings=True)),
             zoo_row("int8_dynamic (PT2E x86)", lambda: pt2e(fp32, ids, mask)),
             zoo_row("int8_dynamic (PT2E) + int8 embeddings", lambda: pt2e(fp32, ids, mask, embeddings=True)),
             zoo_row("int8_weight_only", lambda: quantize(fp32, "int8_weight_only")),
             onnxruntime_row(fp32, (ids, mask), dynamic_dims=ANY_LENGTH, columns=runtime_columns),
             onnxruntime_row(fp32, (ids, mask), int8=True, dynamic_dims=ANY_LENGTH, columns=runtime_columns)]
    rows = time_rows(built, rounds=args.reps, calls=1, peer="onnxruntime")
    run.finish()
    run.say(f"{args.reps} rounds, one call of each row per round; ratio: to zoo fp32, vs onnxruntime: to "
            f"onnxruntime fp32, medians over rounds")
    run.say(format_table(rows, peer="onnxruntime", columns={"dev acc": ".4f", "size MB": ".1f", "smaller": ".2f"}))
    if args.save:
        run.save("bert_cls_int8")


if __name__ == "__main__":
    main()
