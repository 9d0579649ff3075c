"""int8 exports (`zoo export --int8`, `zoo.accel.export(..., int8=True)`): what is quantized, how, and against what
the artifact is verified.

    onnx  onnxruntime's quantizer on the fp32 ONNX file: quantize_dynamic (MatMul and the Gather of embedding
          tables; QOperator, the only form it writes) for Linear-only models (bert_cls, transformer_lm),
          quantize_static (QDQ, Conv/MatMul/Gemm, min-max calibration) for convolutional ones
    aoti  PT2E (zoo.accel.quantize(..., backend="pt2e"), the x86 Inductor quantizer): int8_dynamic (+ int8
          embedding tables) for Linear-only models, int8_static for convolutional ones, compiled by AOTInductor;
          with VNNI with frozen weights (Inductor's int8 fusions: oneDNN int8 kernels), without VNNI unfrozen
          (the int8 weights dequantized into fp32 kernels: smaller, not faster), since oneDNN's u8 x s8 kernels
          saturate there too: frozen, the tiny test configs came out 6.9% (effnetv2_cls, static) and 18.5%
          (bert_cls, dynamic) of the output's magnitude away from the int8 model they were compiled from, 0 unfrozen

Calibration (static only): `calibration=`, an iterable of input tuples of the first graph (real, preprocessed
batches), else CALIBRATION_BATCHES batches of the model's own export example inputs (seeded noise of the
preprocessed shape and scale; the masks and caches as the family builds them). Measured on the shipped
effnetv2_cls (CIFAR-10 test, the 2,000 of cifar10_small; fp32 0.9115; AMD EPYC AVX-512-BF16 with VNNI): int8 ONNX
calibrated on the noise 0.9085 (98.35% of fp32's predictions), on 4 x 32 CIFAR-10 training images 0.9125 (99.35%);
3.2 MB against 11.3 MB in fp32. (Earlier weights: 0.904 / 0.906 against 0.9055, 0.891 / 0.8895 against 0.8905 and
0.8865 / 0.881 against 0.882 on the same CPU class; 0.8705 / 0.874 against 0.8725 on an AVX2 EPYC.)

The int8 weight type depends on the CPU (zoo.accel.hardware.capabilities().vnni): without VNNI onnxruntime's
u8 x s8 kernel (AVX2 vpmaddubsw) saturates its int16 pair sums. Measured on the shipped bert_cls (SST-2 dev,
872 sentences, fp32 0.9002; AMD EPYC AVX2, no VNNI): s8 weights 0.8911 (95.6% of predictions as fp32's), 7-bit
s8 (reduce_range) 0.8888, 7-bit s8 per channel 0.8968, u8 weights (U8U8, onnxruntime's advice without VNNI)
0.8933, u8 per channel 0.8945 (98.5% as fp32, the smallest logit error: 0.86 against 3.6 for s8). So: u8
weights per channel without VNNI, s8 per channel with it (VNNI's vpdpbusd sums in int32, no saturation).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from zoo.accel import hardware
from zoo.models.base import ExportGraph

__all__ = ["FORMATS", "CALIBRATION_BATCHES", "TOLERANCE", "Int8Plan", "plan", "check_format",
           "calibration_batches", "quantize_graph", "quantize_onnx", "onnx_reference"]

FORMATS = ("onnx", "aoti")
CALIBRATION_BATCHES = 4
# The largest error of an int8 artifact against the int8 model it was made from, relative to the output's
# magnitude, by method. Static: measured 0 for effnetv2_cls's QDQ file, fused kernels against the same graph op
# by op, 0 for its aoti package and 3.0% for diffusion_unet's (Inductor's fused float kernels round differently
# before a quantize step), against 6-7% where u8 x s8 kernels saturate (onnxruntime's with s8 weights, oneDNN's
# frozen, without VNNI): that is what it catches.
# Dynamic: activation scales are taken per call from each tensor's range, so float rounding differences between
# a fused kernel and the graph op by op move whole quantization steps; measured on the shipped bert_cls at its
# verification input (3 x 129 random tokens): 7.7% fused against op by op, 9.1% against onnx.reference's exact
# integer arithmetic (and 12% against fp32). The check there catches a broken graph, not a rounding step.
TOLERANCE = {"static": 5e-2, "dynamic": 0.15}


@dataclasses.dataclass(frozen=True)
class Int8Plan:
    """How one export is quantized; `describe()` is what zoo_export.json records."""
    format: str
    static: bool  # calibrated activation scales (convolutional models); else dynamic (per call)
    vnni: bool
    calibration: str | None  # where the activation scales came from (static only)

    @property
    def tolerance(self) -> float:
        return TOLERANCE["static" if self.static else "dynamic"]

    @property
    def freeze(self) -> bool:
        """aoti: compile with frozen weights, which lowers to oneDNN's int8 kernels (fast and exact with VNNI)."""
        return self.vnni

    @property
    def weight_type(self) -> str:
        return "int8" if self.vnni else "uint8"

    def describe(self) -> dict:
        cpu = hardware.capabilities(cuda=False).describe()
        if self.format == "onnx":
            settings = {"tool": f"onnxruntime.quantization.{'quantize_static' if self.static else 'quantize_dynamic'}",
                        "format": "QDQ" if self.static else "QOperator",
                        "ops": ["Conv", "MatMul (weights)", "Gemm"] if self.static else ["MatMul (weights)", "Gather"],
                        "weights": f"{self.weight_type} per channel", "activations": "uint8",
                        "reduce_range": False}
            why = ("u8 weights (U8U8): without VNNI onnxruntime's u8 x s8 kernel saturates (bert_cls SST-2: s8 "
                   "-0.9 pt, u8 per channel -0.6 pt)" if not self.vnni else
                   "s8 weights (U8S8): VNNI sums in int32 without saturating")
        else:
            settings = {"tool": f"zoo.accel.quantize({'int8_static' if self.static else 'int8_dynamic'!r}, "
                                f"backend='pt2e'{'' if self.static else ', embeddings=True'})",
                        "quantizer": "X86InductorQuantizer", "weights": "int8 per channel",
                        "activations": "uint8", "frozen": self.freeze}
            why = ("frozen: Inductor lowers to oneDNN's int8 kernels, which VNNI runs without saturating" if self.vnni
                   else "not frozen: without VNNI oneDNN's u8 x s8 kernels saturate (tiny effnetv2_cls 6.9%, tiny "
                        "bert_cls 18.5% away from the int8 model frozen); the int8 weights run dequantized in fp32")
        return {"method": "static" if self.static else "dynamic", **settings,
                "calibration": self.calibration, "cpu": cpu, "why": why}


