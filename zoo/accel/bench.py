"""The benchmark harness behind `zoo bench NAME` and the scripts in bench/.

One process, side by side, warm-up then medians: eager fp32, channels_last, bf16 autocast, compile,
compile+bf16, int8 and the peer library's model where the family names one; throughput, ratio to
eager, FLOPs, achieved GFLOP/s against this machine's measured matmul peak, and the peak memory of a
training step measured in a fresh process.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from zoo.accel.amp import cast, with_autocast
from zoo.accel.compile import compile as zoo_compile

__all__ = ["time_call", "example_loss", "matmul_peak_gflops", "count_flops", "Variant", "variants_for", "bench_rows", "train_step",
           "format_table", "main"]


def time_call(fn: Callable[[], object], *, warmup: int = 2, reps: int = 5, min_time: float = 0.0) -> float:
    """Median seconds per call after warm-up (the first compiled calls are warm-up); on a machine where
    CUDA is in use, each call is timed to the end of its GPU work."""
    for _ in range(warmup):
        fn()
    _cuda_sync()
    times = []
    while len(times) < reps or sum(times) < min_time:
        t0 = time.perf_counter()
        fn()
        _cuda_sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cuda_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def example_loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
    """The loss of a training step on `model.example_inputs(...)`: the model's `example_loss` where its
    example inputs are not its training_loss's arguments, else its `training_loss`, else the mean output
    (of `.logits` for transformers-style outputs)."""
    for method in ("example_loss", "training_loss"):
        if hasattr(model, method):
            return getattr(model, method)(*inputs)
    out = model(*inputs)
    return (out.logits if hasattr(out, "logits") else out).float().mean()


def matmul_peak_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = time_call(lambda: torch.mm(a, b), warmup=2, reps=5)
    return 2 * n ** 3 / seconds / 1e9


def count_flops(model: nn.Module, inputs: tuple) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter.get_total_flops()


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in model.modules())


@dataclass
class Variant:
    name: str
    build: Callable[[nn.Module, tuple], tuple[nn.Module, tuple]]  # (model, inputs) -> (runnable, inputs)
    compiled: bool = False


def _channels_last(model, inputs):
    fmt = torch.channels_last if inputs[0].dim() == 4 else torch.channels_last_3d
    return model.to(memory_format=fmt), tuple(t.to(memory_format=fmt) if t.dim() in (4, 5) else t for t in inputs)


def _int8(model, inputs):
    from zoo.accel.quantize import quantize
    # both int8 paths reach int8 kernels only through inductor with frozen weights: PT2E leaves reference
    # quantize/dequantize ops that ran at 0.36x eager fp32 uncompiled (EfficientNetV2-S)
    if _has_conv(model):
        model, inputs = _channels_last(model, inputs)
        return zoo_compile(quantize(model, "int8_static", calibration=[inputs]), freeze=True), inputs
    return zoo_compile(quantize(model, "int8_dynamic", backend="pt2e", example_inputs=inputs), freeze=True), inputs


def _compiled_bf16(model, inputs):
    # bf16 weights rather than autocast: no per-call weight casts, half the bytes in norms and activations
    if _has_conv(model):
        model, inputs = _channels_last(model, inputs)
    return zoo_compile(cast(model, "bf16"), freeze=True), inputs


def variants_for(model: nn.Module, *, compile: bool = True, int8: bool = True) -> list[Variant]:
    """The inference modes for `model`; compiled ones freeze the weights (inference only)."""
    conv = _has_conv(model)
    out = [Variant("eager fp32", lambda m, x: (m, x))]
    if conv:
        out.append(Variant("channels_last", _channels_last))
    out.append(Variant("bf16 autocast", lambda m, x: (with_autocast(m, "cpu", "bf16"), x)))
    if compile:
        out.append(Variant("compile", lambda m, x: (zoo_compile(m, freeze=True), x), compiled=True))
        out.append(Variant("compile+bf16 cast" + ("+channels_last" if conv else ""), _compiled_bf16,
                           compiled=True))
    if int8:
        out.append(Variant("int8 static (PT2E, compiled)" if conv else "int8 dynamic (PT2E, compiled)", _int8,
                           compiled=True))
    return out


def bench_rows(model: nn.Module, inputs: tuple, variants: list[Variant], *, label: str = "zoo",
               reps: int = 5, baseline_s: float | None = None) -> list[dict]:
    """Time each variant on a fresh copy of the model; ratio is to `baseline_s` (default: first row)."""
    rows = []
    batch = inputs[0].shape[0]
    for v in variants:
        try:
            runnable, x = v.build(copy.deepcopy(model).eval(), inputs)
            with torch.inference_mode():
                seconds = time_call(lambda: runnable(*x), warmup=3 if v.compiled else 1, reps=reps)
        except Exception as e:  # a mode that does not apply is a row saying so, not a crash
            rows.append({"model": label, "mode": v.name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"})
            continue
        baseline_s = baseline_s or seconds
        rows.append({"model": label, "mode": v.name, "ms": seconds * 1e3, "items_per_s": batch / seconds,
                     "ratio": baseline_s / seconds})
    return rows


def train_step(model: nn.Module, inputs: tuple, labels: torch.Tensor, bf16: bool) -> Callable[[], None]:
    """One training step as a closure for `time_call`: forward (under bf16 autocast or not), cross-entropy
    on the logits (a tensor or an output with `.logits`, as transformers returns), backward, fused AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = model(*inputs)
        logits = out.logits if hasattr(out, "logits") else out
        torch.nn.functional.cross_entropy(logits.float(), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def train_step_peak_mb(name: str, batch: int, checkpointing: str = "none", amp: str = "off", *,
                       config: dict | None = None, example: dict | None = None) -> dict:
    """Peak RSS growth (MiB) and time (s) of one training step, in a fresh process (method: BASELINES.md).

    `name` is a registry model, or "module:function" for a peer: function(batch, **example) returns
    (model, inputs), the loss as `example_loss` takes it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    code = (f"from zoo.accel.bench import _train_step_child; _train_step_child({name!r}, {batch}, "
            f"{checkpointing!r}, {amp!r}, {config or {}!r}, {example or {}!r})")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"training-step probe failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _train_step_child(name: str, batch: int, checkpointing: str, amp: str, config: dict, example: dict) -> None:
    import gc

    import zoo
    from zoo.accel.amp import autocast
    from zoo.accel.checkpointing import checkpointing as apply_checkpointing
    if ":" in name:  # a peer library's model, built by a bench script
        import importlib
        module, function = name.split(":")
        model, inputs = getattr(importlib.import_module(module), function)(batch, **example)
        model.train()
    else:
        model = zoo.load(name, **config).train()
        inputs = model.example_inputs(batch, **example)
    if checkpointing != "none":
        apply_checkpointing(model, checkpointing)

    def step():
        with autocast("cpu", "bf16" if amp == "bf16" else "fp32"):
            out = example_loss(model, inputs)
        out.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: allocator pools, lazy init
    gc.collect()
    base = _current_rss_kb()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the kernel's peak-RSS counter, so ru_maxrss is this step's peak
    except OSError:
        pass  # then the peak may include the warm-up step, which is about the same size
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"peak_mb": round(peak, 1), "step_s": round(seconds, 3)}))


def _current_rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def format_table(rows: list[dict], flops: int | None = None, peaks: dict[str, float] | None = None) -> str:
    lines = [f"{'model':<14} {'mode':<34} {'ms/batch':>9} {'items/s':>9} {'ratio':>6} {'GFLOP/s':>8} {'% peak':>7}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<14} {r['mode']:<34} {'n/a: ' + r['error']}")
            continue
        gflops = flops / (r["ms"] / 1e3) / 1e9 if flops else float("nan")
        peak = (peaks or {}).get("bf16" if ("bf16" in r["mode"] or "int8" in r["mode"]) else "fp32")
        frac = f"{100 * gflops / peak:6.1f}%" if peak and flops else "    -"
        lines.append(f"{r['model']:<14} {r['mode']:<34} {r['ms']:9.1f} {r['items_per_s']:9.1f} {r['ratio']:5.2f}x "
                     f"{gflops:8.1f} {frac:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import zoo
    parser = argparse.ArgumentParser(prog="zoo bench", description="Benchmark a registry model side by side.")
    parser.add_argument("name")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", type=int, default=None, help="input side (image models), e.g. 32")
    parser.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model config overrides, e.g. stem_stride=1 variant=b0")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows (each compiles 20-60 s)")
    parser.add_argument("--no-int8", action="store_true")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--no-memory", action="store_true", help="skip the training-step peak-memory probe")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config takes KEY=VALUE pairs, got {item!r}")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else value
    model = zoo.load(args.name, **overrides)
    if not hasattr(model, "example_inputs"):
        raise ValueError(f"{args.name} does not define example_inputs(); it cannot be benchmarked yet")
    batch = args.batch or getattr(model, "bench_batch", 8)
    if args.size is not None and "size" not in inspect.signature(model.example_inputs).parameters:
        raise ValueError(f"{args.name}'s example inputs have no size to set; leave out --size")
    example = {"size": args.size} if args.size is not None else {}
    inputs = model.example_inputs(batch, **example)
    torch.manual_seed(0)
    peaks = {"fp32": matmul_peak_gflops(torch.float32), "bf16": matmul_peak_gflops(torch.bfloat16)}
    flops = count_flops(model, inputs)
    params = sum(p.numel() for p in model.parameters())
    shapes = ", ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else repr(t) for t in inputs)
    print(f"{args.name}: {params / 1e6:.2f}M params, {flops / 1e9:.2f} GFLOP per batch of {shapes}; "
          f"{torch.get_num_threads()} threads; matmul peak fp32 {peaks['fp32']:.0f}, bf16 {peaks['bf16']:.0f} GFLOP/s")
    rows = bench_rows(model, inputs, variants_for(model, compile=not args.no_compile, int8=not args.no_int8),
                      reps=args.reps)
    if not args.no_peer and hasattr(model, "peer_model"):
        peer = model.peer_model()
        if peer is not None:
            label, peer_model = peer  # a peer takes the zoo model's inputs
            baseline = rows[0].get("ms", 0) / 1e3 or None
            rows += bench_rows(peer_model, inputs, [v for v in variants_for(peer_model, compile=False, int8=False)],
                               label=label, reps=args.reps, baseline_s=baseline)
    print(format_table(rows, flops, peaks))
    memory = {}
    if not args.no_memory:
        steps = {}
        for amp in ("off", "bf16"):
            try:
                probe = train_step_peak_mb(args.name, batch, amp=amp, config=overrides, example=example)
                memory[f"train step peak MB ({amp})"] = probe["peak_mb"]
                memory[f"train step s ({amp})"] = steps[amp] = probe["step_s"]
            except Exception as e:
                memory[f"train step peak MB ({amp})"] = f"n/a ({e})"
        if len(steps) == 2:  # one step per fresh process: a rough figure, +-20% on this machine
            memory["train step bf16 speed-up"] = f"{steps['off'] / steps['bf16']:.2f}x"
        print("; ".join(f"{k}: {v}" for k, v in memory.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.name, "batch": batch, "params": params, "flops": flops, "peaks": peaks,
                       "rows": rows, "memory": memory}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
