"""The peer library's model for each family, with the zoo model's weights, for the bench tables
(`zoo bench NAME`, bench/gpu.py, bench/bert_train.py). Each builder takes the zoo model and returns
(label, peer model) or None where no peer has that configuration; the peer takes the zoo model's
example_inputs().
"""
from __future__ import annotations

from torch import nn


def bert_cls(model) -> tuple[str, nn.Module]:
    """transformers' BertForSequenceClassification; it takes the same (input_ids, attention_mask)."""
    from transformers import BertConfig, BertForSequenceClassification

    from zoo.models.bert import to_hf_state_dict
    c = model.config
    hf = BertForSequenceClassification(BertConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden, num_hidden_layers=c.layers, num_attention_heads=c.heads,
        intermediate_size=c.intermediate, max_position_embeddings=c.max_positions,
        type_vocab_size=c.type_vocab_size, layer_norm_eps=c.layer_norm_eps, num_labels=c.num_classes,
        hidden_dropout_prob=c.hidden_dropout, attention_probs_dropout_prob=c.attention_dropout)).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=False)
    return "transformers", hf


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