def check_format(format: str) -> None:
    """Raise ValueError (one line) unless `format` has an int8 export."""
    if format not in FORMATS:
        raise ValueError(f"--int8 exports {' and '.join(FORMATS)} (onnxruntime's quantizer, PT2E), not {format}; "
                         f"use --format onnx or --format aoti, or export {format} in fp32 without --int8")


def plan(model: nn.Module, format: str, calibration: Iterable | None) -> Int8Plan:
    check_format(format)
    static = any(isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) for m in model.modules())
    if calibration is not None and not static:
        raise ValueError(f"calibration= is for convolutional models (static int8); {type(model).__name__} is "
                         "quantized dynamically (activation scales per call): leave calibration out")
    where = None
    if static:
        where = ("the caller's calibration batches" if calibration is not None else
                 f"{CALIBRATION_BATCHES} batches of the model's example inputs (seeded noise; pass calibration= "
                 "real batches from Python for the best scales)")
    return Int8Plan(format, static, hardware.capabilities(cuda=False).vnni, where)


# ------------------------------------------------------------------ calibration


def calibration_batches(model, graphs: dict[str, ExportGraph], batch: int, example: dict,
                        calibration: Iterable | None) -> dict[str, list[tuple[Tensor, ...]]]:
    """Per graph, the batches its activation scales are calibrated on, each of the traced shape."""
    many = model.export_graphs(CALIBRATION_BATCHES * batch, **example)
    batches = {name: [tuple(_rows(t, dims, k * batch, batch) for t, dims in zip(graph.inputs, graph.dims))
                      for k in range(CALIBRATION_BATCHES)]
               for name, graph in many.items()}
    if calibration is not None:
        batches[next(iter(graphs))] = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in calibration]
        if not batches[next(iter(graphs))]:
            raise ValueError("calibration= is empty; give a few representative input batches")
    return batches


def _rows(t: Tensor, dims: dict, start: int, count: int) -> Tensor:
    """Rows start..start+count of `t` along its batch dimension (tensors without one as they are)."""
    d = next((d for d, dyn in dims.items() if dyn.name == "batch"), None)
    return t if d is None else t.narrow(d, start, count).contiguous()


# ------------------------------------------------------------------ aoti: PT2E


