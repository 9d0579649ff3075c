"""bert_cls training step against transformers' BertForSequenceClassification, side by side in one process.

    python bench/bert_train.py                          # MiniLM-L6 layout, batch 32 x 128, the train script's dropouts
    python bench/bert_train.py --hidden-dropout 0       # what the step costs without dropout's random numbers

One step = forward, cross-entropy, backward, fused AdamW update, on the same weights and inputs for both
libraries; medians after warm-up; every ratio is to transformers' eager fp32 step. Attention dropout is 0
as in train_scripts/bert_cls.py (with it, SDPA falls back to its slow math kernel in both libraries).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel.bench import time_call, train_step  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = {"hidden_dropout": args.hidden_dropout, "attention_dropout": args.attention_dropout}
    inputs = zoo.load("bert_cls", **config).example_inputs(args.batch, args.length)
    labels = torch.randint(0, 2, (args.batch,))

    def zoo_model():
        torch.manual_seed(0)
        return zoo.load("bert_cls", **config).train()

    def peer_model():
        return zoo_model().peer_model()[1].train()

    rows = [("transformers", "eager fp32", peer_model, False, False),
            ("transformers", "bf16 autocast", peer_model, True, False),
            ("zoo", "eager fp32", zoo_model, False, False),
            ("zoo", "bf16 autocast", zoo_model, True, False)]
    if not args.no_compile:
        rows += [("zoo", "compile", zoo_model, False, True), ("zoo", "compile+bf16", zoo_model, True, True)]
    print(f"bert_cls training step, batch {args.batch} x {args.length} tokens, hidden dropout {args.hidden_dropout}, "
          f"attention dropout {args.attention_dropout}, {torch.get_num_threads()} threads")
    print(f"{'model':<14} {'mode':<16} {'s/step':>8} {'seq/s':>8} {'ratio':>7}")
    baseline = None
    for label, mode, build, bf16, compiled in rows:
        model = build()
        if compiled:
            model = zoo_compile(model)
        seconds = time_call(train_step(model, inputs, labels, bf16), warmup=3 if compiled else 1, reps=args.reps)
        baseline = baseline or seconds
        print(f"{label:<14} {mode:<16} {seconds:8.3f} {args.batch / seconds:8.1f} {baseline / seconds:6.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
