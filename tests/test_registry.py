import pytest

import zoo
from zoo.registry import register_model
from tests.conftest import TinyConfig, TinyNet


def test_families_are_registered():
    assert "transformer_lm" in zoo.list_models()


def test_unknown_name_suggests_closest():
    with pytest.raises(ValueError, match="Did you mean 'transformer_lm'"):
        zoo.load("transformer_l")


def test_unknown_config_key_lists_valid_ones(tiny):
    with pytest.raises(ValueError, match=r"unknown config override 'num_clases'.*valid keys: in_features, hidden, "
                                         r"num_classes"):
        zoo.load(tiny, num_clases=5)


def test_config_override_applies(tiny):
    model = zoo.load(tiny, num_classes=7)
    assert model.head.out_features == 7 and model.config.num_classes == 7
    assert not model.training, "zoo.load returns eval mode"


def test_duplicate_registration_refused(tiny):
    with pytest.raises(ValueError, match="already registered"):
        register_model(tiny, config=TinyConfig)(TinyNet)


def test_default_must_be_a_tag():
    with pytest.raises(ValueError, match="default weights"):
        register_model("x_never", config=TinyConfig, weights={"a": "a.safetensors"}, default="b")


def test_info_counts_parameters(tiny):
    info = zoo.info(tiny)
    assert info["params"] == sum(p.numel() for p in TinyNet().parameters())
    assert info["config"] == {"in_features": 4, "hidden": 8, "num_classes": 3}
