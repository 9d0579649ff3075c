"""Speed and memory tools shared by every zoo model: compile, autocast, quantize, checkpointing, export."""
from zoo.accel.amp import autocast, cast, grad_scaler, resolve_dtype, with_autocast
from zoo.accel.checkpointing import checkpointing
from zoo.accel.compile import compile, explain, is_compiled
from zoo.accel.export import check_onnx, export_onnx, export_program
from zoo.accel.hardware import Capabilities, capabilities
from zoo.accel.optimize import optimize
from zoo.accel.quantize import model_size_bytes, quantize

__all__ = ["compile", "explain", "is_compiled", "autocast", "grad_scaler", "resolve_dtype", "with_autocast", "cast",
           "checkpointing", "quantize", "model_size_bytes", "export_onnx", "check_onnx", "export_program",
           "optimize", "capabilities", "Capabilities"]
