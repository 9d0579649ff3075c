"""Attention efficiency, side by side in one run (issue: transformer_lm and zoo.blocks.attention).

    python bench/attention.py            # full table (a few minutes on 2 cores)
    python bench/attention.py --quick    # smaller sizes
    python bench/attention.py --compile  # also compiled training rows (slow to compile)

1. Time and peak memory at N = 1k/4k/16k (B=1, 8 heads, head dim 64, fp32): naive materialised softmax,
   raw scaled_dot_product_attention, and zoo's `attention` (masks handled, projections excluded).
   Each memory figure comes from a fresh process (peak RSS after a reset, see BASELINES.md).
2. Sliding-window attention (window 256) from 4k to 64k: time and memory should grow linearly.
3. transformer_lm training tokens/s: eager fp32, bf16 autocast, compile, compile+bf16.
4. Generation tokens/s at 1k context with and without the KV cache.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zoo.bench import time_call  # noqa: E402
from zoo.blocks.attention import attention  # noqa: E402

H, D = 8, 64


def naive(q, k, v, causal):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, N, N): the quadratic memory
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


IMPLS = {
    "naive": lambda q, k, v, causal, window: naive(q, k, v, causal),
    "sdpa": lambda q, k, v, causal, window: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "zoo": lambda q, k, v, causal, window: attention(q, k, v, causal=causal, window=window),
}


def child(impl: str, n: int, causal: bool, window: int | None) -> None:
    """Runs in a fresh process: time, then the peak RSS of one call."""
    import resource
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    fn = IMPLS[impl]
    with torch.no_grad():
        seconds = time_call(lambda: fn(q, k, v, causal, window), warmup=1, reps=3)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open("/proc/self/status") as f:
            base = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        fn(q, k, v, causal, window)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"ms": seconds * 1e3, "peak_mb": (peak - base) / 1024}))


def measure(impl, n, causal, window=None):
    if impl == "naive" and 4 * n * n * H > 6 * 2**30:
        return {"skipped": f"needs {4 * n * n * H / 2**30:.0f} GiB for the score matrix"}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    code = f"import sys; sys.argv=['x']; from bench.attention import child; child({impl!r}, {n}, {causal}, {window})"
    root = os.path.join(os.path.dirname(__file__), "..")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        return {"skipped": f"failed (exit {result.returncode}; out of memory?)"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def fmt(r):
    return r.get("skipped") or f"{r['ms']:9.1f} ms {r['peak_mb']:8.1f} MiB"


def attention_table(sizes):
    print("\n1. attention, B=1, H=8, D=64, fp32 (projections excluded)")
    for causal in (False, True):
        for n in sizes:
            rows = {impl: measure(impl, n, causal) for impl in IMPLS}
            ratio = ""
            if "ms" in rows["sdpa"] and "ms" in rows["zoo"]:
                ratio = f"zoo/sdpa time {rows['zoo']['ms'] / rows['sdpa']['ms']:.3f}"
            if "ms" in rows["naive"] and "ms" in rows["sdpa"]:
                ratio += f", naive/sdpa {rows['naive']['ms'] / rows['sdpa']['ms']:.2f}x"
            print(f"  N={n:<6} {'causal' if causal else 'full  '}  " +
                  "  |  ".join(f"{impl}: {fmt(r)}" for impl, r in rows.items()) + f"   {ratio}")


def window_table(sizes, window=256):
    print(f"\n2. sliding-window attention (causal, window {window}) vs full causal SDPA")
    for n in sizes:
        local = measure("zoo", n, True, window)
        full = measure("sdpa", n, True) if n <= 16384 else {"skipped": "not run"}
        print(f"  N={n:<6} window: {fmt(local)}   full: {fmt(full)}")


def training_table(with_compile):
    import zoo
    import zoo.accel as accel
    print("\n3. transformer_lm training step (default config, batch 8 x 256), tokens/s")
    rows = [("eager fp32", False, "fp32"), ("bf16 autocast", False, "bf16")]
    if with_compile:  # compiling forward+backward takes 1-2 minutes per mode on this CPU
        rows += [("compile", True, "fp32"), ("compile+bf16", True, "bf16")]
    base = None
    for name, compiled, amp in rows:
        torch.manual_seed(0)
        model = zoo.load("transformer_lm").train()
        if compiled:
            accel.compile(model)
        (idx,) = model.example_inputs(8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            with accel.autocast("cpu", amp, force=True):
                loss = model.example_loss(idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        seconds = time_call(step, warmup=3 if compiled else 1, reps=3)
        tokens = idx.numel() / seconds
        base = base or tokens
        print(f"  {name:<16} {tokens:9.0f} tokens/s  {tokens / base:5.2f}x")


def generation_table(context=1024, new=32):
    import zoo
    print(f"\n4. generation at {context} context, {new} new tokens (default width, random weights)")
    torch.manual_seed(0)
    model = zoo.load("transformer_lm", context=context)
    prompt = torch.randint(0, 65, (1, context - new))
    times = {}
    for use_cache in (True, False):
        times[use_cache] = time_call(lambda: model.generate(prompt, new, seed=0, use_cache=use_cache),
                                     warmup=0, reps=1) / new
        print(f"  {'KV cache' if use_cache else 'recompute':<10} {1 / times[use_cache]:8.1f} tokens/s")
    print(f"  cache speed-up per token: {times[False] / times[True]:.1f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--compile", action="store_true", help="add compiled rows to the training table")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    attention_table([1024, 4096] if args.quick else [1024, 4096, 16384])
    window_table([4096, 16384] if args.quick else [4096, 16384, 65536])
    training_table(args.compile)
    generation_table(context=256 if args.quick else 1024)


if __name__ == "__main__":
    main()
