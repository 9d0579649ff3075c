"""The benchmark harness behind `zoo bench NAME` and the scripts in bench/.

One process, side by side: eager fp32, channels_last, bf16 autocast, compile, compile+bf16, int8 and the
peer library's model where the family names one, all built and warmed up first, then timed interleaved
round by round (medians over rounds, the ratio to eager taken within each round); throughput, FLOPs,
achieved GFLOP/s against the fp32/bf16 matmul peaks measured in the same run, before and after the rows;
the CPU class in the header; `--save` writes the report to bench/results/NAME.CPU.txt (avx2, avx512, amx,
...) so tables from different CPU classes sit side by side; and the peak memory of a training step
measured in a fresh process.
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from zoo.accel import hardware
from zoo.accel.hardware import cpu_class, native_cpu_dtype
from zoo.accel.variants import Variant, time_call, variants_for
from zoo.models.base import ZooModel

__all__ = ["time_call", "example_loss", "matmul_peak_gflops", "count_flops", "bench_rows", "build_rows",
           "time_rows", "cpu_tag", "train_step", "peer_model", "format_table", "main"]

ROOT = Path(__file__).resolve().parent.parent  # the source checkout, where bench/peers.py lives


def example_loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
    """The loss of a training step on `example_inputs()`: a zoo model's own `example_loss`; for a peer
    library's model the mean output (of `.logits` for transformers-style outputs)."""
    if isinstance(model, ZooModel):
        return model.example_loss(*inputs)
    out = model(*inputs)
    return (out.logits if hasattr(out, "logits") else out).float().mean()


def peer_model(name: str, model: ZooModel) -> tuple[str, nn.Module] | None:
    """(label, the peer library's model with `model`'s weights) from bench/peers.py, which lives in the source
    checkout only (peers need diffusers, MONAI, ... and are no part of the package); None without one."""
    path = ROOT / "bench" / "peers.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("zoo_bench_peers", path)  # by path: sys.path stays as it is
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    return peers.PEERS[name](model) if name in peers.PEERS else None


def matmul_peak_gflops(dtype: torch.dtype, n: int | None = None) -> float:
    # an emulated dtype (bf16 without AVX512-BF16/AMX: ~1 GFLOP/s) measures the same on a smaller matrix,
    # in a second instead of two minutes
    n = n or (2048 if native_cpu_dtype(dtype) else 256)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = time_call(lambda: torch.mm(a, b), warmup=2, reps=5)
    return 2 * n ** 3 / seconds / 1e9


def count_flops(model: nn.Module, inputs: tuple) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter.get_total_flops()


def bench_rows(model: nn.Module, inputs: tuple, variants: list[Variant], *, label: str = "zoo",
               reps: int = 5, baseline_s: float | None = None, calls: int = 2) -> list[dict]:
    """Time each variant on a fresh copy of the model, interleaved round by round (`time_rows`); ratio is to
    `baseline_s` when given, else the median over rounds of first row / this row."""
    rows = time_rows(build_rows(model, inputs, variants, label=label), rounds=reps, calls=calls)
    if baseline_s:
        for r in rows:
            if "ms" in r:
                r["ratio"] = baseline_s / (r["ms"] / 1e3)
    return rows


