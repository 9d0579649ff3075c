"""bert_cls: what `with zoo.accel.autocast("cpu"):` costs on this CPU, before and after the fallback (issue 19).

    python bench/amp_fallback.py --force-emulated --save [--reps 5] [--batch 8] [--length 128]
    python bench/amp_fallback.py --batch 2 --length 16 --reps 2     # a smoke run

Rows, timed interleaved in one process (one call of each per round, the order rotating, so a slow moment
of the machine hits every row alike), median of the per-round ratio to fp32 eager:
  fp32 eager; autocast("cpu", force=True), what autocast did before the fallback (bf16 also where the CPU
  emulates it: that row runs only with --force-emulated there); autocast("cpu"), which on a CPU without
  native bf16 runs fp32 after one warning.
The header names the CPU class and this run's fp32/bf16 matmul peaks (measured before and after the rows).
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel import autocast  # noqa: E402
from zoo.bench import BenchRun, add_run_arguments, build_row, format_table, time_rows  # noqa: E402


class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    add_run_arguments(parser)
    args = parser.parse_args()
    warnings = Count()
    logging.getLogger("zoo.accel").addHandler(warnings)

    model = zoo.load("bert_cls", pretrained=True).eval()
    inputs = model.example_inputs(args.batch, args.length)
    run = BenchRun(f"bert_cls (shipped SST-2 weights), batch {args.batch} x {args.length}")
    specs = [("fp32 eager", lambda: model(*inputs), None),
             ('autocast("cpu", force=True)  (before)', lambda: _under(autocast("cpu", force=True), model, inputs),
              torch.bfloat16),
             ('autocast("cpu")  (after: fallback)', lambda: _under(autocast("cpu"), model, inputs), None)]
    built = [build_row("zoo", mode, lambda c=call: c, batch=args.batch, dtype=dtype,
                       force_emulated=args.force_emulated) for mode, call, dtype in specs]
    rows = time_rows(built, rounds=args.reps, calls=1)
    run.finish()
    run.say(f"{args.reps} rounds interleaved (order rotating); ratio = median over rounds of (fp32 eager time / "
            f"row time)\n")
    run.say(format_table(rows, items="seq"))
    calls = args.reps + 1
    run.say(f"\nwarnings from zoo.accel over {calls} calls of each row that ran: {len(warnings.messages)}")
    for message in warnings.messages:
        run.say(f"  {message}")
    if args.save:
        run.save("amp_fallback")


def _under(context, model, inputs):
    with context:
        return model(*inputs)


if __name__ == "__main__":
    main()
