"""bert_cls: what `with zoo.accel.autocast("cpu"):` costs on this CPU, before and after the fallback (issue 19).

    python bench/amp_fallback.py [--rounds 5] [--batch 8] [--length 128]

Rows, timed interleaved in one process (one call of each per round, so a slow moment of the machine hits
every row alike; the order rotates), median of the per-round ratio to fp32 eager:
  fp32 eager; autocast("cpu", force=True), what autocast did before the fallback (bf16 also where the CPU
  emulates it); autocast("cpu"), which on a CPU without native bf16 runs fp32 after one warning.
The header names the CPU class and this run's fp32/bf16 matmul peaks (measured before and after the rows).
"""
import argparse
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel import autocast, capabilities  # noqa: E402
from zoo.bench import matmul_peak_gflops  # noqa: E402


class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def peaks() -> str:
    return f"fp32 {matmul_peak_gflops(torch.float32):.0f}, bf16 {matmul_peak_gflops(torch.bfloat16):.1f} GFLOP/s"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    warnings = Count()
    logging.getLogger("zoo.accel").addHandler(warnings)

    model = zoo.load("bert_cls", pretrained=True).eval()
    inputs = model.example_inputs(args.batch, args.length)
    peaks_before = peaks()
    rows = {
        "fp32 eager": lambda: model(*inputs),
        'autocast("cpu", force=True)  (before)': lambda: _under(autocast("cpu", force=True), model, inputs),
        'autocast("cpu")  (after: fallback)': lambda: _under(autocast("cpu"), model, inputs),
    }
    times = {name: [] for name in rows}
    with torch.inference_mode():
        for fn in rows.values():  # warm-up, one call each
            fn()
        names = list(rows)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # the order rotates round by round
                fn = rows[name]
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    peaks_after = peaks()
    eager = times["fp32 eager"]

    print(f"bert_cls (shipped SST-2 weights), batch {args.batch} x {args.length}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{capabilities(cuda=False).describe()}; matmul peaks this run: {peaks_before} (before the rows), "
          f"{peaks_after} (after)")
    print(f"{args.rounds} rounds interleaved (order rotating); ratio = median over rounds of (fp32 eager time / row time)\n")
    print(f"| {'call':<40} | {'median ms':>9} | {'vs fp32 eager':>13} |")
    print(f"|{'-' * 42}|{'-' * 11}|{'-' * 15}|")
    for name, ts in times.items():
        ratio = statistics.median(e / t for e, t in zip(eager, ts))
        print(f"| {name:<40} | {statistics.median(ts) * 1e3:9.0f} | {ratio:12.2f}x |")
    print(f"\nwarnings from zoo.accel over {args.rounds + 1} calls of each row: {len(warnings.messages)}")
    for message in warnings.messages:
        print(f"  {message}")


def _under(context, model, inputs):
    with context:
        return model(*inputs)


if __name__ == "__main__":
    main()
