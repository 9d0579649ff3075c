"""Speed and memory tools shared by every zoo model: compile, autocast, quantize, checkpointing, export.

`zoo.accel.export` is the function (zoo/accel/deploy.py), as `zoo.accel.compile` is; the modules of those names
stay importable by their full names (`from zoo.accel.export import export_onnx`)."""
from zoo.accel.amp import autocast, cast, fastest_dtype, grad_scaler, resolve_dtype, with_autocast
from zoo.accel.checkpointing import checkpointing
from zoo.accel.compile import compile, explain, is_compiled
from zoo.accel.export import check_onnx, export_onnx, export_program
from zoo.accel.deploy import export  # noqa: E402  (after the module zoo.accel.export: the function takes the name)
from zoo.accel.hardware import Capabilities, capabilities
from zoo.accel.optimize import optimize
from zoo.accel.quantize import Int8Model, model_size_bytes, quantize

__all__ = ["compile", "explain", "is_compiled", "autocast", "grad_scaler", "resolve_dtype", "fastest_dtype", "with_autocast", "cast",
           "checkpointing", "quantize", "Int8Model", "model_size_bytes", "export", "export_onnx", "check_onnx",
           "export_program", "optimize", "capabilities", "Capabilities"]
