"""The inference modes `zoo.accel` can put a model in, and a timer: what `optimize` and the bench harness
(`zoo.bench`) both try on a model, defined once."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from zoo.accel.amp import cast, with_autocast
from zoo.accel.compile import compile as zoo_compile

__all__ = ["time_call", "Variant", "variants_for", "has_conv", "channels_last"]


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


def has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in model.modules())


@dataclass
class Variant:
    name: str
    build: Callable[[nn.Module, tuple], tuple[nn.Module, tuple]]  # (model, inputs) -> (runnable, inputs)
    compiled: bool = False
    # the low precision it runs in: `optimize` skips it where the CPU only emulates that dtype, while the
    # bench harness still measures it (forced), so the cost of the emulation shows
    dtype: torch.dtype | None = None


def channels_last(model, inputs):
    fmt = torch.channels_last if inputs[0].dim() == 4 else torch.channels_last_3d
    return model.to(memory_format=fmt), tuple(t.to(memory_format=fmt) if t.dim() in (4, 5) else t for t in inputs)


def _int8(model, inputs):
    from zoo.accel.quantize import quantize
    # both int8 paths reach int8 kernels only through inductor with frozen weights: PT2E leaves reference
    # quantize/dequantize ops that ran at 0.36x eager fp32 uncompiled (EfficientNetV2-S)
    if has_conv(model):
        model, inputs = channels_last(model, inputs)
        return zoo_compile(quantize(model, "int8_static", calibration=[inputs]), freeze=True), inputs
    # int8_dynamic's default path for this CPU, compiled with frozen weights whichever it chose
    return quantize(model, "int8_dynamic", example_inputs=inputs, compile=True), inputs


def _compiled_bf16(model, inputs):
    # bf16 weights rather than autocast: no per-call weight casts, half the bytes in norms and activations
    if has_conv(model):
        model, inputs = channels_last(model, inputs)
    return zoo_compile(cast(model, "bf16", force=True), freeze=True), inputs


def variants_for(model: nn.Module, *, compile: bool = True, int8: bool = True) -> list[Variant]:
    """The inference modes for `model`; compiled ones freeze the weights (inference only)."""
    conv = has_conv(model)
    out = [Variant("eager fp32", lambda m, x: (m, x))]
    if conv:
        out.append(Variant("channels_last", channels_last))
    out.append(Variant("bf16 autocast", lambda m, x: (with_autocast(m, "cpu", "bf16", force=True), x),
                       dtype=torch.bfloat16))
    if compile:
        out.append(Variant("compile", lambda m, x: (zoo_compile(m, freeze=True), x), compiled=True))
        out.append(Variant("compile+bf16 cast" + ("+channels_last" if conv else ""), _compiled_bf16,
                           compiled=True, dtype=torch.bfloat16))
    if int8:
        out.append(Variant("int8 static (PT2E, compiled)" if conv else "int8 dynamic (quantize's default)", _int8,
                           compiled=True))
    return out
