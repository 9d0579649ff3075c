"""`zoo.accel.export`: a deployable file of any zoo model in one call, described and verified.

    zoo.accel.export(model, format="onnx", out="exports/bert")   # or "aoti", "pt2", "pte"

writes `out/model.<ext>` (the LM adds `decode.<ext>`, a KV-cache step) and `out/zoo_export.json`: the format,
the files, every graph's inputs and outputs (names, dtypes, shapes with the dynamic dimensions named and
bounded), the weights' preprocessing, labels and sha256, and the library versions. Each graph is then run
from the written file (zoo.accel.artifacts, which needs no zoo) at another shape than the traced one (batch + 1,
every other dynamic size one step longer, or shorter at its maximum) and compared with the eager model; the
export fails unless the largest error is within `tolerance` of the output's magnitude. All of it is written
in a temporary folder beside `out` and renamed at the end, so a failed export leaves nothing behind.

`int8=True` (onnx and aoti; zoo.accel.deploy_int8 says how and why) writes an int8 file instead, verified against
the int8 model it was made from (the PT2E module in torch for aoti; the quantized ONNX graph run op by op for
onnx, whose fp32 file is first verified against eager as above) within deploy_int8.TOLERANCE; its error against
the fp32 eager model is recorded beside (`verified.vs_fp32`), as is the quantization (`int8`).

Formats: "onnx" (the dynamo exporter, run in onnxruntime), "aoti" (AOTInductor: a compiled .pt2 package that
`torch._inductor.aoti_load_package` loads, and C++ through AOTIModelPackageLoader), "pt2" (`torch.export.save`
of the ExportedProgram) and "pte" (ExecuTorch with the XNNPACK delegate, for mobile and edge; the [mobile]
extra). TorchScript is deprecated upstream and not offered: "aoti" is its successor.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from zoo._deps import require
from zoo.accel import artifacts, deploy_int8
from zoo.accel.export import export_program, write_onnx
from zoo.models.base import Dynamic, ExportGraph, ZooModel, unwrap

log = logging.getLogger(__name__)

__all__ = ["export", "Exported", "FORMATS", "TOLERANCE"]

TOLERANCE = 1e-3  # an fp32 artifact's largest error against eager, relative to the output's magnitude


@dataclasses.dataclass(frozen=True)
class Format:
    suffix: str
    step: str  # what the progress bar says while the file is written
    write: Callable[[torch.export.ExportedProgram, Path, ExportGraph], None]
    needs: tuple[str, str] = ("torch", "")  # a module the format imports, and how to install it
    bounded: bool = False  # the runtime plans memory for the largest shape: every dynamic size needs a maximum


def _write_onnx(program, path: Path, graph: ExportGraph) -> None:
    write_onnx(program, path, input_names=list(graph.names), output_names=list(graph.outputs))


def _write_pt2(program, path: Path, graph: ExportGraph) -> None:
    torch.export.save(program, path)


def _write_aoti(program, path: Path, graph: ExportGraph, *, freezing: bool = False) -> None:
    import torch._inductor
    # freezing: the weights become constants, which Inductor's int8 fusions (oneDNN kernels) need; Inductor
    # freezes only a graph compiled without autograd
    with torch.no_grad() if freezing else contextlib.nullcontext():
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs={"freezing": True} if freezing else None)


def _write_pte(program, path: Path, graph: ExportGraph) -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    path.write_bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)


FORMATS: dict[str, Format] = {
    "onnx": Format(".onnx", "converting to ONNX", _write_onnx, ("onnxscript", "pip install 'zoo[export]'")),
    "aoti": Format(".aoti.pt2", "compiling with AOTInductor (minutes on a few cores)", _write_aoti),
    "pt2": Format(".pt2", "saving the ExportedProgram", _write_pt2),
    "pte": Format(".pte", "lowering to ExecuTorch (XNNPACK)", _write_pte,
                  ("executorch", "pip install 'zoo[mobile]' (the executorch package)"), bounded=True),
}


@dataclasses.dataclass(frozen=True)
class Exported:
    """What `export` wrote: the folder, the manifest (as written), and the verification's worst errors."""
    folder: Path
    manifest: dict
    max_abs_error: float  # against the eager model (the int8 one for an int8 export)
    max_rel_error: float

    @property
    def max_rel_error_vs_fp32(self) -> float:
        """An int8 export's largest error against the fp32 eager model (the fp32 one's own error otherwise)."""
        return self.manifest["verified"].get("vs_fp32", self.manifest["verified"])["max_rel_error"]

    @property
    def files(self) -> list[Path]:
        return [self.folder / g["file"] for g in self.manifest["graphs"].values()]

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def export(model: nn.Module, format: str = "onnx", out: str | os.PathLike = "export", *, batch: int = 2,
           dynamic: list[str] | tuple[str, ...] | None = None, example: dict | None = None, int8: bool = False,
           calibration: Iterable | None = None, tolerance: float | None = None, progress: bool = True) -> Exported:
    """Export `model` (any zoo model) to `out` in `format`, verified against eager; see the module docstring.

    batch: the rows traced (a dynamic batch is traced at 2 or more: torch.export specialises a size of 1).
    dynamic: the names of the dimensions that stay dynamic ("batch", "seq", ...; the family's export_graphs
        lists them); None: all of them; () or ["none"]: every shape fixed at the traced one.
    example: example_inputs' other keyword arguments (e.g. {"size": 64}).
    int8: an int8 file (onnx, aoti): dynamic int8 for Linear-only models, static for convolutional ones.
    calibration: static int8's calibration batches, input tuples of the first graph (default: the model's
        example inputs, seeded noise; see zoo.accel.deploy_int8).
    tolerance: the largest error allowed, relative to the largest output magnitude of each output (default
        1e-3; int8: deploy_int8.TOLERANCE, by method, against the int8 model).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose {', '.join(FORMATS)} (TorchScript is "
                         "deprecated upstream: aoti replaces it)")
    if int8:
        deploy_int8.check_format(format)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    fmt = FORMATS[format]
    require(fmt.needs[0], f"format {format}", fmt.needs[1])
    model = unwrap(model)
    if not isinstance(model, ZooModel):
        raise TypeError(f"zoo.accel.export takes a zoo model (its export_graphs say what to trace), not a "
                        f"{type(model).__name__}; export another module with zoo.accel.export_onnx / export_program")
    plan = deploy_int8.plan(model, format, calibration) if int8 else None
    if tolerance is None:
        tolerance = plan.tolerance if plan else TOLERANCE
    was_training = model.training
    out = Path(out)
    staging, made = _staging_folder(out)
    try:
        model.eval()
        with _Progress(progress) as bar:
            graphs = model.export_graphs(batch, **(example or {}))
            keep = _kept_dims(graphs, dynamic, type(model).__name__)
            if "batch" in keep and batch < 2:
                graphs = model.export_graphs(2, **(example or {}))
            graphs = {name: _bounded(g, keep) if fmt.bounded else g for name, g in graphs.items()}
            bar.total = (3 if plan else 2) * len(graphs) + 1 + (plan is not None and format == "onnx")
            manifest = _manifest(model, format, graphs, keep)
            batches = (deploy_int8.calibration_batches(model, graphs, batch, example or {}, calibration)
                       if plan and plan.static else {})
            references, fp32_files = {}, {}  # int8: the int8 eager model of each graph; onnx: the fp32 files
            for name, graph in graphs.items():
                traced, file = graph, staging / manifest["graphs"][name]["file"]
                if plan and format == "aoti":
                    with bar.step(f"quantizing {name!r} to int8 (PT2E)"):
                        traced = deploy_int8.quantize_graph(graph, plan, keep, batches.get(name, []))
                    references[name] = traced.module
                with bar.step(f"tracing {name!r} with torch.export"):
                    program = _trace(traced, keep)
                with bar.step(fmt.step):
                    if plan and format == "onnx":
                        fp32_files[name] = file.with_name(f"{name}.fp32{fmt.suffix}")
                        fmt.write(program, fp32_files[name], graph)
                    elif plan:
                        _write_aoti(program, file, graph, freezing=plan.freeze)
                    else:
                        fmt.write(program, file, graph)
                if fp32_files:
                    with bar.step(f"quantizing {name!r} to int8 (onnxruntime)"):
                        deploy_int8.quantize_onnx(fp32_files[name], file, plan, graph.names, batches.get(name, []))
                    references[name] = deploy_int8.onnx_reference(file, list(graph.names))
                manifest["graphs"][name]["outputs"] = _outputs(program, graph, keep)
            if plan:
                manifest["int8"] = plan.describe()
            _write_json(staging / artifacts.MANIFEST, manifest)
            if fp32_files:  # the fp32 file against eager first: the int8 reference is made from it
                with bar.step("verifying the fp32 ONNX against eager at another shape"):
                    runners = {name: artifacts.OPENERS["onnx"](path, list(graphs[name].names))
                               for name, path in fp32_files.items()}
                    fp32_verified = _verify(model, graphs, keep, runners, example, TOLERANCE)
                manifest["fp32_size_bytes"] = sum(path.stat().st_size for path in fp32_files.values())
                for path in fp32_files.values():
                    path.unlink()
            with bar.step("verifying against eager at another shape"):
                verified = _verify(model, graphs, keep, artifacts.load(staging), example, tolerance,
                                   references or None)
            if fp32_files:
                verified["fp32_onnx"] = fp32_verified
            manifest["verified"] = verified
            manifest["size_bytes"] = sum((staging / g["file"]).stat().st_size for g in manifest["graphs"].values())
            _write_json(staging / artifacts.MANIFEST, manifest)
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove(made)
        raise
    finally:
        model.train(was_training)
    return Exported(out, manifest, verified["max_abs_error"], verified["max_rel_error"])


# ------------------------------------------------------------------ dynamic dimensions


def _kept_dims(graphs: dict[str, ExportGraph], dynamic, model_name: str) -> set[str]:
    offered = {d.name for g in graphs.values() for dims in g.dims for d in dims.values()}
    if dynamic is None:
        return offered
    wanted = {name.strip() for name in dynamic if name.strip() and name.strip() != "none"}
    unknown = sorted(wanted - offered)
    if unknown:
        raise ValueError(f"{model_name} has no dynamic dimension {', '.join(map(repr, unknown))}; its exports "
                         f"offer {', '.join(sorted(offered)) or 'none'} (or 'none' for fixed shapes)")
    return wanted


def _bounded(graph: ExportGraph, keep: set[str]) -> ExportGraph:
    """`graph` with each unbounded dynamic size bounded at its traced size (ExecuTorch plans memory for the
    largest shape: trace at the largest you need)."""
    dims = tuple({d: (dyn if dyn.max is not None or dyn.name not in keep else
                      Dynamic(dyn.name, dyn.min, t.shape[d], dyn.multiple_of)) for d, dyn in dims.items()}
                 for t, dims in zip(graph.inputs, graph.dims))
    return ExportGraph(graph.module, graph.inputs, graph.names, dims, graph.outputs)


def _torch_dims(graph: ExportGraph, keep: set[str]) -> tuple:
    """torch.export's dynamic_shapes: one named Dim per dimension name (so equal names are equal sizes), a
    multiple of k as k * Dim."""
    from torch.export import Dim
    made: dict[str, object] = {}

    def dim(dyn: Dynamic):
        if dyn.name not in made:
            k = dyn.multiple_of
            bounds = {"min": -(-dyn.min // k)} | ({"max": dyn.max // k} if dyn.max is not None else {})
            made[dyn.name] = Dim(dyn.name, **bounds) if k == 1 else k * Dim(f"{dyn.name}_over_{k}", **bounds)
        return made[dyn.name]
    return tuple({d: dim(dyn) for d, dyn in dims.items() if dyn.name in keep} or None for dims in graph.dims)


def _trace(graph: ExportGraph, keep: set[str]) -> torch.export.ExportedProgram:
    from torch._dynamo.exc import Unsupported, UserError
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError, GuardOnDataDependentSymNode
    name = type(graph.module).__name__
    # contiguous, as every runtime feeds inputs: AOTInductor compiles for the example's strides, and a sliced
    # example (a view with the strides of its base) made it read the runtime's inputs out of bounds
    inputs = tuple(t.contiguous() for t in graph.inputs)
    try:
        return export_program(graph.module, inputs, dynamic_shapes=_torch_dims(graph, keep))
    except GuardOnDataDependentSymNode as e:
        where = re.search(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)', str(e))
        at = f" at {Path(where[1]).name}:{where[2]} (`{where[4].strip()}`)" if where else ""
        raise RuntimeError(f"cannot export {name}: its forward branches on a tensor's value{at}, which "
                           "torch.export cannot trace; compute both sides (torch.where) or use torch.cond") from None
    except (UserError, ConstraintViolationError, Unsupported) as e:
        lines = [line.strip(" -") for line in str(e).strip().splitlines() if line.strip()]
        raise RuntimeError(f"cannot export {name} with torch.export: {'; '.join(lines[:2])}") from None


# ------------------------------------------------------------------ the manifest


def _manifest(model: nn.Module, format: str, graphs: dict[str, ExportGraph], keep: set[str]) -> dict:
    suffix = FORMATS[format].suffix
    meta = model.pretrained_meta
    source = model.pretrained_source or {}
    return {
        "format": format,
        "file": f"{next(iter(graphs))}{suffix}",
        "model": getattr(model, "zoo_name", type(model).__name__),
        "graphs": {name: {"file": f"{name}{suffix}", "inputs": _inputs(g, keep), "dims": _dims(g, keep)}
                   for name, g in graphs.items()},
        "preprocessing": meta.preprocessing if meta else {},
        "labels": model.labels,
        "config": dataclasses.asdict(model.config),
        "weights": {"sha256": source.get("sha256"), "source": source.get("source")},
        "versions": _versions(format),
    }


def _inputs(graph: ExportGraph, keep: set[str]) -> list[dict]:
    return [{"name": name, "dtype": _dtype(t),
             "shape": [dims[d].name if d in dims and dims[d].name in keep else size for d, size in enumerate(t.shape)]}
            for name, t, dims in zip(graph.names, graph.inputs, graph.dims)]


def _dims(graph: ExportGraph, keep: set[str]) -> dict[str, dict]:
    return {dyn.name: {"min": dyn.min, "max": dyn.max, "multiple_of": dyn.multiple_of}
            for dims in graph.dims for dyn in dims.values() if dyn.name in keep}


def _outputs(program: torch.export.ExportedProgram, graph: ExportGraph, keep: set[str]) -> list[dict]:
    """Output names, dtypes and shapes; a dynamic size is written in the names of the input dimensions
    ("seq", "past + 1")."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    whole, symbols = {}, {}  # torch.export's size expressions ("s12", "8*s3") -> names
    for node_name, dims in zip(program.graph_signature.user_inputs, graph.dims):
        shape = placeholders[node_name].meta["val"].shape
        for d, dyn in dims.items():
            if dyn.name in keep:
                whole[str(shape[d])] = dyn.name
                for symbol in re.findall(r"\bs\d+\b", str(shape[d])):
                    symbols[symbol] = dyn.name if dyn.multiple_of == 1 else f"({dyn.name}/{dyn.multiple_of})"

    def size(s) -> int | str:
        if isinstance(s, int):
            return s
        return whole.get(str(s)) or re.sub(r"\bs\d+\b", lambda m: symbols.get(m[0], m[0]), str(s))
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    values = [n.meta["val"] for n in out_node.args[0]][-len(program.graph_signature.user_outputs):]
    return [{"name": name, "dtype": _dtype(v), "shape": [size(s) for s in v.shape]}
            for name, v in zip(graph.outputs, values)]


