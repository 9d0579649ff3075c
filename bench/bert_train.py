"""bert_cls training step against transformers' BertForSequenceClassification, side by side in one process.

    python bench/bert_train.py                          # MiniLM-L6 layout, batch 32 x 128, the train script's dropouts
    python bench/bert_train.py --hidden-dropout 0       # what the step costs without dropout's random numbers

One step = forward, cross-entropy, backward, fused AdamW update, on the same weights and inputs for both
libraries; rows interleaved (one step of each per round), medians over rounds; ratios are to transformers'
eager fp32 step within each round. Attention dropout is 0 as in train_scripts/bert_cls.py (with it, SDPA
falls back to its slow math kernel in both libraries).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.bench import peer_model, time_call, train_step  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--reps", type=int, default=7, help="rounds")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = {"hidden_dropout": args.hidden_dropout, "attention_dropout": args.attention_dropout}
    inputs = zoo.load("bert_cls", **config).example_inputs(args.batch, args.length)
    labels = torch.randint(0, 2, (args.batch,))

    def zoo_model():
        torch.manual_seed(0)
        return zoo.load("bert_cls", **config).train()

    def transformers_model():
        return peer_model("bert_cls", zoo_model())[1].train()

    rows = [("transformers", "eager fp32", transformers_model, False, False),
            ("transformers", "bf16 autocast", transformers_model, True, False),
            ("zoo", "eager fp32", zoo_model, False, False),
            ("zoo", "bf16 autocast", zoo_model, True, False)]
    if not args.no_compile:
        rows += [("zoo", "compile", zoo_model, False, True), ("zoo", "compile+bf16", zoo_model, True, True)]
    print(f"bert_cls training step, batch {args.batch} x {args.length} tokens, hidden dropout {args.hidden_dropout}, "
          f"attention dropout {args.attention_dropout}, {torch.get_num_threads()} threads; {args.reps} rounds, "
          f"one step of each row per round")
    steps = []
    for label, mode, build, bf16, compiled in rows:
        model = build()
        if compiled:
            model = zoo_compile(model)
        step = train_step(model, inputs, labels, bf16)
        time_call(step, warmup=3 if compiled else 1, reps=1)  # warm-up (compilation)
        steps.append(step)
    # Interleaved: this machine's speed drifts by 20-30% within minutes, so every round times each row once
    # and ratios are taken within a round, then the median over rounds.
    times = [[] for _ in rows]
    for _ in range(args.reps):
        for i, step in enumerate(steps):
            times[i].append(time_call(step, warmup=0, reps=1))
    print(f"{'model':<14} {'mode':<16} {'s/step':>8} {'seq/s':>8} {'ratio':>7}")
    for (label, mode, *_), ts in zip(rows, times):
        ratio = statistics.median(t0 / t for t0, t in zip(times[0], ts))
        seconds = statistics.median(ts)
        print(f"{label:<14} {mode:<16} {seconds:8.3f} {args.batch / seconds:8.1f} {ratio:6.2f}x")
    fp32, bf16 = times[2], times[3]
    per_round = sorted(a / b for a, b in zip(fp32, bf16))
    print(f"zoo bf16 autocast step vs zoo fp32 step, per round: median {statistics.median(per_round):.2f}x "
          f"(range {per_round[0]:.2f}-{per_round[-1]:.2f})")


if __name__ == "__main__":
    main()
