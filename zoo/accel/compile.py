"""torch.compile for any zoo model: in place (state-dict keys and methods unchanged), with a safe fallback."""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Literal

import torch
from torch import nn

from zoo.models.base import unwrap

log = logging.getLogger(__name__)

__all__ = ["compile", "explain", "is_compiled"]


def _compile_errors() -> tuple[type[BaseException], ...]:
    # Only failures of the compiler itself fall back; a user's bad input must still raise its own error.
    errors: list[type[BaseException]] = []
    try:
        from torch._dynamo.exc import TorchDynamoException
        errors.append(TorchDynamoException)
    except ImportError:
        pass
    try:
        from torch._inductor.exc import InductorError
        errors.append(InductorError)
    except ImportError:
        pass
    return tuple(errors)


def compile(model: nn.Module, mode: Literal["default", "reduce-overhead", "max-autotune"] = "default", *,
            dynamic: bool | None = None, fullgraph: bool = False, strict: bool = False,
            dynamic_dims: tuple[int, ...] = (), backend="inductor", freeze: bool = False) -> nn.Module:
    """Compile `model` in place with `nn.Module.compile` and return it.

    The model object, its state-dict keys (no `_orig_mod.`), methods and metadata stay as they are.
    If compilation fails, warn once with the reason and run eager from then on (or raise with
    strict=True). `dynamic_dims`: input dimensions that vary between calls (e.g. (0, 1) for batch and
    sequence length); they are marked dynamic up front so new sizes do not trigger recompilation storms.

    freeze=True (inference): calls made without gradients (no_grad / inference_mode) compile with the
    parameters as constants, so inductor folds BatchNorm into convolutions, fuses activations into them
    and pre-packs weights for oneDNN; on this CPU that is what turns int8 PT2E models into int8 kernels.
    The frozen graph keeps the weights it saw, so a frozen call after the weights changed in place raises
    instead of using stale weights. Calls with gradients compile as usual. (`torch.compile(options={"freezing": True})` does not reach the freezing pass in
    current torch, so the inductor config is set around each call instead.)
    """
    if mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        raise ValueError(f"unknown compile mode {mode!r}; choose default, reduce-overhead or max-autotune")
    errors = _compile_errors()
    try:
        model.compile(mode=mode if backend == "inductor" else None, dynamic=dynamic, fullgraph=fullgraph,
                      backend=backend)
    except errors as e:
        if strict:
            raise
        warnings.warn(f"torch.compile is unavailable for {type(model).__name__} ({e}); using the eager model",
                      RuntimeWarning, stacklevel=2)
        return model
    compiled_call = model._compiled_call_impl
    freeze = freeze and backend == "inductor"
    frozen_at: list[tuple[torch.Tensor, int]] = []  # each weight and its version when the graph was frozen

    def guarded_call(*args, **kwargs):
        if freeze and not torch.is_grad_enabled():
            if not frozen_at:
                frozen_at.extend(_versions(model))
            elif any(t._version != version for t, version in frozen_at):
                # a frozen graph would silently go on with the old weights
                raise RuntimeError(f"the weights of this {type(model).__name__} changed after it was compiled with "
                                   "freeze=True, and a frozen graph keeps the weights it was built with; compile "
                                   "without freeze while the model still trains, or compile a fresh copy after")
        for t in args:
            if isinstance(t, torch.Tensor):
                for d in dynamic_dims:
                    if d < t.dim():
                        torch._dynamo.maybe_mark_dynamic(t, d)
        try:
            with _freezing() if freeze else contextlib.nullcontext():
                return compiled_call(*args, **kwargs)
        except errors as e:
            if strict:
                raise
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(f"torch.compile failed for {type(model).__name__}; running eager instead. Reason: "
                          f"{type(e).__name__}: {reason}", RuntimeWarning, stacklevel=2)
            model._compiled_call_impl = None  # eager from now on: warn once, not every call
            return model._call_impl(*args, **kwargs)

    model._compiled_call_impl = guarded_call
    return model


def _versions(model: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """Each parameter and buffer with its version counter, which grows on every in-place change
    (optimizer steps, load_state_dict). Inference tensors keep none, and cannot change in place."""
    return [(t, t._version) for t in (*model.parameters(), *model.buffers()) if not t.is_inference()]


def _freezing():
    import torch._inductor.config as inductor_config
    return inductor_config.patch(freezing=True)


def is_compiled(model: nn.Module) -> bool:
    return getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod")


def explain(model: nn.Module, *inputs, **kwargs):
    """The graph-break report of torch._dynamo.explain: `.graph_break_count`, `.break_reasons`, `.graph_count`."""
    import torch._dynamo
    target = unwrap(model)
    torch._dynamo.reset()
    return torch._dynamo.explain(target.forward)(*inputs, **kwargs)