def _dtype(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _versions(format: str) -> dict[str, str | None]:
    packages = ["torch", "zoo", *{"onnx": ["onnx", "onnxruntime"], "pte": ["executorch"]}.get(format, [])]
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# ------------------------------------------------------------------ verification


def _verify(model, graphs: dict[str, ExportGraph], keep: set[str], runners: dict[str, artifacts.Runner], example,
            tolerance: float, references: dict[str, Callable] | None = None) -> dict:
    """Run every written graph (`runners`) at other sizes of its dynamic dimensions than traced and compare with
    eager: the graph's module, or with `references` (an int8 export: the int8 eager model of each graph), then
    the fp32 module's error is recorded beside, unchecked (`vs_fp32`)."""
    traced = {name: _sizes(g) for name, g in graphs.items()}
    dims = {dyn.name: dyn for g in graphs.values() for d in g.dims for dyn in d.values() if dyn.name in keep}
    sizes = {name: {n: _other_size(s, dims[n]) for n, s in traced_sizes.items() if n in keep}
             for name, traced_sizes in traced.items()}
    batch = next((s["batch"] for s in sizes.values() if "batch" in s), None)
    fresh = model.export_graphs(batch, **(example or {})) if batch is not None else graphs
    report, worst, worst_fp32 = {}, [0.0, 0.0], [0.0, 0.0]
    for name, graph in graphs.items():
        inputs = tuple(_resize(t, dims_of, sizes[name]) for t, dims_of in zip(fresh[name].inputs, graph.dims))
        fp32 = _outputs_of(graph.module, inputs)
        want = fp32 if references is None else _outputs_of(references[name], inputs)
        try:
            got = [torch.from_numpy(g) for g in runners[name](*(t.numpy() for t in inputs))]
        except Exception as e:  # the runtime refused the graph (an operator it has no kernel for, ...)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RuntimeError(f"the exported {name!r} does not run at inputs {_shapes(inputs)}: {reason} (the "
                               "runtime's own log above says more)") from None
        errors = {}
        for out_name, g, w, f in zip(graph.outputs, got, want, fp32):
            if g.shape != w.shape:
                raise RuntimeError(f"the exported {name!r} gives {out_name} of shape {tuple(g.shape)} for inputs "
                                   f"{_shapes(inputs)}; eager gives {tuple(w.shape)}")
            errors[out_name] = _errors(g, w, worst)
            if references is not None:
                errors[out_name]["vs_fp32"] = _errors(g, f, worst_fp32)
            if not errors[out_name]["max_rel_error"] <= tolerance:
                against = "the int8 eager model" if references is not None else "eager"
                raise RuntimeError(f"the exported {name!r} differs from {against} in {out_name} by "
                                   f"{errors[out_name]['max_abs_error']:.3g} ({errors[out_name]['max_rel_error']:.3g} "
                                   f"of its largest magnitude, above the tolerance {tolerance:g}) at inputs "
                                   f"{_shapes(inputs)}")
        report[name] = {"inputs": dict(zip(graph.names, _shapes(inputs))), "outputs": errors}
    verified = {"graphs": report, "max_abs_error": worst[0], "max_rel_error": worst[1], "tolerance": tolerance}
    if references is not None:
        verified["reference"] = "int8 eager"
        verified["vs_fp32"] = {"max_abs_error": worst_fp32[0], "max_rel_error": worst_fp32[1]}
    return verified


