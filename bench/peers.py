"""The peer library's model for each family, with the zoo model's weights, for the bench tables
(`zoo bench NAME`, bench/gpu.py, bench/bert_train.py). Each builder takes the zoo model and returns
(label, peer model) or None where no peer has that configuration; the peer takes the zoo model's
example_inputs().
"""
from __future__ import annotations

from torch import nn


def bert_cls(model) -> tuple[str, nn.Module] | None:
    """transformers' own {Bert,Roberta,DistilBert}ForSequenceClassification of the model's arch, built from
    `to_hf_config` and loaded strictly with `to_hf_state_dict`, so both sides are the same model; it takes the
    same (input_ids, attention_mask). transformers has no mean pooling: no peer for pooling="mean"."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from zoo.models.bert import to_hf_config, to_hf_state_dict
    if model.config.pooling != "cls":
        return None
    hf = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**to_hf_config(model.config)))
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    return "transformers", hf.eval()


def effnetv2_cls(model) -> tuple[str, nn.Module] | None:
    """torchvision's EfficientNetV2 of the same variant (torchvision has s/m/l only)."""
    if model.config.variant not in ("s", "m", "l"):
        return None
    import torchvision

    from zoo.models.effnetv2 import to_torchvision
    tv = getattr(torchvision.models, f"efficientnet_v2_{model.config.variant}")(num_classes=model.config.num_classes)
    tv.load_state_dict(to_torchvision(model))
    return "torchvision", tv.eval()


PEERS = {fn.__name__: fn for fn in (bert_cls, effnetv2_cls)}