def quantize_graph(graph: ExportGraph, plan: Int8Plan, keep: set[str], batches: list[tuple]) -> ExportGraph:
    """`graph` with its module replaced by the PT2E int8 module (the explicit backend="pt2e" form of
    zoo.accel.quantize), traced with the same dynamic dimensions: the int8 eager model AOTInductor compiles."""
    from zoo.accel.quantize import quantize
    inputs = tuple(t.contiguous() for t in graph.inputs)
    # the batch (dim 0) is dynamic in every input already (export_program); these are the others
    dynamic_dims = {i: tuple(d for d, dyn in dims.items() if dyn.name in keep and d != 0)
                    for i, dims in enumerate(graph.dims)}
    if plan.static:
        module = quantize(graph.module, "int8_static", batches, backend="pt2e", example_inputs=inputs,
                          dynamic_dims=dynamic_dims, embeddings=False)
    else:
        module = quantize(graph.module, "int8_dynamic", backend="pt2e", example_inputs=inputs,
                          dynamic_dims=dynamic_dims, embeddings=True)
    try:
        from torchao.quantization.pt2e import allow_exported_model_train_eval
    except ImportError:
        from torch.ao.quantization import allow_exported_model_train_eval
    if not any("quantized_decomposed" in str(node.target) for node in module.graph.nodes):
        kinds = sorted({type(m).__name__ for m in graph.module.modules() if isinstance(m, (nn.Conv1d, nn.Conv3d))})
        raise RuntimeError(f"PT2E's x86 quantizer left every layer of {type(graph.module).__name__} in float (it "
                           f"quantizes Linear and Conv2d{', not ' + ', '.join(kinds) if kinds else ''}): an aoti "
                           "--int8 file would be fp32; export int8 with --format onnx, or aoti without --int8")
    allow_exported_model_train_eval(module)  # the export puts it in eval mode, which PT2E modules refuse by default
    return dataclasses.replace(graph, module=module)


# ------------------------------------------------------------------ onnx: onnxruntime's quantizer


def quantize_onnx(source: Path, target: Path, plan: Int8Plan, names: tuple[str, ...], batches: list[tuple]) -> None:
    """Write the int8 ONNX file `target` from the fp32 `source` (onnxruntime's quantizer, see the module doc);
    `names` are the inputs of each calibration batch."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    weights = QuantType.QInt8 if plan.vnni else QuantType.QUInt8
    if not plan.static:
        quantize_dynamic(source, target, op_types_to_quantize=["MatMul", "Gather"], per_channel=True,
                         weight_type=weights)
        return
    from onnxruntime.quantization.shape_inference import quant_pre_process
    # fold BatchNorm into Conv and infer shapes first (onnxruntime's recommended pre-processing)
    prepared = source.with_name(f"{source.stem}.prepared.onnx")
    quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
    graph = onnx.load(str(prepared), load_external_data=False).graph
    kept = {i.name for i in graph.input}
    # the layers' matmuls, not attention's activation x activation ones: quantized, the softmax between them
    # becomes onnxruntime's approximate QLinearSoftmax (diffusion_unet: 7% away from the graph run op by op)
    weights_in = {t.name for t in graph.initializer}
    attention = [n.name for n in graph.node if n.op_type == "MatMul" and not weights_in & set(n.input)]
    quantize_static(prepared, target, _Feeds(names, kept, batches), quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["Conv", "MatMul", "Gemm"], nodes_to_exclude=attention, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=weights)
    prepared.unlink()


class _Feeds:
    """onnxruntime's CalibrationDataReader over batches of input tuples (inputs the exporter dropped left out)."""

    def __init__(self, names: tuple[str, ...], kept: set[str], batches: list[tuple]):
        self.names, self.kept, self.batches = names, kept, iter(batches)

    def get_next(self) -> dict | None:
        batch = next(self.batches, None)
        return None if batch is None else {n: t.numpy() for n, t in zip(self.names, batch) if n in self.kept}


def onnx_reference(path: Path, names: list[str]) -> Callable[..., list[Tensor]]:
    """The int8 ONNX graph run op by op (onnxruntime with its graph optimisations off: no fused int8 kernels;
    in a QDQ graph every op computes in float between DequantizeLinear and QuantizeLinear): the int8 eager model."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    kept = {i.name for i in session.get_inputs()}

    def run(*tensors: Tensor) -> list[Tensor]:
        feeds = {n: t.numpy() for n, t in zip(names, tensors) if n in kept}
        return [torch.from_numpy(a) for a in session.run(None, feeds)]
    return run
