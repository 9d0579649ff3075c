"""`optimize`: measure the applicable speed-ups on the user's own example and keep the fastest that is exact enough.

Measurement, not folklore: on a 2-core AMX CPU bf16 beat int8 for BERT, torchao int8 was slower than
fp32 eagerly but faster compiled, and bf16 alone slowed EfficientNetV2 at 32x32 while compile+bf16
sped it up; on an AVX2-only CPU bf16 is emulated (~100x slower matmuls), so its variants are skipped
there without being built. The candidates are timed interleaved with eager fp32 (one call each per
round, so a slow moment of the machine hits all of them) and compared by the median of their per-round
ratio to eager: the result is never slower than the input model.
"""
from __future__ import annotations

import copy
import logging
import statistics
import time

import torch
from torch import nn

from zoo.accel import hardware
from zoo.accel.variants import variants_for
from zoo.models.base import unwrap

log = logging.getLogger(__name__)

__all__ = ["optimize"]


def _max_rel_error(out, ref) -> float:
    out = out.float() if isinstance(out, torch.Tensor) else out[0].float()
    ref = ref.float() if isinstance(ref, torch.Tensor) else ref[0].float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def optimize(model: nn.Module, example_inputs: tuple, *, tolerance: float = 0.05, compile: bool = True,
             int8: bool = True, reps: int = 5, budget_s: float = 300.0) -> tuple[nn.Module, str]:
    """Try channels_last, bf16, compile and int8 (where they apply) on `example_inputs`; return the fastest
    variant whose output is within `tolerance` (max error relative to the fp32 output's max) and a report.

    Variants in a precision this CPU has no native kernels for are skipped, with the reason in the report.
    Building stops once `budget_s` seconds have gone (the remaining variants are reported as skipped); the
    built ones are then timed in `reps` interleaved rounds against eager fp32, and one is chosen only where
    its median per-round time ratio to eager is below 1.

    The returned model expects inputs like `example_inputs` (channels_last conversion is done inside
    the variant for the example only, so convert your inputs the same way for that mode).
    """
    start = time.perf_counter()
    example_inputs = tuple(example_inputs)
    model = unwrap(model).eval()
    device = next(model.parameters(), torch.empty(0)).device
    caps = hardware.capabilities(cuda=device.type == "cuda")
    with torch.inference_mode():
        reference = model(*example_inputs)
    rows: list[list] = []  # [name, runnable or None, inputs, note, compiled]
    for variant in variants_for(model, compile=compile, int8=int8):
        if variant.dtype is not None and not caps.native(device, variant.dtype):
            rows.append([variant.name, None, None, "skipped: " + hardware.slow_reason(device, variant.dtype, caps),
                         False])
            continue
        if rows and time.perf_counter() - start > budget_s:
            rows.append([variant.name, None, None, f"skipped: the {budget_s:.0f} s budget was spent", False])
            continue
        try:
            candidate, inputs = variant.build(copy.deepcopy(model).eval(), example_inputs)
            with torch.inference_mode():
                error = _max_rel_error(candidate(*inputs), reference)
                for _ in range(2 if variant.compiled else 0):  # the first compiled calls are warm-up
                    candidate(*inputs)
        except Exception as e:
            rows.append([variant.name, None, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}",
                         False])
            continue
        ok = error <= tolerance
        rows.append([variant.name, candidate if ok else None, inputs,
                     f"error {error:.2e}{'' if ok else '  (over tolerance)'}", variant.compiled])
    assert rows[0][1] is not None, "eager fp32 is the first variant and always usable"

    timed = [r for r in rows if r[1] is not None]
    times: dict[str, list[float]] = {r[0]: [] for r in timed}
    with torch.inference_mode():
        for r in timed:  # one untimed call each: caches and allocator warm for every candidate alike
            r[1](*r[2])
        for _ in range(reps):
            for name, candidate, inputs, _, _ in timed:
                times[name].append(_timed(lambda: candidate(*inputs)))
    eager = times[rows[0][0]]
    ratio = {name: statistics.median(t / e for t, e in zip(ts, eager)) for name, ts in times.items()}
    best = min(timed, key=lambda r: ratio[r[0]])
    if ratio[best[0]] >= 1.0:
        best = rows[0]

    lines = []
    for name, candidate, _, note, _ in rows:
        if name in times:
            ms = statistics.median(times[name]) * 1e3
            note = f"{ms:8.1f} ms  {1 / ratio[name]:.2f}x eager  {note}"
        lines.append(f"{name:<34} {note}")
    report = (f"{caps.describe()}; {reps} rounds interleaved, median of per-round ratios\n" + "\n".join(lines)
              + f"\nchosen: {best[0]} ({1 / ratio[best[0]]:.2f}x eager fp32); {time.perf_counter() - start:.0f} s")
    log.info("optimize:\n%s", report)
    return best[1], report
