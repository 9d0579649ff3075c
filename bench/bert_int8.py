"""bert_cls: what int8 costs and buys on the shipped SST-2 weights (issue 19 item 2).

    python bench/bert_int8.py --dev ../shared/data/sst2/dev.tsv --save
    python bench/bert_int8.py --quick --reps 2      # a smoke run: 64 sentences, batch 4 x 32

Rows: fp32 eager (the reference), fp32 compiled with frozen weights, bf16 (autocast, and zoo.accel.cast's
weights in bf16; only where the CPU has bf16 kernels, --force-emulated times them anyway), zoo.accel.quantize's
int8_dynamic paths eager and compiled (torchao; PT2E for oneDNN's x86 int8 kernels, with and without int8
embedding tables), what `quantize(model, "int8_dynamic")` returns with no other argument, used as returned,
and onnxruntime (the model through zoo.accel.export_onnx, fp32 and onnxruntime's own dynamic int8). Each row:
SST-2 dev accuracy of the object it times (batches of 32 padded to their longest sentence; compiled rows mark
batch and length dynamic, one compilation for all shapes; the torchao eager row, ~30x slower than fp32 on an
AVX2 CPU, takes the accuracy of its compiled twin, the same int8 weights, and so does torchao compiled for the
timed shape only, fast there and at no other length), the serialised size, and the time of a batch of
--batch x 128 tokens under no_grad, the rows timed interleaved round by round; ratios to fp32 eager and to
onnxruntime fp32. On an AVX2 CPU the torchao rows' accuracy passes (0.04x fp32) take most of a run of half an
hour or more.
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
    parser.add_argument("--batch", type=int, default=16, help="the timed batch of --batch x 128 tokens")
    parser.add_argument("--quick", action="store_true", help="the first 64 dev sentences, time batch 4 x 32")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled rows (a smoke run)")
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
    batch, length = (4, 32) if args.quick else (args.batch, 128)
    ids, mask = fp32.example_inputs(batch, length)
    base_size = model_size_bytes(fp32)

    run = BenchRun(f"bert_cls sst2 weights, {len(texts)} dev sentences; time: batch {batch} x {length} under no_grad",
                   peaks=("fp32", "bf16", "int8"))
    run.say(onnxruntime_settings())
    accuracies = {}  # mode -> dev accuracy, for a row that takes its compiled twin's

    def zoo_row(mode, build, *, compiled, dtype=None, accuracy_of=None, any_length=True):
        """`build()`'s model, compiled with frozen weights where `compiled` (for any batch and length, or with
        `any_length=False` for the timed shape only), as the timed row; its accuracy (of the compiled object: the
        kernels inductor picks are the ones that decide it) and size."""
        columns = {}

        def make():
            model = build()
            size = model_size_bytes(model)
            # batch and length marked dynamic up front, as the default does: one compilation for every shape; else
            # static (dynamic=False: dynamo would otherwise compile dynamic sizes it saw change on earlier rows,
            # which share forward's code object)
            shapes = dict(dynamic_dims=(0, 1)) if any_length else dict(dynamic=False)
            model = zoo_compile(model, freeze=True, **shapes) if compiled else model
            acc = accuracies[accuracy_of] if accuracy_of else accuracy(model, fp32.labels, batches, labels)
            accuracies[mode] = acc
            columns.update({"dev acc": acc, "size MB": size / 1e6, "smaller": base_size / size})
            return functools.partial(model, ids, mask)
        row = build_row("zoo", mode, make, batch=batch, dtype=dtype, warmup=2 if compiled else 1,
                        context=torch.no_grad, force_emulated=args.force_emulated)
        return {**row, **columns}

    def runtime_columns(runtime):
        return {"dev acc": accuracy(runtime, fp32.labels, batches, labels), "size MB": runtime.size_bytes / 1e6,
                "smaller": base_size / runtime.size_bytes}

    def compiled_rows():
        # copies: compile and with_autocast change a model in place, quantize copies by itself
        return [
            zoo_row("fp32 compiled (freeze)", lambda: copy.deepcopy(fp32), compiled=True),
            zoo_row("bf16 autocast compiled", lambda: with_autocast(copy.deepcopy(fp32), "cpu", "bf16", force=True),
                    compiled=True, dtype=torch.bfloat16),
            zoo_row("bf16 cast (weights in bf16) compiled", lambda: cast(copy.deepcopy(fp32), "bf16", force=True),
                    compiled=True, dtype=torch.bfloat16),
            zoo_row("int8 torchao compiled", lambda: quantize(fp32, "int8_dynamic", backend="torchao"), compiled=True),
            zoo_row("int8 torchao eager", lambda: quantize(fp32, "int8_dynamic", backend="torchao"), compiled=False,
                    accuracy_of="int8 torchao compiled"),
            zoo_row("int8 torchao compiled, timed shape only",
                    lambda: quantize(fp32, "int8_dynamic", backend="torchao"), compiled=True,
                    accuracy_of="int8 torchao compiled", any_length=False),
            zoo_row("int8 torchao + int8 embeddings compiled",
                    lambda: quantize(fp32, "int8_dynamic", backend="torchao", embeddings=True), compiled=True),
            zoo_row("int8 PT2E compiled", lambda: pt2e(fp32, ids, mask), compiled=True),
            zoo_row("int8 PT2E + int8 embeddings compiled", lambda: pt2e(fp32, ids, mask, embeddings=True),
                    compiled=True),
        ]
    built = [zoo_row("fp32 eager", lambda: fp32, compiled=False),
             *([] if args.no_compile else compiled_rows()),
             # the default, used as returned: it compiles by itself where it chose a compiled path
             zoo_row("quantize(model, 'int8_dynamic') as returned", lambda: quantize(fp32, "int8_dynamic"),
                     compiled=False),
             onnxruntime_row(fp32, (ids, mask), dynamic_dims=ANY_LENGTH, columns=runtime_columns),
             onnxruntime_row(fp32, (ids, mask), int8=True, dynamic_dims=ANY_LENGTH, columns=runtime_columns)]
    rows = time_rows(built, rounds=args.reps, calls=1, peer="onnxruntime")
    run.finish()
    run.say(f"{args.reps} rounds, one call of each row per round; ratio: to zoo fp32 eager, vs onnxruntime: to "
            f"onnxruntime fp32, medians over rounds of the per-round ratios")
    run.say(format_table(rows, peer="onnxruntime", columns={"dev acc": ".4f", "size MB": ".1f", "smaller": ".2f"}))
    if args.save:
        run.save("bert_cls_int8")


if __name__ == "__main__":
    main()
