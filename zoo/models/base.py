"""The contract between a model family and the shared code (`zoo.load`, `zoo.save`, `zoo.accel`, `zoo.train`,
the CLI, the cards, the bench harness and the conformance battery in tests/test_families.py).

A family's model class subclasses `ZooModel` and is registered with `@register_model`, which refuses a
class that does not implement the required hooks. Shared code calls these hooks and nothing else on a
model: no `getattr(model, "<hook>", default)` probing, so a family cannot silently miss a capability.

Required (no default; registration fails without them):
    __init__(config)                 build from one frozen config dataclass, kept as `self.config`
    example_inputs(batch, ...)       a tuple of tensors that `forward` takes (tests, bench, export, compile)
    checkpoint_blocks                the repeated blocks, for activation checkpointing and FSDP sharding

Optional (the defaults below are right for a family that does not override them):
    head_prefixes                    state-dict key prefixes of the task head (re-initialised for a new
                                     num_classes, or when a foreign checkpoint has no head)
    variants                         named presets of the config (listed by `zoo info` and the cards)
    bench_batch                      the batch `zoo bench` uses by default
    convert_foreign(sd, folder)      map a state dict that is not zoo's own (no zoo metadata) to zoo keys
    adapt_state_dict(sd, source)     weights (zoo keys) adapted to this model's config before the strict load,
                                     where the family knows how (e.g. another number of input channels)
    depth_groups()                   the parts from the input up, the task head last, for layer-wise LR
                                     decay and progressive unfreezing (zoo/train/groups.py)
    example_loss(*example_inputs)    a scalar loss for one training step on example_inputs()
    reset_head(num_classes)          a new task head
    labels                           class names (from the weights' metadata, else "0".."n-1")
    export_graphs(batch, ...)        the graphs `zoo.accel.export` writes: what each traces, its inputs' names
                                     and dynamic dimensions (Dynamic) and its outputs' names (ExportGraph)

Set by zoo, not by the family: `zoo_name` (registration), `pretrained_meta` and `pretrained_source`
(`zoo.load`/`zoo.save`).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import types
import typing
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from torch import Tensor, nn

if TYPE_CHECKING:
    from pathlib import Path

    from zoo.weights import WeightsMeta

__all__ = ["ZooModel", "REQUIRED_HOOKS", "Dynamic", "BATCH", "ExportGraph", "check_contract", "check_config",
           "check_range", "unwrap"]

REQUIRED_HOOKS = ("example_inputs", "checkpoint_blocks")


@dataclasses.dataclass(frozen=True)
class Dynamic:
    """A dimension of an exported input that takes other sizes at run time than the traced one."""
    name: str  # the dimensions of one name, in any input, always have the same size ("batch", "seq")
    min: int = 1
    max: int | None = None  # None: unbounded
    multiple_of: int = 1  # e.g. a UNet's total stride


BATCH = Dynamic("batch")


@dataclasses.dataclass(frozen=True)
class ExportGraph:
    """One graph `zoo.accel.export` traces: `module(*inputs)`. Each input has a name and its dynamic dimensions
    ({dim: Dynamic}); the outputs have names."""
    module: nn.Module
    inputs: tuple[Tensor, ...]
    names: tuple[str, ...]
    dims: tuple[dict[int, Dynamic], ...]
    outputs: tuple[str, ...] = ("output",)

    def __post_init__(self):
        if not len(self.inputs) == len(self.names) == len(self.dims):
            raise ValueError(f"ExportGraph has {len(self.inputs)} inputs, {len(self.names)} names and "
                             f"{len(self.dims)} dimension specs; give one of each per input")


class ZooModel(nn.Module):
    """Base class of every registered family; see the module docstring for the contract."""

    zoo_name: ClassVar[str]  # set by @register_model
    head_prefixes: ClassVar[tuple[str, ...]] = ()
    variants: ClassVar[Mapping[str, Any]] = {}
    bench_batch: ClassVar[int] = 8

    config: Any
    pretrained_meta: WeightsMeta | None = None  # the metadata of the weights loaded or last saved
    # where those weights came from, {"sha256", "source", "parent"}: the `parent` that zoo.save writes
    pretrained_source: dict[str, Any] | None = None

    # ------------------------------------------------------------------ required

    def example_inputs(self, batch: int = 2) -> tuple[Tensor, ...]:
        """Inputs of `forward` for a batch of `batch` examples, deterministic (seeded), on the CPU."""
        raise NotImplementedError

    @property
    def checkpoint_blocks(self) -> list[nn.Module]:
        """The blocks `zoo.accel.checkpointing` wraps and FSDP shards one by one."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optional

    @classmethod
    def convert_foreign(cls, state_dict: dict[str, Tensor], folder: Path | None
                        ) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
        """A state dict without zoo metadata (another library's checkpoint) in zoo's keys, and the config
        values it implies (None: the caller's config). The default takes it as zoo's own layout."""
        return state_dict, None

    def adapt_state_dict(self, state_dict: dict[str, Tensor], source: str) -> dict[str, Tensor]:
        """`state_dict` (zoo keys, from `source`) made to fit this model where the config asked for something the
        weights were not made for and the family knows the standard adaptation (warning when it adapts). The
        default returns it unchanged: every mismatch stays an error of the strict load."""
        return state_dict

    def depth_groups(self) -> list[tuple[str, list[nn.Module]]]:
        """[(name, modules), ...] from the input up, the task head last; every parameter in one group. The
        default: no depth order (--layer-decay and --unfreeze are then refused)."""
        raise NotImplementedError(f"{type(self).__name__} has no depth groups: --layer-decay and --unfreeze "
                                  "need a family that lists them (bert_cls, effnetv2_cls)")

    def example_loss(self, *inputs: Tensor) -> Tensor:
        """A scalar loss of one training step on `example_inputs()`; the default is the mean output."""
        out = self(*inputs)
        out = out[0] if isinstance(out, (list, tuple)) else out
        return out.float().mean()

    def reset_head(self, num_classes: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no task head to replace")

    @property
    def labels(self) -> list[str]:
        """Class names from the loaded weights' metadata, else "0".."num_classes-1"."""
        meta = self.pretrained_meta
        if meta is not None and meta.labels:
            return list(meta.labels)
        return [str(i) for i in range(getattr(self.config, "num_classes", 0))]

    def export_graphs(self, batch: int = 2, **example) -> dict[str, ExportGraph]:
        """The graphs an export writes, by name ("model" first), traced at `batch` rows; `example` are
        example_inputs' other keyword arguments. The default, right for image models: one graph "model" of
        `example_inputs(batch, **example)`, named after forward's parameters, the batch (dim 0) dynamic in every
        input, one output "output"."""
        inputs = tuple(self.example_inputs(batch, **example))
        names = tuple(inspect.signature(self.forward).parameters)[:len(inputs)]
        return {"model": ExportGraph(self, inputs, names, tuple({0: BATCH} for _ in inputs))}


def check_contract(cls: type) -> None:
    """Raise TypeError naming what `cls` lacks to be registered as a zoo family."""
    if not (isinstance(cls, type) and issubclass(cls, ZooModel)):
        raise TypeError(f"{getattr(cls, '__qualname__', cls)!r} must subclass zoo.models.base.ZooModel "
                        "(the contract the shared code calls; see zoo/models/base.py)")
    missing = [hook for hook in REQUIRED_HOOKS if getattr(cls, hook) is getattr(ZooModel, hook)]
    if missing:
        raise TypeError(f"{cls.__qualname__} does not implement the required hook(s) {', '.join(missing)} "
                        "of zoo.models.base.ZooModel")
    if not isinstance(cls.head_prefixes, tuple):
        raise TypeError(f"{cls.__qualname__}.head_prefixes must be a tuple of key prefixes")


def unwrap(model: nn.Module) -> nn.Module:
    """The model under torch.compile's OptimizedModule and DDP's wrapper (FSDP2 wraps in place)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif "_orig_mod" in model._modules:
            model = model._modules["_orig_mod"]
        else:
            return model



# ------------------------------------------------------------------ config validation

_RANGE = re.compile(r"^\s*(?:(>=|>|<=|<)\s*(\S+)|([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])]))\s*$")


def check_config(config: Any, **ranges: str) -> None:
    """Raise ValueError unless every field of the dataclass `config` has its annotated type (an int field takes no
    bool, float or str; a float field takes an int; a tuple field a tuple of its item type; a Literal one of its
    values) and each field named in `ranges` is in its range, given as ">= 1", "> 0" or "[0, 1)" and applied to
    every item of a tuple. Lists become tuples (JSON gives lists). The message names the field, the value and what
    is allowed. Call it first in a config's __post_init__, before presets fill fields left as None."""
    hints = _config_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(config, f.name, value)
        kind = hints.get(f.name)
        if kind is not None and _describe(kind) is not None and not _is_a(value, kind):
            raise ValueError(f"{f.name} must be {_describe(kind)}, got {value!r} ({type(value).__name__})")
        if f.name in ranges and value is not None:
            check_range(f.name, value, ranges[f.name])
    unknown = set(ranges) - {f.name for f in dataclasses.fields(config)}
    if unknown:
        raise TypeError(f"check_config: {type(config).__name__} has no field(s) {', '.join(sorted(unknown))}")


@functools.lru_cache(maxsize=None)
def _config_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_a(value: Any, kind: Any) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, arg) for arg in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is_a(v, args[0]) for v in value)
        return len(args) == len(value) and all(_is_a(v, a) for v, a in zip(value, args))
    return isinstance(value, kind) if isinstance(kind, type) else True


