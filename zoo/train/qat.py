"""Quantization-aware training (`--qat int8`): fine-tune through int8 fake quantization, ship fp32 weights.

The model is traced with torch.export as the task calls it on the first training batch, and PT2E's
`prepare_qat_pt2e` with the x86 Inductor quantizer inserts fake quantizers: per-channel symmetric int8
weights (convolutions with their BatchNorm folded as inference will fold it) and uint8 per-tensor
activations, static (ranges learnt as moving averages) for a model with convolutions, dynamic (each batch's
own range) for a Linear-only one. That is the int8 model `zoo.accel.quantize(model, "int8_static" /
"int8_dynamic", backend="pt2e")` and the aoti `--int8` export make of the saved weights, with the same
quantizer. torchao's own QAT (`torchao.quantization.qat`) was not chosen: it fake-quantizes nn.Linear and
nn.Embedding only, so it cannot train effnetv2_cls's convolutions.

The traced graph holds the model's own parameters and buffers (no copies): the optimiser, EMA, DDP and the
saved weights see the trained values, and the shipped file stays a plain fp32 zoo model (its metadata says
`extra.qat`). The fake quantizers' state (observed ranges, scales, zero points) is only in the checkpoints.

A traced graph cannot switch dropout or stochastic depth off for evaluation (zoo's own Dropout and DropPath
are not the aten ops torchao's train/eval rewrite knows), so it is traced with every module but BatchNorm
in eval mode: --qat fine-tunes without dropout and stochastic depth, and BatchNorm is the one layer that
changes between training and evaluation (two graphs over the same parameters, buffers and quantizers).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["FakeQuantized", "quantized_method", "first_call"]

_BATCH_NORMS = nn.modules.batchnorm._BatchNorm


def quantized_method(model: nn.Module) -> str:
    """The `zoo.accel.quantize` method whose int8 model `--qat int8` trains for: static activation ranges where
    there are convolutions (as for int8_static), dynamic ones for a Linear-only model."""
    convolutional = any(isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) for m in model.modules())
    return "int8_static" if convolutional else "int8_dynamic"


class _Called(Exception):
    pass


def first_call(loss: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> tuple[tuple, dict]:
    """The (args, kwargs) `loss(model, batch)` calls the model with: what --qat traces."""
    seen: dict[str, Any] = {}

    class Recorder(nn.Module):
        def forward(self, *args, **kwargs):
            seen.update(args=args, kwargs=kwargs)
            raise _Called

    try:
        loss(Recorder(), batch)
    except _Called:
        return seen["args"], seen["kwargs"]
    raise ValueError("the task's loss never called the model, so --qat has no call to trace; call `model(...)` "
                     "in Task.loss")


class FakeQuantized(nn.Module):
    """The model's fake-quantized graph, as training and evaluation run it. Its state dict is the graph's:
    the model's parameters and buffers under "graph.", and the fake quantizers' state."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.method = quantized_method(model)
        self.graph = _prepare(model, args, kwargs, dynamic=self.method == "int8_dynamic")
        # the same graph with BatchNorm in inference mode; not registered: it holds nothing of its own
        evaluation = torch.fx.GraphModule(self.graph, _with_inference_batch_norm(self.graph.graph))
        self.__dict__["_evaluation"] = evaluation
        self._quantizers = [m for m in self.graph.modules() if hasattr(m, "observer_enabled")]
        # per-channel quantizers size their scales in their first call, and a checkpoint loads into tensors
        # of the final shapes: observe the first batch once now, as training does (the ranges of activations
        # under batch statistics, not running ones: starting from those cost 0.5 of loss on CIFAR), and put
        # the BatchNorm statistics that pass moved back
        self.train()
        statistics = {name: b.clone() for name, b in model.named_buffers()}
        with torch.no_grad():
            self.graph(*args, **kwargs)
            for name, b in model.named_buffers():
                b.copy_(statistics[name])
        model.eval()  # only the graph runs from here; the model's own forward, called aside, is inference

    def forward(self, *args, **kwargs):
        return (self.graph if self.training else self._evaluation)(*args, **kwargs)

    def train(self, mode: bool = True) -> FakeQuantized:
        # not nn.Module.train: PT2E graph modules refuse train()/eval(); the mode picks the graph. Evaluation
        # leaves the learnt ranges alone; dynamic quantizers take each batch's range, in evaluation too.
        self.training = mode
        for q in self._quantizers:
            q.enable_observer(mode or getattr(q, "is_dynamic", False))
        return self


def _prepare(model: nn.Module, args: tuple, kwargs: dict, *, dynamic: bool) -> torch.fx.GraphModule:
    try:
        from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    except ImportError:  # torch.ao for older torchao releases, as zoo.accel.quantize does
        from torch.ao.quantization.quantize_pt2e import prepare_qat_pt2e
        from torch.ao.quantization.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    modes = {m: m.training for m in model.modules()}
    model.train()  # the family's own train(): e.g. a frozen backbone's BatchNorm stays in inference mode
    for m in model.modules():
        if not isinstance(m, _BATCH_NORMS):
            m.training = False  # dropout and stochastic depth off: see the module docstring
    try:
        program = torch.export.export(model, args, kwargs, dynamic_shapes=_any_size(model, args, kwargs))
    except Exception as e:  # noqa: BLE001 - torch.export's reasons are many; the first line names it
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--qat traces {type(model).__name__} with torch.export, which failed: {first[:300]}; "
                         "train without --qat and quantize after training (zoo.accel.quantize)") from e
    finally:
        for m, training in modes.items():
            m.training = training
    config = get_default_x86_inductor_quantization_config(is_qat=True, is_dynamic=dynamic)
    return prepare_qat_pt2e(program.module(), X86InductorQuantizer().set_global(config))


def _any_size(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every dimension of every tensor input may take other sizes (torch.export keeps those the model fixes):
    evaluation batches, a last partial batch and other sequence lengths run the same graph."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {name: tree_map(lambda v: {d: torch.export.Dim.AUTO for d in range(v.dim())}
                           if isinstance(v, torch.Tensor) else None, value) for name, value in bound.items()}


def _with_inference_batch_norm(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of `graph` whose batch norms use their running statistics (aten.batch_norm's `training` False)
    and leave their counters alone (the traced graph adds 1 to each `num_batches_tracked` in a node of its own)."""
    import copy
    graph = copy.deepcopy(graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == torch.ops.aten.batch_norm.default and node.args[5]:
            node.args = (*node.args[:5], False, *node.args[6:])
        elif (node.target == torch.ops.aten.add_.Tensor and node.args[0].op == "get_attr"
              and node.args[0].target.endswith("num_batches_tracked") and not node.users):
            graph.erase_node(node)
    return graph
