"""bert_cls: what int8 costs and buys on the shipped SST-2 weights (issue: bert_cls).

    python bench/bert_int8.py --dev ../shared/data/sst2/dev.tsv

For fp32, bf16 (autocast, and zoo.accel.cast's weights in bf16) and zoo.accel.quantize's int8 variants:
SST-2 dev accuracy (eager, batches of 32 padded to their longest sentence), the serialised size, and the
time of a batch of 32 x 128 tokens compiled with frozen weights (int8 kernels are only fast under
inductor), each ratio to fp32.
"""
import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel import cast, model_size_bytes, quantize, with_autocast  # noqa: E402
from zoo.bench import time_call  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.data.tables import read_labelled_texts  # noqa: E402


def accuracy(model, batches, labels) -> float:
    correct = 0
    with torch.no_grad():  # not inference_mode: torchao's quantized embedding refuses inference tensors
        for enc, want in zip(batches, labels):
            predicted = model(enc["input_ids"], enc["attention_mask"]).argmax(-1).tolist()
            correct += sum(model.labels[p] == y for p, y in zip(predicted, want))
    return correct / sum(len(w) for w in labels)


def pt2e(fp32, ids, mask, embeddings=False):
    """int8_dynamic through PT2E: a graph module for any batch size and sentence length, with the labels."""
    q = quantize(fp32, "int8_dynamic", backend="pt2e", example_inputs=(ids, mask), dynamic_dims={0: (1,), 1: (1,)},
                 embeddings=embeddings)
    q.labels = fp32.labels
    return q


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev", default="../shared/data/sst2/dev.tsv")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    texts, labels = read_labelled_texts(args.dev, "sentence", "label")
    fp32 = zoo.load("bert_cls", pretrained=True).float().eval()
    raw = sorted(set(labels))  # the train script names the sorted raw labels (0, 1 -> negative, positive)
    if len(raw) != len(fp32.labels):
        raise ValueError(f"dev labels {raw} do not match the model's labels {fp32.labels}")
    labels = [fp32.labels[raw.index(y)] for y in labels]
    # tokenised once for every variant, in batches of 32 padded to their longest sentence
    batches = [fp32.encode(texts[i:i + 32]) for i in range(0, len(texts), 32)]
    labels = [labels[i:i + 32] for i in range(0, len(labels), 32)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (32, 128), generator=g)
    mask = torch.ones(32, 128, dtype=torch.long)

    variants = {
        # copies: compile and with_autocast change a model in place, quantize copies by itself
        "fp32": lambda: copy.deepcopy(fp32),
        "bf16 autocast": lambda: with_autocast(copy.deepcopy(fp32), "cpu", "bf16", force=True),
        "bf16 cast (weights in bf16)": lambda: cast(copy.deepcopy(fp32), "bf16", force=True),
        "int8_dynamic": lambda: quantize(fp32, "int8_dynamic"),
        "int8_dynamic + int8 embeddings": lambda: quantize(fp32, "int8_dynamic", embeddings=True),
        "int8_dynamic (PT2E x86)": lambda: pt2e(fp32, ids, mask),
        "int8_dynamic (PT2E) + int8 embeddings": lambda: pt2e(fp32, ids, mask, embeddings=True),
        "int8_weight_only": lambda: quantize(fp32, "int8_weight_only"),
    }
    print(f"bert_cls sst2 weights, {len(texts)} dev sentences; time: batch 32 x 128, compiled, "
          f"{torch.get_num_threads()} threads")
    print(f"{'variant':<38} {'dev acc':>8} {'size MB':>8} {'smaller':>8} {'ms/batch':>9} {'speed':>6}")
    base = {}
    for name, build in variants.items():
        model = build()
        acc = accuracy(model, batches, labels)
        size = model_size_bytes(model) / 1e6
        compiled = zoo_compile(model, freeze=True)
        with torch.no_grad():
            seconds = time_call(lambda: compiled(ids, mask), warmup=3, reps=args.reps)
        base = base or {"size": size, "s": seconds}
        print(f"{name:<38} {acc:8.4f} {size:8.1f} {base['size'] / size:7.2f}x {seconds * 1e3:9.1f} "
              f"{base['s'] / seconds:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
