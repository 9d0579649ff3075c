"""Speed and memory tools shared by every zoo model: compile, autocast, quantize, checkpointing, export."""
from zoo.accel.amp import autocast, grad_scaler, resolve_dtype
from zoo.accel.checkpointing import checkpointing
from zoo.accel.compile import compile, explain, is_compiled

__all__ = ["compile", "explain", "is_compiled", "autocast", "grad_scaler", "resolve_dtype", "checkpointing"]
