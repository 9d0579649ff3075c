"""`optimize`: measure the applicable speed-ups on the user's own example and keep the fastest that is exact enough.

Measurement, not folklore: on this 2-core CPU bf16 beats int8 for BERT, torchao int8 is slower than
fp32 eagerly but faster compiled, and bf16 alone slows EfficientNetV2 at 32x32 while compile+bf16
speeds it up. Eager fp32 is always a candidate, so the result is never slower than the input model.
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from zoo.accel.variants import time_call, variants_for
from zoo.models.base import unwrap

log = logging.getLogger(__name__)

__all__ = ["optimize"]


def _max_rel_error(out, ref) -> float:
    out = out.float() if isinstance(out, torch.Tensor) else out[0].float()
    ref = ref.float() if isinstance(ref, torch.Tensor) else ref[0].float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def optimize(model: nn.Module, example_inputs: tuple, *, tolerance: float = 0.05, compile: bool = True,
             int8: bool = True, reps: int = 5) -> tuple[nn.Module, str]:
    """Try channels_last, bf16, compile and int8 (where they apply) on `example_inputs`; return the fastest
    variant whose output is within `tolerance` (max error relative to the fp32 output's max) and a report.

    The returned model expects inputs like `example_inputs` (channels_last conversion is done inside
    the variant for the example only, so convert your inputs the same way for that mode).
    """
    example_inputs = tuple(example_inputs)
    model = unwrap(model).eval()
    with torch.inference_mode():
        reference = model(*example_inputs)
    results = []
    for variant in variants_for(model, compile=compile, int8=int8):
        try:
            candidate, inputs = variant.build(copy.deepcopy(model).eval(), example_inputs)
            with torch.inference_mode():
                error = _max_rel_error(candidate(*inputs), reference)
                seconds = time_call(lambda: candidate(*inputs), warmup=3 if variant.compiled else 1, reps=reps)
        except Exception as e:
            results.append((variant.name, None, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}"))
            continue
        ok = error <= tolerance
        results.append((variant.name, seconds, candidate if ok else None,
                        f"{seconds * 1e3:8.1f} ms  error {error:.2e}{'' if ok else '  (over tolerance)'}"))
    eager_s = results[0][1]
    usable = [r for r in results if r[2] is not None]
    best = min(usable, key=lambda r: r[1])
    lines = [f"{name:<34} {note}" + (f"  {eager_s / s:.2f}x" if s else "") for name, s, _, note in results]
    report = "\n".join(lines) + f"\nchosen: {best[0]} ({eager_s / best[1]:.2f}x eager fp32)"
    log.info("optimize:\n%s", report)
    return best[2], report