def _outputs_of(module: Callable, inputs: tuple[Tensor, ...]) -> list[Tensor]:
    with torch.no_grad():
        out = module(*inputs)
    return [out] if isinstance(out, Tensor) else list(out)


def _errors(got: Tensor, want: Tensor, worst: list[float]) -> dict[str, float]:
    """The largest absolute error and its share of the largest magnitude of `want`; `worst` keeps the maxima."""
    abs_error = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    rel_error = abs_error / max(float(want.float().abs().max()) if want.numel() else 0.0, 1e-12)
    worst[:] = max(worst[0], abs_error), max(worst[1], rel_error)
    return {"max_abs_error": abs_error, "max_rel_error": rel_error}


def _sizes(graph: ExportGraph) -> dict[str, int]:
    return {dyn.name: t.shape[d] for t, dims in zip(graph.inputs, graph.dims) for d, dyn in dims.items()}


def _other_size(size: int, dyn: Dynamic) -> int:
    """One step (multiple_of) larger than traced where the range allows, else one smaller."""
    step = dyn.multiple_of
    if dyn.max is None or size + step <= dyn.max:
        return size + step
    return size - step if size - step >= dyn.min else size


def _resize(t: Tensor, dims: dict[int, Dynamic], sizes: dict[str, int]) -> Tensor:
    """`t` cut or repeated (cyclically) along each dynamic dimension to the size `sizes` gives its name."""
    for d, dyn in dims.items():
        if dyn.name in sizes and t.shape[d] != sizes[dyn.name]:
            t = t.index_select(d, torch.arange(sizes[dyn.name]) % t.shape[d])
    return t.contiguous()


