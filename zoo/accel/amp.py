"""Automatic mixed precision: one autocast and one GradScaler choice for every model and device."""
from __future__ import annotations

import contextlib
import functools
import logging

import torch

from zoo.accel import hardware

log = logging.getLogger(__name__)

__all__ = ["autocast", "cast", "fastest_dtype", "grad_scaler", "resolve_dtype", "with_autocast"]

_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32, "off": torch.float32, "none": torch.float32}
_NAME_OF = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_warned: set[tuple] = set()  # (device type, dtype, forced): what this process has already warned about


def resolve_dtype(device: str | torch.device, dtype: str | torch.dtype | None = "auto", *,
                  force: bool = False) -> torch.dtype:
    """The dtype autocast/cast will really use on `device`.

    "auto": bf16 on CPU and on CUDA GPUs that support it, else fp16. A low precision that `device` has no
    native kernels for (bf16 on a CPU without AVX512-BF16/AMX: ~100x slower than fp32, measured) resolves
    to fp32, with one warning per process naming the hardware and the reason; `force=True`, or a name
    ending in "!" ("bf16!", the train scripts' `--amp bf16!`), keeps the slow path.
    """
    device = torch.device(device)
    if isinstance(dtype, str) and dtype.endswith("!"):
        dtype, force = dtype[:-1], True
    if isinstance(dtype, torch.dtype):
        target = dtype
    elif dtype is None or dtype == "auto":
        target = torch.float16 if device.type == "cuda" and not torch.cuda.is_bf16_supported() else torch.bfloat16
    elif dtype in _NAMES:
        target = _NAMES[dtype]
    else:
        raise ValueError(f"unknown precision {dtype!r}; choose auto, bf16, fp16 or fp32/off (\"bf16!\" forces "
                         "bf16 where it is emulated)")
    if target == torch.float32 or not target.is_floating_point or device.type not in ("cpu", "cuda"):
        return target  # cast() refuses a non-floating dtype; other devices' autocast decides for itself
    caps = hardware.capabilities(cuda=device.type == "cuda")
    if caps.native(device, target):
        return target
    reason = hardware.slow_reason(device, target, caps)
    if force:
        _warn_once((device.type, target, True), f"{reason}; running {_NAME_OF[target]} anyway (forced)")
        return target
    flag = _NAME_OF[target]
    _warn_once((device.type, target, False),
               f"{reason}: running fp32 instead; pass force=True (train scripts: "
               f"--amp {flag}!) to run {flag} anyway")
    return torch.float32


def fastest_dtype(device: str | torch.device) -> torch.dtype:
    """The lowest precision `device` runs natively: bf16 (AMX / AVX512-BF16 CPUs, Ampere+ GPUs), else fp16
    (older GPUs, with a GradScaler), else fp32 — the train scripts' `--amp auto`, which never warns."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return torch.float32
    caps = hardware.capabilities(cuda=device.type == "cuda")
    for dtype in (torch.bfloat16, torch.float16):
        if caps.native(device, dtype) and (device.type == "cuda" or dtype == torch.bfloat16):
            return dtype  # CPU fp16 (AMX-FP16) autocast covers fewer ops than bf16: bf16 or nothing there
    return torch.float32


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def autocast(device: str | torch.device = "cpu", dtype: str | torch.dtype | None = "auto", *, force: bool = False):
    """torch.autocast for `device` with the resolved dtype; a no-op context for fp32, which is also what a
    CPU without native bf16 gets (one warning; `force=True` keeps bf16, see `resolve_dtype`).

    Inside, matmuls and convolutions run in low precision; softmax statistics, norms and the
    diffusion schedule arithmetic are computed in fp32 by the blocks themselves.
    """
    device_type = torch.device(device).type
    dtype = resolve_dtype(device, dtype, force=force)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def grad_scaler(device: str | torch.device = "cpu", dtype: str | torch.dtype | None = "auto", *,
                force: bool = False):
    """A GradScaler for fp16 (it skips steps whose gradients are not finite); a disabled one, whose
    methods pass through, for bf16/fp32 (and for an fp16 that falls back to fp32, see `resolve_dtype`)."""
    enabled = resolve_dtype(device, dtype, force=force) == torch.float16
    return torch.amp.GradScaler(torch.device(device).type, enabled=enabled)


def _to_fp32(out):
    return torch.utils._pytree.tree_map(
        lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)


def _wrap_forward(model, wrap):
    """Replace `model.forward` in place with wrap(plain_forward); wrap=None restores the class's forward."""
    if "forward" in vars(model):
        del model.forward
    if wrap is not None:
        plain_forward = type(model).forward.__get__(model)
        model.forward = functools.wraps(plain_forward)(wrap(plain_forward))
    return model


def with_autocast(model, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = "auto", *,
                  force: bool = False):
    """Make `model` run its forward under autocast, in place (keys, methods and metadata unchanged);
    floating outputs come back as fp32. `with_autocast(model, dtype="fp32")` undoes it; a dtype the
    hardware does not run natively leaves it fp32 (one warning) unless `force=True`."""
    dtype = resolve_dtype(device, dtype, force=force)
    if dtype == torch.float32:
        return _wrap_forward(model, None)

    def wrap(plain_forward):
        def forward(*args, **kwargs):
            with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
                return _to_fp32(plain_forward(*args, **kwargs))
        return forward

    return _wrap_forward(model, wrap)


def cast(model, dtype: str | torch.dtype = "bf16", *, force: bool = False):
    """Run `model` in `dtype` end to end, for inference, in place: parameters and floating buffers are
    converted, floating inputs are cast on the way in and floating outputs come back as fp32.

    Against autocast, compiled with freeze=True on this CPU: EfficientNetV2 at 32x32 2x faster (no weight
    casts per call, BatchNorm folded into bf16 convolutions, half the bytes through activations), BERT
    about the same; the weights take half the memory either way. Norm statistics are then
    computed in bf16 as well, so check the accuracy on your data (the model cards list it for the shipped
    weights). Every floating input is cast, so a model that needs some input in full precision (e.g.
    fractional diffusion timesteps; zoo's diffusion_unet takes integer ones) is better served by autocast.
    `cast(model, "fp32")` converts back (the bf16 rounding of the weights stays). On hardware without
    native kernels for `dtype` (bf16 on an AVX2 CPU: ~100x slower) the model is left in fp32, with one
    warning, unless `force=True`.
    """
    device = next(model.parameters(), torch.empty(0)).device
    target = resolve_dtype(device, dtype, force=force)  # the names autocast takes, "auto" included
    if not target.is_floating_point:
        raise ValueError(f"unknown precision {dtype!r}; choose bf16, fp16 or fp32")
    model.to(target)
    if target == torch.float32:
        return _wrap_forward(model, None)

    def to_target(t):
        return t.to(target) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def wrap(plain_forward):
        def forward(*args, **kwargs):
            args, kwargs = torch.utils._pytree.tree_map(to_target, (args, kwargs))
            return _to_fp32(plain_forward(*args, **kwargs))
        return forward

    return _wrap_forward(model, wrap)