def build_rows(model: nn.Module, inputs: tuple, variants: list[Variant], *, label: str = "zoo") -> list[dict]:
    """Build every variant on a fresh copy of `model` and warm it up (the first compiled calls compile): rows
    for `time_rows`, each {"model", "mode", "run", "batch"}, or {"model", "mode", "error"} for a mode that
    does not apply."""
    rows = []
    for v in variants:
        try:
            runnable, x = v.build(copy.deepcopy(model).eval(), inputs)
            run = functools.partial(_call, runnable, x)
            with torch.inference_mode():
                for _ in range(3 if v.compiled else 1):
                    run()
        except Exception as e:  # a mode that does not apply is a row saying so, not a crash
            rows.append({"model": label, "mode": v.name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"})
            continue
        rows.append({"model": label, "mode": v.name, "run": run, "batch": inputs[0].shape[0]})
    return rows


def _call(runnable: Callable, x: tuple) -> None:
    runnable(*x)


def time_rows(rows: list[dict], *, rounds: int = 5, calls: int = 2) -> list[dict]:
    """Time built rows interleaved: each round runs every row for `calls` calls (the median is that round's
    time), starting one row later each round, so a machine that drifts (turbo, a neighbour) moves every row
    alike instead of whichever ran last. Per row: the median over rounds of its time and of (first row's time
    / its time) in the same round. Returns plain rows (no callables): model, mode, ms, items_per_s, ratio."""
    live = [r for r in rows if "run" in r]
    times: dict[int, list[float]] = {id(r): [] for r in live}
    with torch.inference_mode():
        for k in range(max(rounds, 1)):
            shift = k % len(live) if live else 0
            for r in live[shift:] + live[:shift]:
                times[id(r)].append(time_call(r["run"], warmup=0, reps=max(calls, 1)))
    out = []
    for r in rows:
        if "run" not in r:
            out.append(dict(r))
            continue
        seconds = statistics.median(times[id(r)])
        ratio = statistics.median(b / t for b, t in zip(times[id(live[0])], times[id(r)]))
        out.append({"model": r["model"], "mode": r["mode"], "ms": seconds * 1e3, "items_per_s": r["batch"] / seconds,
                    "ratio": ratio})
    return out


def cpu_tag() -> str:
    """A short file-name tag of this CPU's class: "amx", "avx512bf16", "avx512", "avx2", else torch's name."""
    return "".join(c for c in hardware.capabilities(cuda=False).cpu_class.lower() if c.isalnum()) or "cpu"


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
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    code = (f"from zoo.bench import _train_step_child; _train_step_child({name!r}, {batch}, "
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
        module, function = name.split(":")
        model, inputs = getattr(importlib.import_module(module), function)(batch, **example)
        model.train()
    else:
        model = zoo.load(name, **config).train()
        inputs = model.example_inputs(batch, **example)
    if checkpointing != "none":
        apply_checkpointing(model, checkpointing)

    def step():
        with autocast("cpu", "bf16" if amp == "bf16" else "fp32", force=True):  # a bf16 row measures bf16
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
    parser.add_argument("--reps", type=int, default=5, help="rounds: each runs every row --calls times")
    parser.add_argument("--calls", type=int, default=2, help="calls per row per round (the round's median)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--save", action="store_true",
                        help="also write the printed report to bench/results/NAME.CPU.txt (CPU: e.g. avx2, amx)")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config takes KEY=VALUE pairs, got {item!r}")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else value
    model = zoo.load(args.name, **overrides)
    batch = args.batch or model.bench_batch
    if args.size is not None and "size" not in inspect.signature(model.example_inputs).parameters:
        raise ValueError(f"{args.name}'s example inputs have no size to set; leave out --size")
    example = {"size": args.size} if args.size is not None else {}
    inputs = model.example_inputs(batch, **example)
    torch.manual_seed(0)
    started = time.perf_counter()
    report: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        report.append(line)

    flops = count_flops(model, inputs)
    params = sum(p.numel() for p in model.parameters())
    shapes = ", ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else repr(t) for t in inputs)
    say(f"{args.name}: {params / 1e6:.2f}M params, {flops / 1e9:.2f} GFLOP per batch of {shapes}; "
        f"{torch.get_num_threads()} threads; {hardware.capabilities(cuda=False).describe()}")
    # the peaks of this run, sampled before and after the rows: a machine that drifts shows as two figures
    before = {"fp32": matmul_peak_gflops(torch.float32), "bf16": matmul_peak_gflops(torch.bfloat16)}
    built = build_rows(model, inputs, variants_for(model, compile=not args.no_compile, int8=not args.no_int8))
    if not args.no_peer:
        peer = peer_model(args.name, model)
        if peer is not None:
            label, peer = peer  # a peer takes the zoo model's inputs; its ratio is to the zoo's eager row
            built += build_rows(peer, inputs, variants_for(peer, compile=False, int8=False), label=label)
    rows = time_rows(built, rounds=args.reps, calls=args.calls)
    after = {"fp32": matmul_peak_gflops(torch.float32), "bf16": matmul_peak_gflops(torch.bfloat16)}
    peaks = {k: max(before[k], after[k]) for k in before}
    say(f"matmul peak of this run (before / after the rows): fp32 {before['fp32']:.0f} / {after['fp32']:.0f}, "
        f"bf16 {before['bf16']:.0f} / {after['bf16']:.0f} GFLOP/s; rows interleaved, {args.reps} rounds x "
        f"{args.calls} calls, medians; % peak of the higher")
    say(format_table(rows, flops, peaks))
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
        say("; ".join(f"{k}: {v}" for k, v in memory.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.name, "batch": batch, "params": params, "flops": flops, "peaks": peaks,
                       "peaks_before": before, "peaks_after": after, "cpu": cpu_class(), "rows": rows,
                       "memory": memory}, f, indent=2)
    if args.save:
        path = ROOT / "bench" / "results" / f"{args.name}.{cpu_tag()}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["zoo bench", *(argv if argv is not None else sys.argv[1:])])
        path.write_text(f"# {command}, {time.strftime('%Y-%m-%d')}, {hardware.capabilities(cuda=False).describe()}; "
                        f"took {time.perf_counter() - started:.0f} s\n" + "\n".join(report) + "\n")
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