def _shapes(inputs) -> list[list[int]]:
    return [list(t.shape) for t in inputs]


# ------------------------------------------------------------------ files and folders


def _staging_folder(out: Path) -> tuple[Path, list[Path]]:
    """A new temporary folder beside `out` (checked writable before anything runs), and the parent folders
    created for it."""
    if out.is_file():
        raise NotADirectoryError(f"-o {out} is a file; give a folder for the export")
    if out.is_dir() and any(out.iterdir()) and not (out / artifacts.MANIFEST).is_file():
        raise ValueError(f"-o {out} holds files that are not an export; give a new or empty folder (a "
                              "previous export there is replaced)")
    ancestors = list(out.absolute().parents)
    existing = next(p for p in ancestors if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"-o {out}: {existing} is a file, not a folder; give a folder for the export")
    made = [p for p in reversed(ancestors) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes 0700; the export should get a folder's usual permissions
        return staging, made
    except OSError as e:
        _remove(made)
        raise PermissionError(f"-o {out}: cannot write in {out.parent} ({e.strerror}); give a folder you can "
                              "write to") from None


def _remove(folders: list[Path]) -> None:
    """Remove the (empty) folders an export created for its output, innermost first."""
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished folder to `out`; a previous export there is moved aside first, then deleted."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class _Progress:
    """A step-by-step tqdm bar (on a terminal only) whose elapsed time keeps moving during a long step."""

    def __init__(self, enabled: bool):
        from tqdm import tqdm
        self.bar = tqdm(total=1, desc="zoo export", unit="step", disable=None if enabled else True, leave=False,
                        bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}]")

    @property
    def total(self) -> int:
        return self.bar.total

    @total.setter
    def total(self, value: int) -> None:
        self.bar.total = value

    @contextlib.contextmanager
    def step(self, text: str):
        self.bar.set_description_str(f"zoo export: {text}")
        done = threading.Event()

        def tick():  # tqdm redraws only on updates; an AOTInductor compile is one update minutes long
            while not done.wait(1.0):
                self.bar.refresh()
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
        self.bar.update(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()
