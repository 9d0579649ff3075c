"""A check of static int8's calibration batches: one batch far outside the others sets a layer's range for all.

Static int8 gives each activation one scale, from the largest magnitude its observer saw over all calibration
batches. One atypical batch (an input that drives a layer 100x past the others) stretches that range so far
that the usual values fall on a few int8 steps: the shipped CIFAR-10 EfficientNetV2 calibrated on 8 training
batches fell to chance this way, one image driving its head convolution to 5,290 where the median image gives
11 (bench/qat.py --calibration 8). The x86 quantizer's HistogramObserver does not clip such a value, so
`RangeWatch.calibrate` records each activation's largest magnitude per batch and warns, naming the batch and
the layers it stretched.
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["RangeWatch", "OUTLIER_RATIO"]

OUTLIER_RATIO = 10.0  # a batch's largest magnitude over the other batches' median that earns a warning


class RangeWatch:
    """Runs the calibration batches through a PT2E-prepared graph, recording per batch the largest magnitude
    entering each activation observer (weights are left out: they are the same every batch)."""

    def __init__(self, prepared: torch.fx.GraphModule, observer_type: type):
        self.prepared = prepared
        self.observers: dict[str, torch.nn.Module] = {}  # an observer shared by several values is watched once
        for node in prepared.graph.nodes:
            if node.op != "call_module" or not node.args or not isinstance(node.args[0], torch.fx.Node):
                continue
            module = prepared.get_submodule(node.target)
            if node.args[0].op == "get_attr" or not isinstance(module, observer_type):
                continue
            if all(module is not seen for seen in self.observers.values()):
                name = _describe(node.args[0])
                self.observers[name if name not in self.observers else f"{name} [{node.args[0].name}]"] = module
        self.per_batch: dict[str, list[float]] = {name: [] for name in self.observers}

    def calibrate(self, batches: list[tuple]) -> None:
        """Run every batch, then warn of a batch that stretched some layer's range (`warn_outliers`)."""
        peaks: dict[str, float] = {}

        def record(name):
            def hook(_, args):
                peaks[name] = max(peaks.get(name, 0.0), float(args[0].detach().abs().amax()))
            return hook
        handles = [module.register_forward_pre_hook(record(name)) for name, module in self.observers.items()]
        try:
            for batch in batches:
                peaks.clear()
                self.prepared(*batch)
                for name in self.per_batch:
                    self.per_batch[name].append(peaks.get(name, 0.0))
        finally:
            for handle in handles:
                handle.remove()
        self.warn_outliers()

    def outliers(self) -> dict[int, list[tuple[str, float, float]]]:
        """batch index -> (activation, its largest magnitude in that batch, the other batches' median) for each
        activation the batch drives past OUTLIER_RATIO x that median, the most stretched first."""
        found: dict[int, list[tuple[str, float, float]]] = {}
        for name, peaks in self.per_batch.items():
            for i, peak in enumerate(peaks):
                others = sorted(peaks[:i] + peaks[i + 1:])
                if not others:
                    continue
                median = others[len(others) // 2]
                if median > 0 and peak > OUTLIER_RATIO * median:
                    found.setdefault(i, []).append((name, peak, median))
        return {i: sorted(rows, key=lambda r: r[2] / r[1]) for i, rows in sorted(found.items())}

    def warn_outliers(self) -> None:
        outliers = self.outliers()
        if not outliers:
            return
        batches = len(next(iter(self.per_batch.values())))  # outliers: there is at least one activation
        lines = []
        for i, rows in outliers.items():  # the most stretched layer of each batch
            name, peak, median = rows[0]
            more = f" (and {len(rows) - 1} more layers)" if len(rows) > 1 else ""
            lines.append(f"batch {i} of {batches} drives {name} to {peak:.4g}, {peak / median:.0f}x the other "
                         f"batches' median {median:.3g}{more}")
        warnings.warn("int8_static calibration: " + "; ".join(lines) + ". Each activation gets one int8 range, "
                      "set by its largest value, so the typical values of these layers fall on a few int8 steps "
                      "and accuracy can collapse: leave such batches out of calibration= (check them for an "
                      "unusual input) or calibrate on more typical data.", stacklevel=5)


def _describe(node: torch.fx.Node) -> str:
    """The source layer of an observed value, by its module path ("blocks.15.conv (Conv2d)")."""
    if node.op == "placeholder":
        return f"the input {node.name!r}"
    stack = node.meta.get("nn_module_stack") or {}
    path, kind = next(reversed(stack.values()), ("", ""))
    if not path:
        return f"the value {node.name!r}"
    kind = kind.rsplit(".", 1)[-1] if isinstance(kind, str) else getattr(kind, "__name__", "")
    return f"{path} ({kind})" if kind else path
