"""int8 quantization for zoo models: dynamic, weight-only, and static for convolutional models.

    q = zoo.accel.quantize(model, "int8_dynamic")                          # Linear layers (torchao)
    q = zoo.accel.quantize(model, "int8_dynamic", backend="pt2e", example_inputs=x)  # x86 int8 kernels
    q = zoo.accel.quantize(model, "int8_weight_only")                      # Linear (+ Embedding) weights
    q = zoo.accel.quantize(model, "int8_static", calibration=batches)      # convolutions, PT2E + x86

Each returns a new model and leaves the input untouched; `model_size_bytes` reports the size.
"""
from __future__ import annotations

import copy
import io
import logging
from typing import Iterable

import torch
from torch import nn

from zoo.models.base import unwrap

log = logging.getLogger(__name__)

__all__ = ["quantize", "model_size_bytes", "METHODS"]

METHODS = ("int8_dynamic", "int8_weight_only", "int8_static")


def model_size_bytes(model: nn.Module) -> int:
    """Bytes of the serialised state dict (quantized tensor subclasses and folded PT2E constants included)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


def _has(model: nn.Module, kinds: tuple[type, ...]) -> bool:
    return any(isinstance(m, kinds) for m in model.modules())


def _torchao():
    try:
        import torchao  # noqa: F401
        return True
    except ImportError:
        return False


def quantize(model: nn.Module, method: str, calibration: Iterable | None = None, *,
             example_inputs: tuple | None = None, embeddings: bool = False, backend: str = "torchao",
             dynamic_dims: dict[int, tuple[int, ...]] | None = None) -> nn.Module:
    """Return an int8 copy of `model`.

    int8_dynamic: Linear weights int8, activations quantized per token at run time.
    int8_weight_only: Linear weights int8, activations stay in float (helps memory-bound decoding).
    int8_static: convolutions and linears with activation scales calibrated on `calibration` (an iterable
        of input tuples or tensors); needs a model with convolutions.
    embeddings=True also stores nn.Embedding tables in int8 (weight-only), the bulk of a small BERT.

    backend (int8_dynamic): "torchao" keeps the model object (its methods, any input shape); "pt2e"
    traces the model on `example_inputs` with torch.export and quantizes it for x86's oneDNN int8 kernels,
    which `zoo.accel.compile(q, freeze=True)` reaches (BERT on SST-2 with int8 embeddings: 2.25x fp32
    compiled, against torchao's 1.35x; -0.1 pt; 3.9x smaller; bench/results/bert_cls_int8.amx.txt). PT2E models
    (and int8_static) are graph modules without the model's other methods; their batch dimension stays
    dynamic, and `dynamic_dims` adds others, e.g. {0: (1,), 1: (1,)} for a sequence length in inputs 0 and 1.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize takes a torch.nn.Module (e.g. zoo.load(name, pretrained=True)), got "
                        f"{type(model).__name__} {model!r:.60}")
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose {', '.join(METHODS)}")
    if backend not in ("torchao", "pt2e"):
        raise ValueError(f"unknown quantization backend {backend!r}; choose torchao or pt2e")
    plain = unwrap(model)
    qmodel = copy.deepcopy(plain).eval()
    if method == "int8_static":
        if not _has(qmodel, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            raise ValueError(f"int8_static is for convolutional models and {type(plain).__name__} has no "
                             "convolutions; use int8_dynamic for Linear-only models")
        if calibration is None:
            raise ValueError("int8_static needs calibration=...: an iterable of representative input batches")
        return _pt2e(qmodel, [_as_tuple(b) for b in calibration], example_inputs, dynamic_dims, method, embeddings)
    if not _has(qmodel, (nn.Linear,)):
        raise ValueError(f"{method} quantizes nn.Linear layers and {type(plain).__name__} has none; "
                         "for a convolutional model use int8_static with a calibration loader")
    if backend == "pt2e":
        if method != "int8_dynamic":
            raise ValueError(f"backend='pt2e' is for int8_dynamic; use backend='torchao' for {method}")
        if example_inputs is None:
            raise ValueError("backend='pt2e' traces the model: pass example_inputs=(...) of a typical call")
        return _pt2e(qmodel, [tuple(example_inputs)], example_inputs, dynamic_dims, method, embeddings)
    if not _torchao():
        return _legacy_dynamic(qmodel, method)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    # torchao is the maintained int8 path for current torch (torch.ao.quantization is deprecated);
    # its kernels pay off under torch.compile (measured: 0.72x eager, 1.81x compiled for BERT on this CPU).
    config = Int8DynamicActivationInt8WeightConfig() if method == "int8_dynamic" else Int8WeightOnlyConfig()
    quantize_(qmodel, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    if embeddings and _has(qmodel, (nn.Embedding,)):
        quantize_(qmodel, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    qmodel.quantization = method
    return qmodel


def _legacy_dynamic(qmodel: nn.Module, method: str) -> nn.Module:
    # Without torchao: torch.ao's dynamic quantization (fbgemm kernels) for int8_dynamic only.
    if method != "int8_dynamic":
        raise RuntimeError(f"{method} needs torchao: pip install torchao")
    qmodel = torch.ao.quantization.quantize_dynamic(qmodel, {nn.Linear}, dtype=torch.qint8)
    qmodel.quantization = method
    return qmodel


def _as_tuple(batch) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _pt2e(qmodel: nn.Module, batches: list[tuple], example_inputs: tuple | None,
          dynamic_dims: dict[int, tuple[int, ...]] | None, method: str, embeddings: bool) -> nn.Module:
    from zoo.accel.export import export_program
    if not batches:
        raise ValueError("the calibration iterable is empty")
    example = tuple(example_inputs) if example_inputs is not None else batches[0]
    # PT2E with the x86 Inductor quantizer is the maintained graph path (FX graph mode is deprecated);
    # it lives in torchao for current torch and in torch.ao for older releases.
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    except ImportError:
        from torch.ao.quantization.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torch.ao.quantization.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    config = get_default_x86_inductor_quantization_config(is_dynamic=method == "int8_dynamic")
    quantizer = X86InductorQuantizer().set_global(config)
    with torch.no_grad():
        exported = export_program(qmodel, example, dynamic_dims=dynamic_dims).module()
        prepared = prepare_pt2e(exported, quantizer)
        for batch in batches:  # dynamic: one pass inserts the run-time observers
            prepared(*batch)
        converted = convert_pt2e(prepared)
    if embeddings:
        _int8_embeddings(converted)
    _drop_unused_attributes(converted)
    converted.quantization = method
    return converted


def _int8_embeddings(graph_module: torch.fx.GraphModule) -> None:
    """Store each embedding table of a PT2E graph in int8 with one fp32 scale per row (symmetric, as
    torchao's weight-only int8): the lookup gathers int8 rows and their scales, then multiplies."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target == torch.ops.aten.embedding.default
                and node.args[0].op == "get_attr"):
            continue
        owner, _, attr = node.args[0].target.rpartition(".")
        weight = getattr(graph_module.get_submodule(owner), attr)
        scale = weight.detach().abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
        name = node.args[0].target.replace(".", "_")
        graph_module.register_buffer(f"{name}_int8", torch.round(weight.detach() / scale).to(torch.int8))
        graph_module.register_buffer(f"{name}_scale", scale.float())
        ids = node.args[1]
        with graph.inserting_before(node):
            rows = graph.call_function(torch.ops.aten.embedding.default, (graph.get_attr(f"{name}_int8"), ids))
            scales = graph.call_function(torch.ops.aten.embedding.default, (graph.get_attr(f"{name}_scale"), ids))
            rows = graph.call_function(torch.ops.aten._to_copy.default, (rows,), {"dtype": weight.dtype})
            lookup = graph.call_function(torch.ops.aten.mul.Tensor, (rows, scales))
        node.replace_all_uses_with(lookup)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    graph_module.recompile()


def _drop_unused_attributes(graph_module: torch.fx.GraphModule) -> None:
    """convert_pt2e folds int8 weights into new constants but keeps the fp32 originals as attributes;
    drop what the graph no longer reads so the saved model is really int8."""
    used = {node.target for node in graph_module.graph.nodes if node.op == "get_attr"}
    for name in list(graph_module.state_dict()):
        if name not in used:
            *path, attr = name.split(".")
            owner = graph_module
            for part in path:
                owner = getattr(owner, part)
            delattr(owner, attr)