def _describe(kind: Any) -> str | None:
    """What `kind` allows, in words; None for a type the check does not know (left unchecked)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    names = {type(None): "None", bool: "True or False", int: "an int", float: "a number", str: "a string"}
    if kind in names:
        return names[kind]
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(arg) for arg in args]
        return None if None in parts else " or ".join(parts)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _describe(args[0])
        return None if item is None else f"a tuple of {item.removeprefix('an ').removeprefix('a ')}s"
    return None


def check_range(name: str, value: Any, spec: str) -> None:
    """Raise ValueError naming `name` unless `value` (every item of a tuple) is in the range `spec` (">= 1",
    "> 0", "[0, 1)", ...)."""
    allowed, ok = _in_range(spec)
    items = value if isinstance(value, tuple) else (value,)
    if not all(ok(v) for v in items):
        what = f"every item of {name}" if isinstance(value, tuple) else name
        raise ValueError(f"{what} must be {allowed}, got {value!r}")


def _in_range(spec: str) -> tuple[str, Callable[[float], bool]]:
    m = _RANGE.match(spec)
    if m is None:
        raise TypeError(f"check_config: range {spec!r} is not '>= a', '> a', '<= a', '< a' or '[a, b)'")
    op, bound, left, low, high, right = m.groups()
    if op:
        b = float(bound)
        test = {">=": lambda v: v >= b, ">": lambda v: v > b, "<=": lambda v: v <= b, "<": lambda v: v < b}[op]
        return f"{op} {bound}", test
    lo, hi = float(low), float(high)
    return (f"in {left}{low}, {high}{right}",
            lambda v: (v >= lo if left == "[" else v > lo) and (v <= hi if right == "]" else v < hi))
