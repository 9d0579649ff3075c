"""Shared fixtures: a tiny classifier registered for the duration of a test, so the machinery is
tested without waiting for (or paying for) the real families."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from zoo.models.base import ZooModel
from zoo.registry import register_model, unregister_model

TINY = "tiny_test_cls"


@dataclass(frozen=True)
class TinyConfig:
    in_features: int = 4
    hidden: int = 8
    num_classes: int = 3


class TinyNet(ZooModel):
    """A two-layer classifier for machinery tests."""
    head_prefixes = ("head.",)

    def __init__(self, config: TinyConfig = TinyConfig()):
        super().__init__()
        self.config = config
        self.body = nn.Sequential(nn.Linear(config.in_features, config.hidden), nn.ReLU())
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.num_classes)

    @property
    def checkpoint_blocks(self):
        return [self.body]

    def example_inputs(self, batch: int = 2):
        return (torch.randn(batch, self.config.in_features, generator=torch.Generator().manual_seed(0)),)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))

    def cli_predict(self, inputs, **options):
        if not inputs:
            raise ValueError("give numbers")
        x = torch.tensor([[float(v) for v in inputs]])
        probs = self(x).softmax(-1)[0].tolist()
        return {"probs": probs}, " ".join(f"{p:.3f}" for p in probs)

    def demo(self):
        return "tiny demo ran"


@pytest.fixture
def tiny():
    """Register TinyNet as `tiny_test_cls` for one test."""
    register_model(TINY, config=TinyConfig)(TinyNet)
    yield TINY
    unregister_model(TINY)


@pytest.fixture
def tiny_shipped(tiny, tmp_path, monkeypatch):
    """`tiny_test_cls` with shipped weights under tag `v1` in a temporary weights/ folder."""
    import json

    import zoo
    from zoo import registry, weights

    torch.manual_seed(0)
    model = zoo.load(tiny)
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    zoo.save(model, weights_dir / "tiny.v1.safetensors", {"labels": ["a", "b", "c"], "dataset": "random",
                                                          "metrics": {"acc": 0.5}})
    data = (weights_dir / "tiny.v1.safetensors").read_bytes()
    import hashlib
    manifest = {"tiny.v1.safetensors": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}
    (weights_dir / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(weights, "weights_dir", lambda: weights_dir)
    entry = registry._REGISTRY[tiny]
    monkeypatch.setitem(registry._REGISTRY, tiny, registry.ModelEntry(
        entry.name, entry.model_cls, entry.config_cls, {"v1": "tiny.v1.safetensors"}, "v1", entry.description))
    return model, weights_dir
