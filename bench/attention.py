"""Attention efficiency, side by side in one run (issue: transformer_lm and zoo.blocks.attention).

    python bench/attention.py --save     # full tables (a few minutes on 2 cores)
    python bench/attention.py --quick    # smaller sizes (a smoke run: --quick --reps 2)
    python bench/attention.py --compile  # also compiled training rows (slow to compile)

1. Time and peak memory at N = 1k/4k/16k (B=1, 8 heads, head dim 64, fp32): raw
   scaled_dot_product_attention, zoo's `attention` (masks handled, projections excluded) and a naive
   materialised softmax; ratio: SDPA's time at that N / the row's.
2. Sliding-window attention (window 256) from 4k to 64k against full causal SDPA: time and memory should
   grow linearly; ratio: full SDPA's time / the row's.
3. transformer_lm training tokens/s: eager fp32, bf16 autocast, compile, compile+bf16; ratio to eager.
4. Generation tokens/s at 1k context with and without the KV cache; ratio: the cache's speed-up.
Times come from rows timed interleaved round by round in this process (each table's rows, or each N's),
medians over rounds; each memory figure from a fresh process (peak RSS after a reset, see BASELINES.md).
bf16 rows run only where the CPU has bf16 kernels (--force-emulated times them anyway).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zoo.bench import (BenchRun, add_run_arguments, build_row, format_table, peak_rss_growth_mb,  # noqa: E402
                       time_rows)
from zoo.blocks.attention import attention  # noqa: E402

H, D = 8, 64


def naive(q, k, v, causal):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, N, N): the quadratic memory
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


IMPLS = {
    "sdpa": lambda q, k, v, causal, window: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "zoo": lambda q, k, v, causal, window: attention(q, k, v, causal=causal, window=window),
    "naive": lambda q, k, v, causal, window: naive(q, k, v, causal),
}


def qkv(n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, H, n, D, generator=g) for _ in range(3))


def child(impl: str, n: int, causal: bool, window: int | None) -> None:
    """Runs in a fresh process: the peak RSS growth of one call, after a warm-up call."""
    q, k, v = qkv(n)
    fn = functools.partial(IMPLS[impl], q, k, v, causal, window)
    with torch.no_grad():
        fn()
        print(json.dumps({"peak_mb": peak_rss_growth_mb(fn)}))


def too_big(impl: str, n: int) -> str | None:
    if impl == "naive" and 4 * n * n * H > 6 * 2**30:
        return f"needs {4 * n * n * H / 2**30:.0f} GiB for the score matrix"
    return None


def peak_mb(impl, n, causal, window=None) -> float | str:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    code = f"import sys; sys.argv=['x']; from bench.attention import child; child({impl!r}, {n}, {causal}, {window})"
    root = os.path.join(os.path.dirname(__file__), "..")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        return f"failed (exit {result.returncode}; out of memory?)"
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mb"]


def attention_rows(label, impls, n, causal, args) -> list[dict]:
    """One interleaved group: `impls` (name -> (impl, window)) at sequence length `n`, with their memory."""
    q, k, v = qkv(n)
    built = []
    for name, (impl, w) in impls.items():
        reason = too_big(impl, n)
        if reason:
            built.append({"model": label, "mode": name, "skipped": reason})
            continue
        call = functools.partial(IMPLS[impl], q, k, v, causal, w)
        built.append({**build_row(label, name, lambda c=call: c, batch=n), "peak MiB": peak_mb(impl, n, causal, w)})
    return time_rows(built, rounds=args.reps, calls=1)


def attention_table(run, sizes, args):
    run.say("\n1. attention, B=1, H=8, D=64, fp32 (projections excluded); ratio: SDPA's time / the row's")
    rows = []
    for causal in (False, True):
        for n in sizes:
            impls = {name: (name, None) for name in IMPLS}
            rows += attention_rows(f"N={n} {'causal' if causal else 'full'}", impls, n, causal, args)
    run.say(format_table(rows, columns={"peak MiB": ".1f"}, unit="call", items="token"))


def window_table(run, sizes, args, window=256):
    run.say(f"\n2. sliding-window attention (causal, window {window}) vs full causal SDPA; ratio: full SDPA's "
            f"time / the row's")
    rows = []
    for n in sizes:
        impls = {"sdpa full causal": ("sdpa", None), f"zoo window {window}": ("zoo", window)}
        if n > 16384:  # full attention's time grows with N^2: minutes at 64k
            rows += [{"model": f"N={n}", "mode": "sdpa full causal", "skipped": "not run (quadratic time)"}]
            impls.pop("sdpa full causal")
        rows += attention_rows(f"N={n}", impls, n, True, args)
    run.say(format_table(rows, columns={"peak MiB": ".1f"}, unit="call", items="token"))


def training_table(run, args):
    import zoo
    import zoo.accel as accel
    batch = 2 if args.quick else 8
    run.say(f"\n3. transformer_lm training step (default config, batch {batch} x 256)")
    specs = [("eager fp32", False, "fp32"), ("bf16 autocast", False, "bf16")]
    if args.compile:  # compiling forward+backward takes 1-2 minutes per mode on this CPU
        specs += [("compile", True, "fp32"), ("compile+bf16", True, "bf16")]

    def step(compiled, amp):
        torch.manual_seed(0)
        model = zoo.load("transformer_lm").train()
        if compiled:
            accel.compile(model)
        (idx,) = model.example_inputs(batch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def one():
            with accel.autocast("cpu", amp, force=True):
                loss = model.example_loss(idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return one
    built = [build_row("transformer_lm", name, functools.partial(step, compiled, amp), batch=batch * 256,
                       dtype=torch.bfloat16 if amp == "bf16" else None, warmup=3 if compiled else 1,
                       context=contextlib.nullcontext, force_emulated=args.force_emulated)
             for name, compiled, amp in specs]
    run.say(format_table(time_rows(built, rounds=args.reps, calls=1), unit="step", items="token"))


def generation_table(run, args, new=32):
    import zoo
    context = 256 if args.quick else 1024
    run.say(f"\n4. generation at {context} context, {new} new tokens (default width, random weights); ratio: "
            f"the KV cache's speed-up")
    torch.manual_seed(0)
    model = zoo.load("transformer_lm", context=context)
    prompt = torch.randint(0, 65, (1, context - new))
    built = [build_row("transformer_lm", name, lambda c=cache: functools.partial(
                 model.generate, prompt, new, seed=0, use_cache=c), batch=new)
             for name, cache in (("recompute", False), ("KV cache", True))]
    run.say(format_table(time_rows(built, rounds=args.reps, calls=1), unit="call", items="token"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--compile", action="store_true", help="add compiled rows to the training table")
    add_run_arguments(parser, reps=3)
    args = parser.parse_args()
    run = BenchRun("attention (zoo.blocks.attention) and transformer_lm")
    attention_table(run, [1024, 4096] if args.quick else [1024, 4096, 16384], args)
    window_table(run, [4096, 16384] if args.quick else [4096, 16384, 65536], args)
    training_table(run, args)
    generation_table(run, args)
    run.finish()
    if args.save:
        run.save("transformer_lm_attention")


if __name__ == "__main__":
    main()
