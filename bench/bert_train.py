"""bert_cls training step against transformers' BertForSequenceClassification, side by side in one process.

    python bench/bert_train.py --save                   # MiniLM-L6 layout, batch 32 x 128, the train script's dropouts
    python bench/bert_train.py --hidden-dropout 0       # what the step costs without dropout's random numbers
    python bench/bert_train.py --batch 2 --length 16 --no-compile --reps 2   # a smoke run

One step = forward, cross-entropy, backward, fused AdamW update, on the same weights and inputs for both
libraries; rows interleaved (one step of each per round, the order rotating), medians over rounds; ratios to
zoo's eager fp32 step and to transformers' within each round. Attention dropout is 0 as in
train_scripts/bert_cls.py (with it, SDPA falls back to its slow math kernel in both libraries). bf16 rows
run only where the CPU has bf16 kernels (--force-emulated times them anyway).
"""
import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.bench import (BenchRun, add_run_arguments, build_row, format_table, peer_model, time_rows,  # noqa: E402
                       train_step)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--no-compile", action="store_true")
    add_run_arguments(parser, reps=7)
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

    run = BenchRun(f"bert_cls training step, batch {args.batch} x {args.length} tokens, hidden dropout "
                   f"{args.hidden_dropout}, attention dropout {args.attention_dropout}")
    specs = [("zoo", "eager fp32", zoo_model, False, False), ("zoo", "bf16 autocast", zoo_model, True, False),
             ("transformers", "eager fp32", transformers_model, False, False),
             ("transformers", "bf16 autocast", transformers_model, True, False)]
    if not args.no_compile:
        specs += [("zoo", "compile", zoo_model, False, True), ("zoo", "compile+bf16", zoo_model, True, True)]

    def step(build, bf16, compiled):
        model = build()
        return train_step(zoo_compile(model) if compiled else model, inputs, labels, bf16)

    built = [build_row(label, mode, lambda b=build, h=bf16, c=compiled: step(b, h, c), batch=args.batch,
                       dtype=torch.bfloat16 if bf16 else None, warmup=3 if compiled else 1,
                       context=contextlib.nullcontext, force_emulated=args.force_emulated)
             for label, mode, build, bf16, compiled in specs]
    rows = time_rows(built, rounds=args.reps, calls=1, peer="transformers")
    run.finish()
    run.say(f"{args.reps} rounds, one step of each row per round; ratio: to zoo eager fp32, vs transformers: to "
            f"transformers eager fp32, medians over rounds")
    run.say(format_table(rows, peer="transformers", unit="step", items="seq"))
    if args.save:
        run.save("bert_cls_train_step")


if __name__ == "__main__":
    main()
