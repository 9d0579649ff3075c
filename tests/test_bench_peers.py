"""bench/peers.py's bert_cls peer is transformers' own model of the same arch, loaded strictly with zoo's weights:
the bench compares equal models (logits to float tolerance) for BERT, RoBERTa and DistilBERT."""
import pytest
import torch

import zoo
from zoo.bench import peer_model

pytest.importorskip("transformers")

TINY = dict(layers=2, hidden=48, heads=4, intermediate=96, max_positions=40, hidden_dropout=0.0,
            attention_dropout=0.0, classifier_dropout=0.0)


@pytest.mark.parametrize("arch, extra, peer_class", [
    ("bert", dict(num_classes=3), "BertForSequenceClassification"),
    ("roberta", dict(num_classes=1), "RobertaForSequenceClassification"),
    ("distilbert", dict(num_classes=3, problem="multi_label"), "DistilBertForSequenceClassification"),
])
def test_bert_peer_is_the_same_model(arch, extra, peer_class):
    torch.manual_seed(0)
    model = zoo.load("bert_cls", arch=arch, **TINY, **extra).eval()
    with torch.no_grad():  # a zero-initialised head would make any two models agree
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    label, peer = peer_model("bert_cls", model)  # load_state_dict(strict=True) inside
    assert label == "transformers" and type(peer).__name__ == peer_class and not peer.training
    x = model.example_inputs(2, 8)
    with torch.no_grad():
        ours, theirs = model(*x), peer(*x).logits
    assert ours.abs().max() > 0.01
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_no_peer_for_mean_pooling():
    assert peer_model("bert_cls", zoo.load("bert_cls", **TINY, pooling="mean")) is None
