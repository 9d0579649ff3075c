"""int8 quantization for zoo models: dynamic, weight-only, and static for convolutional models.

    q = zoo.accel.quantize(model, "int8_dynamic")                          # the path that pays on this CPU
    q = zoo.accel.quantize(model, "int8_dynamic", backend="pt2e", example_inputs=x)  # one path, as asked
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

from zoo._deps import require
from zoo.accel import hardware
from zoo.accel.calibration import RangeWatch
from zoo.accel.compile import compile as zoo_compile
from zoo.models.base import ZooModel, unwrap

log = logging.getLogger(__name__)

__all__ = ["quantize", "model_size_bytes", "METHODS", "Int8Model", "default_path"]

METHODS = ("int8_dynamic", "int8_weight_only", "int8_static")
X86_CLASSES = ("AMX", "AVX-512-BF16", "AVX-512", "AVX2")  # hardware.capabilities' x86 classes: oneDNN's int8 kernels


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


class Int8Model(nn.Module):
    """What `quantize(model, "int8_dynamic")` returns on x86 (and any PT2E int8 model with compile=True): the
    model's torch.export graph with int8 weights (and int8 embedding tables) in `.graph`, a `torch.fx.GraphModule`
    compiled by inductor with frozen weights, which is what lowers it to oneDNN's int8 kernels. Called like the
    model, on the positional inputs of the family's export example (bert_cls: input_ids, attention_mask), the
    batch and the dimensions the family marks dynamic taking any size; the first call compiles (a minute on 2
    cores). Inference only: every call runs without autograd, as the frozen graph needs (int8 weights do not
    train). It has none of the model's other methods or attributes (`encode`, `forward_features`, `labels`,
    `reset_head`, ...; token_type_ids for sentence pairs): keep the fp32 model for those."""

    def __init__(self, graph: torch.fx.GraphModule, quantization: str):
        super().__init__()
        self.graph = graph
        self.quantization = quantization

    def forward(self, *args, **kwargs):
        with torch.no_grad():  # the frozen (int8-kernel) graph is compiled for calls without gradients only
            return self.graph(*args, **kwargs)


def _traced_inputs(plain: nn.Module) -> tuple[tuple, dict[int, tuple[int, ...]]] | None:
    """A zoo model's example and the dimensions besides the batch that vary at run time, from its export
    graph (`export_graphs()["model"]`, built on `example_inputs()`); None where that graph is not the model's
    own forward (transformer_lm exports a prefill that also returns its KV cache) or for another module."""
    if not isinstance(plain, ZooModel):
        return None
    graph = plain.export_graphs()["model"]
    if graph.module is not plain:
        return None
    dims = {i: tuple(d for d in spec if d != 0) for i, spec in enumerate(graph.dims)}
    return tuple(graph.inputs), {i: d for i, d in dims.items() if d}


def default_path(model: nn.Module, example_inputs: tuple | None = None) -> tuple[str, str]:
    """(path, why) that `quantize(model, "int8_dynamic")` takes with no other argument, on this CPU
    (`zoo.accel.capabilities`):

    "pt2e" on x86 CPUs (AVX2, AVX-512, AMX): PT2E int8 for oneDNN, int8 embedding tables, compiled with frozen
        weights (an `Int8Model`); 7-bit activations without VNNI. The shipped SST-2 bert_cls (0.8956 dev
        accuracy against fp32's 0.9002, 3.9x smaller) ran at 1.10-1.16x fp32 eager on an AVX2 EPYC without VNNI,
        where fp32 compiled ran at 1.06-1.10x (batch 16 x 128, rows interleaved over 10 rounds, 1 thread, two
        runs), and at 2.25x fp32 compiled on an AMX Xeon (bench/results/bert_cls_int8.amx.txt): int8 beat fp32
        on both classes measured, so no class falls back to the fp32 model;
    "torchao": torchao's int8 Linear layers on the model object itself, eager, where there is nothing to trace
        (a module that is not a zoo model and no `example_inputs`; transformer_lm, whose export graph is not
        its forward), on a model off the CPU, or on a CPU that is not x86 (none of these measured)."""
    plain = unwrap(model)
    return _decide(plain, example_inputs is not None or _traced_inputs(plain) is not None)


def _decide(plain: nn.Module, traceable: bool) -> tuple[str, str]:
    parameter = next(iter(plain.parameters()), None)
    if parameter is not None and parameter.device.type != "cpu":
        return "torchao", f"the model is on {parameter.device.type}, and PT2E's int8 kernels are the CPU's"
    caps = hardware.capabilities(cuda=False)
    if caps.cpu_class not in X86_CLASSES:
        return "torchao", f"PT2E's int8 kernels are x86's (oneDNN), and this CPU is {caps.cpu_class}"
    if not traceable:
        return "torchao", (f"{type(plain).__name__} has no zoo export graph of its forward to trace; pass "
                           "example_inputs=(...) for the compiled PT2E path")
    # without VNNI (AVX2) oneDNN's int8 dot products take three instructions where VNNI takes one, and int8 still
    # beat fp32 there (above): one rule for every x86 class
    return "pt2e", f"oneDNN's int8 kernels of this {caps.cpu_class} CPU, reached by a frozen compilation"


def quantize(model: nn.Module, method: str, calibration: Iterable | None = None, *,
             example_inputs: tuple | None = None, embeddings: bool | None = None, backend: str | None = None,
             dynamic_dims: dict[int, tuple[int, ...]] | None = None, compile: bool | None = None) -> nn.Module:
    """Return an int8 copy of `model`.

    int8_dynamic: Linear weights int8, activations quantized per call at run time.
    int8_weight_only: Linear weights int8, activations stay in float (helps memory-bound decoding).
    int8_static: convolutions and linears with activation scales calibrated on `calibration` (an iterable
        of input tuples or tensors); needs a model with convolutions. A batch that drives some layer 10x past
        the other batches' median gets a warning naming it: it alone would set that layer's int8 range
        (zoo.accel.calibration).

    int8_dynamic with no other argument takes the path that pays on this CPU (`default_path`): on x86 an
    `Int8Model` (PT2E traced on the zoo model's own export example, int8 embedding tables, compiled with frozen
    weights; called like the model, inference only, none of its other methods; bert_cls: 1.10-1.16x fp32 eager
    on AVX2, 2.25x fp32 compiled on AMX, 3.9x smaller, -0.5 pt on SST-2); for a module that is not a zoo model and
    gets no `example_inputs`, torchao's int8 Linear layers on the model object itself, eager, as before (keeps
    its methods, but runs slowly uncompiled: 0.03-0.05x fp32 eager on an AVX2 CPU, 0.72x on an AMX one).

    The knobs, for experts (each left at None is chosen as above):
    backend: "torchao" keeps the model object (its methods, any input shape); "pt2e" traces the model on
        `example_inputs` with torch.export and quantizes it for x86's oneDNN int8 kernels, a graph module that
        `zoo.accel.compile(q, freeze=True)` (or compile=True) lowers to them (BERT on SST-2 with int8
        embeddings: 2.25x fp32 compiled, against torchao's 1.35x; -0.1 pt; 3.9x smaller; AMX,
        bench/results/bert_cls_int8.amx.txt). PT2E models (and int8_static) are graph modules without the
        model's other methods; their batch dimension stays dynamic, and `dynamic_dims` adds others, e.g.
        {0: (1,), 1: (1,)} for a sequence length in inputs 0 and 1.
    embeddings: also store nn.Embedding tables in int8 (weight-only, one scale per row), the bulk of a small
        BERT; chosen: on for the default PT2E path (SST-2 within 0.5 pt), off with an explicit backend.
    compile: compile the result with frozen weights (`zoo.accel.compile(q, freeze=True)`; a PT2E graph then
        comes as an `Int8Model`); chosen: on for the default PT2E path, off for torchao and with an explicit
        backend (the graph module then stays exportable).
    With backend left at None the other knobs refine the chosen path (e.g. compile=False: the PT2E graph module).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize takes a torch.nn.Module (e.g. zoo.load(name, pretrained=True)), got "
                        f"{type(model).__name__} {model!r:.60}")
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose {', '.join(METHODS)}")
    if backend not in (None, "torchao", "pt2e"):
        raise ValueError(f"unknown quantization backend {backend!r}; choose torchao or pt2e")
    plain = unwrap(model)
    qmodel = copy.deepcopy(plain).eval()
    if method == "int8_static":
        if not _has(qmodel, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            raise ValueError(f"int8_static is for convolutional models and {type(plain).__name__} has no "
                             "convolutions; use int8_dynamic for Linear-only models")
        if calibration is None:
            raise ValueError("int8_static needs calibration=...: an iterable of representative input batches")
        return _pt2e(qmodel, [_as_tuple(b) for b in calibration], example_inputs, dynamic_dims, method,
                     bool(embeddings), reduce_range=_reduce_range())
    if not _has(qmodel, (nn.Linear,)):
        raise ValueError(f"{method} quantizes nn.Linear layers and {type(plain).__name__} has none; "
                         "for a convolutional model use int8_static with a calibration loader")
    if backend is None and method == "int8_dynamic":
        return _chosen(qmodel, method, example_inputs, dynamic_dims, embeddings, compile)
    if backend == "pt2e":
        if method != "int8_dynamic":
            raise ValueError(f"backend='pt2e' is for int8_dynamic; use backend='torchao' for {method}")
        if example_inputs is None:
            raise ValueError("backend='pt2e' traces the model: pass example_inputs=(...) of a typical call")
        q = _pt2e(qmodel, [tuple(example_inputs)], example_inputs, dynamic_dims, method, bool(embeddings))
        return _compiled_pt2e(q, dynamic_dims, method) if compile else q
    q = _torchao_int8(qmodel, method, bool(embeddings))
    return zoo_compile(q, freeze=True) if compile else q


def _chosen(qmodel: nn.Module, method: str, example_inputs: tuple | None, dynamic_dims: dict | None,
            embeddings: bool | None, compile: bool | None) -> nn.Module:
    """int8_dynamic by `default_path`, the knobs given kept."""
    traced = None if example_inputs is not None else _traced_inputs(qmodel)
    path, why = _decide(qmodel, example_inputs is not None or traced is not None)
    log.info("quantize int8_dynamic: %s (%s)", path, why)
    if path == "torchao":
        q = _torchao_int8(qmodel, method, bool(embeddings))
        return zoo_compile(q, freeze=True) if compile else q
    if traced is not None:
        example_inputs, traced_dims = traced
        dynamic_dims = traced_dims if dynamic_dims is None else dynamic_dims
    q = _pt2e(qmodel, [tuple(example_inputs)], example_inputs, dynamic_dims, method,
              True if embeddings is None else embeddings, reduce_range=_reduce_range())
    return q if compile is False else _compiled_pt2e(q, dynamic_dims, method)


def _reduce_range() -> bool:
    """7-bit activations where the CPU has no VNNI (upstream's advice), for int8_dynamic's default and int8_static:
    oneDNN's u8 x s8 kernels (vpmaddubsw) add pairs of products into int16, which saturates with full-range u8.
    Measured on AVX2: a tiny bert_cls frozen came out 3.3% off its own int8 graph with 8-bit activations, 1.5e-7
    with 7-bit; the shipped one scored 0.8956 on SST-2 either way."""
    return not hardware.capabilities(cuda=False).vnni


def _compiled_pt2e(graph: torch.fx.GraphModule, dynamic_dims: dict | None, method: str) -> Int8Model:
    # the traced dynamic sizes marked up front: one compilation serves every batch and sequence length,
    # where dynamo would compile for the first shape and again for the second
    varying = (0, *sorted({d for dims in (dynamic_dims or {}).values() for d in dims}))
    return Int8Model(zoo_compile(graph, freeze=True, dynamic_dims=varying), method)


def _torchao_int8(qmodel: nn.Module, method: str, embeddings: bool) -> nn.Module:
    if not _torchao():
        return _legacy_dynamic(qmodel, method)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    # torchao is the maintained int8 path for current torch (torch.ao.quantization is deprecated);
    # its kernels pay off under torch.compile at fixed shapes (BERT on an AMX CPU: 0.72x eager, 1.81x compiled;
    # on an AVX2 one 0.03-0.05x eager, 1.43x compiled for one 16 x 128 shape), but compiled for any length (batch and
    # length dynamic, as variable-length text needs) it ran at 0.04x fp32 eager on AVX2.
    config = Int8DynamicActivationInt8WeightConfig() if method == "int8_dynamic" else Int8WeightOnlyConfig()
    quantize_(qmodel, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    if embeddings and _has(qmodel, (nn.Embedding,)):
        quantize_(qmodel, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    qmodel.quantization = method
    return qmodel


def _legacy_dynamic(qmodel: nn.Module, method: str) -> nn.Module:
    # Without torchao: torch.ao's dynamic quantization (fbgemm kernels) for int8_dynamic only.
    if method != "int8_dynamic":
        require("torchao", method, "pip install torchao")
    qmodel = torch.ao.quantization.quantize_dynamic(qmodel, {nn.Linear}, dtype=torch.qint8)
    qmodel.quantization = method
    return qmodel


def _as_tuple(batch) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _pt2e(qmodel: nn.Module, batches: list[tuple], example_inputs: tuple | None,
          dynamic_dims: dict[int, tuple[int, ...]] | None, method: str, embeddings: bool,
          reduce_range: bool = False) -> nn.Module:
    from zoo.accel.export import export_program
    if not batches:
        raise ValueError("the calibration iterable is empty")
    example = tuple(example_inputs) if example_inputs is not None else batches[0]
    # PT2E with the x86 Inductor quantizer is the maintained graph path (FX graph mode is deprecated);
    # it lives in torchao for current torch and in torch.ao for older releases.
    try:
        from torchao.quantization.pt2e.observer import ObserverBase
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    except ImportError:
        from torch.ao.quantization.observer import ObserverBase
        from torch.ao.quantization.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torch.ao.quantization.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    config = get_default_x86_inductor_quantization_config(is_dynamic=method == "int8_dynamic",
                                                          reduce_range=reduce_range)
    if method == "int8_dynamic":
        # Linear layers only, as the method says: the global config also quantized RoBERTa's integer position
        # arithmetic (cumsum(mask) * mask), and the int8 graph failed at its first call (BERT's graph is the same)
        quantizer = X86InductorQuantizer().set_module_type_qconfig(nn.Linear, config)
    else:
        quantizer = X86InductorQuantizer().set_global(config)
    with torch.no_grad():
        exported = export_program(qmodel, example, dynamic_dims=dynamic_dims).module()
        prepared = prepare_pt2e(exported, quantizer)
        if method == "int8_static":  # and warns of a batch that alone sets a layer's range (zoo.accel.calibration)
            RangeWatch(prepared, ObserverBase).calibrate(batches)
        else:
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
