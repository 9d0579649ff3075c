"""zoo: a reference model zoo for PyTorch.

    import zoo
    zoo.list_models()
    model = zoo.load("effnetv2_cls", pretrained=True)
    model = zoo.load("bert_cls", pretrained="hf://owner/repo")
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from zoo.registry import build_config, get_entry, list_models, register_model
from zoo.weights import (WeightsError, WeightsMeta, load_state_dict_into, push_to_hub, read_weights,
                         resolve_weights, save, save_pretrained)
from zoo.weights.external import external_tags

__version__ = "0.1.0"
__all__ = ["load", "list_models", "info", "save", "save_pretrained", "push_to_hub", "register_model",
           "WeightsMeta", "WeightsError", "accel"]


def load(name: str, pretrained: bool | str | os.PathLike = False, **config_overrides: Any):
    """Build a registry model, optionally with weights; returned in eval mode.

    pretrained: False (random init), True or "default", a weights tag, a path to a
    .safetensors/.pt/.bin file or a folder, or "hf://owner/repo[/file][@revision]".
    config_overrides: fields of the model's config, e.g. num_classes=5. When num_classes
    differs from the weights', the head is re-initialised and a warning names its keys.
    """
    entry = get_entry(name)
    if pretrained is False or pretrained is None:
        return entry.model_cls(build_config(entry, **config_overrides)).eval()
    cls = entry.model_cls
    external = external_tags(name)
    if isinstance(pretrained, str) and pretrained in external:
        # weights from another library's own API (e.g. torchvision's ImageNet weights), converted by the family
        model = cls(build_config(entry, **config_overrides))
        state_dict, meta = external[pretrained](model.config)
        state_dict = model.adapt_state_dict(state_dict, pretrained)
        # a num_classes of the caller's gets a new head (the weights' own, e.g. ImageNet's 1000, still loads)
        load_state_dict_into(model, state_dict, source=pretrained, reinit_head="num_classes" in config_overrides)
        model.pretrained_meta = meta
        return model.eval()
    weights = resolve_weights(entry, pretrained)
    meta, state_dict, base_config = weights.meta, weights.state_dict, None
    if meta is not None:
        if meta.model != entry.name:
            raise WeightsError(f"weights {weights.source} are for {meta.model!r}, not {entry.name!r}; "
                               f"load them with zoo.load({meta.model!r}, ...)")
        base_config = meta.config
    else:
        # e.g. a Hugging Face BERT folder: the family maps its keys and reads its config.json
        state_dict, base_config = cls.convert_foreign(state_dict, weights.folder)
    head_prefixes = cls.head_prefixes
    new_head = (("num_classes" in config_overrides
                 and (base_config or {}).get("num_classes") != config_overrides["num_classes"])
                # a backbone-only checkpoint (e.g. Hugging Face BertModel) gets a fresh head
                or (meta is None and bool(head_prefixes) and not any(k.startswith(head_prefixes) for k in state_dict)))
    model = cls(build_config(entry, base_config, **config_overrides))
    state_dict = model.adapt_state_dict(state_dict, weights.source)
    load_state_dict_into(model, state_dict, source=weights.source, reinit_head=new_head)
    if meta is not None and new_head:
        # the labels and metrics described the old head
        meta = dataclasses.replace(meta, labels=None, metrics={}, config=dataclasses.asdict(model.config))
    model.pretrained_meta = meta
    model.pretrained_source = weights.as_parent()  # so that zoo.save can name its parent
    return model.eval()


def info(name: str) -> dict[str, Any]:
    """What the registry knows of a model: description, config, parameter count, variants and weights."""
    from zoo.cards import model_info
    return model_info(name)


def __getattr__(attr):
    # `zoo.accel` imports torch._dynamo and friends; load it on first use only.
    if attr == "accel":
        import importlib
        return importlib.import_module("zoo.accel")
    raise AttributeError(f"module 'zoo' has no attribute {attr!r}")
