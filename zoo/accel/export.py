"""Export: ONNX (checked against onnxruntime) and torch.export, with a dynamic batch axis."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from zoo._deps import require
from zoo._io import atomic_path
from zoo.models.base import unwrap

log = logging.getLogger(__name__)

__all__ = ["export_onnx", "check_onnx", "export_program", "write_onnx"]


def _dynamic_shapes(example_inputs: tuple, dynamic_batch: bool, dynamic_dims: dict[int, tuple[int, ...]] | None):
    if not dynamic_batch and not dynamic_dims:
        return None
    from torch.export import Dim
    shapes = []
    for i, t in enumerate(example_inputs):
        spec = {}
        if isinstance(t, torch.Tensor):
            # AUTO: export infers the valid range (e.g. a sequence no longer than the RoPE table)
            if dynamic_batch:
                spec[0] = Dim.AUTO
            for d in (dynamic_dims or {}).get(i, {}):
                spec[d] = Dim.AUTO
        shapes.append(spec or None)
    return tuple(shapes)


def export_program(model: nn.Module, example_inputs: tuple, *, dynamic_batch: bool = True,
                   dynamic_dims: dict[int, tuple[int, ...]] | None = None,
                   dynamic_shapes: tuple | None = None) -> torch.export.ExportedProgram:
    """torch.export of the (uncompiled) model in eval mode; `dynamic_dims` e.g. {0: (1,)} makes dim 1 of
    input 0 (a sequence length) dynamic besides the batch, with ranges torch.export infers. `dynamic_shapes`,
    torch.export's own per-input spec (named `Dim`s with ranges), replaces both."""
    model = unwrap(model)
    model.eval()  # not `model = ....eval()`: a PT2E module's eval (allow_exported_model_train_eval) returns None
    example_inputs = tuple(example_inputs)
    if dynamic_shapes is not None:
        return torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
    if dynamic_batch:
        # torch.export specialises a size-1 dimension (0/1 specialisation): a batch-1 example would export a
        # fixed batch of 1 without a word; a batch of 2 (the first row repeated) traces the same graph
        example_inputs = tuple(t.expand(2, *t.shape[1:]).contiguous()
                               if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 1 else t
                               for t in example_inputs)
    return torch.export.export(model, example_inputs,
                               dynamic_shapes=_dynamic_shapes(example_inputs, dynamic_batch, dynamic_dims))


def export_onnx(model: nn.Module, example_inputs: tuple, path: str | os.PathLike, *, dynamic_batch: bool = True,
                dynamic_dims: dict[int, tuple[int, ...]] | None = None, opset: int | None = None,
                check: bool = True, atol: float = 1e-4) -> Path:
    """Write an ONNX file (atomically) through the torch.export-based exporter; with check=True run it in
    onnxruntime on the example and compare with the PyTorch output."""
    for module in ("onnx", "onnxscript"):
        require(module, "ONNX export", "pip install 'zoo[export]'")
    path = Path(path)
    example_inputs = tuple(example_inputs)
    program = export_program(model, example_inputs, dynamic_batch=dynamic_batch, dynamic_dims=dynamic_dims)
    write_onnx(program, path, opset=opset)
    if check:
        check_onnx(path, model, example_inputs, atol=atol)
    return path


def write_onnx(program: torch.export.ExportedProgram, path: str | os.PathLike, *, input_names=None,
               output_names=None, opset: int | None = None) -> Path:
    """The ONNX file of a torch.export program, written atomically, weights inside (no external data file)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        onnx_program = torch.onnx.export(program, program.example_inputs[0], dynamo=True, opset_version=opset,
                                         input_names=input_names, output_names=output_names,
                                         external_data=False, verbose=False)
        onnx_program.save(str(tmp))
    return path


def check_onnx(path: str | os.PathLike, model: nn.Module, inputs: tuple, *, atol: float = 1e-4,
               rtol: float = 1e-3) -> float:
    """Run the ONNX file in onnxruntime and compare with the model; returns the max abs difference."""
    ort = require("onnxruntime", "checking ONNX", "pip install 'zoo[export]'")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), inputs)}
    got = session.run(None, feeds)
    with torch.no_grad():
        want = unwrap(model).eval()(*inputs)
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    worst = 0.0
    for g, w in zip(got, want):
        g = torch.from_numpy(g)
        worst = max(worst, float((g - w.float()).abs().max()))
        if not torch.allclose(g, w.float(), atol=atol, rtol=rtol):
            raise RuntimeError(f"onnxruntime output differs from PyTorch by {worst:.3g} (atol {atol}) for {path}")
    return worst
