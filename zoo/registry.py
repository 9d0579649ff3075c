"""The model registry: name -> model class, config class and weight tags.

Each family registers its model class in its own module with `@register_model`.
`zoo.load` reaches the class in two steps: look the name up here, build `cls(config)`.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelEntry", "register_model", "get_entry", "list_models", "build_config"]


@dataclass(frozen=True)
class ModelEntry:
    name: str
    model_cls: type
    config_cls: type  # a frozen dataclass; its fields are the valid config overrides
    weights: dict[str, str]  # tag -> file name in weights/
    default_tag: str | None
    description: str
    aliases: dict[str, str] = field(default_factory=dict)  # e.g. "default" -> real tag

    @property
    def config_keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.config_cls)]


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(name: str, *, config: type, weights: dict[str, str] | None = None,
                   default: str | None = None, description: str = ""):
    """Class decorator: register `cls` (a `zoo.models.base.ZooModel` with the required hooks) under `name`,
    built as `cls(config_instance)`."""
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"config for {name!r} must be a dataclass, got {config!r}")
    weights = dict(weights or {})
    if default is not None and default not in weights:
        raise ValueError(f"default weights {default!r} of {name!r} is not one of {sorted(weights)}")

    def decorator(cls):
        from zoo.models.base import check_contract
        check_contract(cls)
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered (by {_REGISTRY[name].model_cls.__qualname__})")
        _REGISTRY[name] = ModelEntry(name, cls, config, weights, default,
                                     description or (cls.__doc__ or "").strip().split("\n")[0])
        cls.zoo_name = name
        return cls

    return decorator


def unregister_model(name: str) -> None:
    """Remove a registration (for tests and interactive sessions)."""
    _REGISTRY.pop(name, None)


def list_models() -> list[str]:
    _import_families()
    return sorted(_REGISTRY)


def get_entry(name: str) -> ModelEntry:
    _import_families()
    if not isinstance(name, str):
        raise TypeError(f"model name must be a string, got {type(name).__name__}")
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown model {name!r}.{hint} Available: {', '.join(sorted(_REGISTRY))}.")
    return _REGISTRY[name]


def entry_for_model(model) -> ModelEntry:
    """The registry entry of a model instance (unwrapping torch.compile and DDP)."""
    from zoo.models.base import ZooModel, unwrap
    model = unwrap(model)
    name = type(model).zoo_name if isinstance(model, ZooModel) else None
    if name is None or name not in _REGISTRY:
        raise ValueError(f"{type(model).__qualname__} is not a registered zoo model; "
                         "register it with @zoo.register_model")
    return _REGISTRY[name]


def build_config(entry: ModelEntry, base: dict[str, Any] | None = None, **overrides):
    """Config from a base dict (e.g. a checkpoint's) plus user overrides, validated by key."""
    valid = entry.config_keys
    for source, values in (("checkpoint config", base or {}), ("config override", overrides)):
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown {source} {', '.join(map(repr, unknown))} for {entry.name!r}; "
                             f"valid keys: {', '.join(valid)}")
    # JSON (checkpoint metadata) turns tuples into lists; frozen configs want tuples back.
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in {**(base or {}), **overrides}.items()}
    try:
        return entry.config_cls(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid config for {entry.name!r}: {e}") from None


_families_imported = False


def _import_families() -> None:
    # Families register on import; importing lazily keeps `import zoo.registry` cheap and cycle-free.
    global _families_imported
    if not _families_imported:
        _families_imported = True
        import zoo.models  # noqa: F401
