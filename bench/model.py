"""Benchmark a registry model side by side (same as `zoo bench NAME`):

    python bench/model.py bert_cls --json runs/bench_bert.json
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zoo.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
