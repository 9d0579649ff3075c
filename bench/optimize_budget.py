"""`zoo.accel.optimize` on a shipped model: how long it takes and what it picks (issue 19 item 3).

    python bench/optimize_budget.py --save                       # bert_cls, batch 16 x 128, defaults
    python bench/optimize_budget.py --family effnetv2_cls --batch 32 --save      # 32x32, the shipped CIFAR-10 size
    python bench/optimize_budget.py --batch 2 --length 16 --reps 1 --budget 30    # a smoke run

optimize is called as a user calls it (its defaults: compile and int8 variants, the 300 s budget, unless
--budget says otherwise); the report is its own (variants timed interleaved against eager fp32, medians of the
per-round ratios, the ones this CPU cannot run natively skipped with the reason), under the CPU class and this
run's matmul peaks; the wall time counts everything optimize does (building, compiling, timing, checking).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import zoo  # noqa: E402
from zoo.accel import optimize  # noqa: E402
from zoo.bench import BenchRun  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="bert_cls", choices=["bert_cls", "effnetv2_cls"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128, help="bert_cls: tokens per example")
    parser.add_argument("--size", type=int, default=32, help="effnetv2_cls: image side (the shipped weights': 32)")
    parser.add_argument("--budget", type=float, default=300.0, help="optimize's budget_s (its default: 300)")
    parser.add_argument("--reps", type=int, default=5, help="optimize's rounds of interleaved timing")
    parser.add_argument("--save", action="store_true", help="write bench/results/<family>_optimize.<cpu class>.txt")
    args = parser.parse_args()

    model = zoo.load(args.family, pretrained=True).eval()
    inputs = model.example_inputs(args.batch, args.length if args.family == "bert_cls" else args.size)
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
    run = BenchRun(f"zoo.accel.optimize({args.family}, shipped weights), inputs {shapes}", peaks=("fp32", "bf16", "int8"))
    start = time.perf_counter()
    _, report = optimize(model, tuple(inputs), reps=args.reps, budget_s=args.budget)
    took = time.perf_counter() - start
    run.finish()
    run.say(f"optimize took {took:.0f} s (budget {args.budget:.0f} s), {args.reps} rounds; its report:\n")
    run.say(report)
    if args.save:
        run.save(f"{args.family}_optimize")


if __name__ == "__main__":
    main()
