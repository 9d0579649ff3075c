"""effnetv2_cls loads torchvision's EfficientNetV2 weights to any head: pretrained="torchvision" through
torchvision's own weights API and its cache, and torchvision state dicts given by path with their layout
detected; checkpoints are written by torchvision's own classes (random init, no network). Also the generic
torch.compile / DDP key prefixes on effnetv2 state dicts."""
import logging
import warnings

import pytest
import torch
import torchvision

import zoo

X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def torchvision_model(variant="s", seed=0, **kw):
    torch.manual_seed(seed)
    return getattr(torchvision.models, f"efficientnet_v2_{variant}")(**kw).eval()


def pooled(tv, x=X):
    with torch.no_grad():
        return tv.avgpool(tv.features(x)).flatten(1)


def zoo_pooled(model, x=X):
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True)


def load_recording(**kw):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = zoo.load("effnetv2_cls", **kw)
    return model, [str(w.message) for w in record]


@pytest.fixture
def torchvision_cache(tmp_path, monkeypatch):
    """torchvision's EfficientNetV2-S weights file, from a random model, where torchvision's cache keeps it; any
    download attempt fails, so the test proves the cached file is what loads."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    tv = torchvision_model("s", seed=1)
    url = torchvision.models.EfficientNet_V2_S_Weights.DEFAULT.url
    checkpoints = tmp_path / "torch" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.save(tv.state_dict(), checkpoints / url.rsplit("/", 1)[-1])

    def no_network(*args, **kwargs):
        raise AssertionError("tried to download although the file is in the cache")
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    return tv


def test_pretrained_torchvision_with_a_new_head(torchvision_cache):
    tv = torchvision_cache
    model, messages = load_recording(pretrained="torchvision", variant="s", num_classes=5)
    assert model.config.num_classes == 5 and model.head.out_features == 5
    head = [m for m in messages if "head re-initialised" in m]
    assert len(head) == 1 and "head.weight" in head[0] and "head.bias" in head[0]
    torch.testing.assert_close(zoo_pooled(model), pooled(tv), atol=1e-4, rtol=1e-4)
    assert torch.isfinite(model(X)).all()
    # the old head's labels and metrics are gone; the backbone's preprocessing stays
    assert model.labels == ["0", "1", "2", "3", "4"] and model.pretrained_meta.metrics == {}
    t = torchvision.models.EfficientNet_V2_S_Weights.DEFAULT.transforms()
    assert model.preprocessing["crop"] == t.crop_size[0] and model.preprocessing["mean"] == list(t.mean)


def test_pretrained_torchvision_with_its_own_head(torchvision_cache):
    tv = torchvision_cache
    model, messages = load_recording(pretrained="torchvision", variant="s")
    assert not [m for m in messages if "head re-initialised" in m]
    with torch.no_grad():
        torch.testing.assert_close(model(X), tv(X), atol=1e-4, rtol=1e-4)
    assert len(model.labels) == 1000 and model.labels[0] == "tench"


def test_pretrained_torchvision_refusal_says_what_loads():
    with pytest.raises(ValueError, match="variant s, m or l .*variant='b0'.*pretrained='torchvision'"):
        zoo.load("effnetv2_cls", pretrained="torchvision", variant="b0")


def test_torchvision_state_dict_by_path_new_head(tmp_path):
    tv = torchvision_model("s", seed=2)
    torch.save(tv.state_dict(), tmp_path / "effnetv2_s.pth")
    model, messages = load_recording(pretrained=tmp_path / "effnetv2_s.pth", num_classes=5)
    assert model.config.variant == "s" and model.config.num_classes == 5
    assert any("head re-initialised" in m and "head.weight" in m for m in messages)
    torch.testing.assert_close(zoo_pooled(model), pooled(tv), atol=1e-4, rtol=1e-4)


def test_torchvision_variant_and_classes_are_detected(tmp_path):
    tv = torchvision_model("m", seed=3, num_classes=7)
    torch.save(tv.state_dict(), tmp_path / "m.pth")
    model, messages = load_recording(pretrained=tmp_path / "m.pth")  # no variant, no num_classes given
    assert (model.config.variant, model.config.num_classes) == ("m", 7) and not messages
    with torch.no_grad():
        torch.testing.assert_close(model(X), tv(X), atol=1e-4, rtol=1e-4)


def test_compiled_torchvision_state_dict(tmp_path, caplog):
    tv = torchvision_model("s", seed=4)
    sd = torch.compile(tv).state_dict()  # compilation is lazy: only the wrapper's keys
    assert all(k.startswith("_orig_mod.") for k in sd)
    torch.save(sd, tmp_path / "compiled.pth")
    with caplog.at_level(logging.INFO, logger="zoo.weights.specs"):
        model, _ = load_recording(pretrained=tmp_path / "compiled.pth", num_classes=5)
    assert sum("'_orig_mod.'" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(zoo_pooled(model), pooled(tv), atol=1e-4, rtol=1e-4)


def test_ddp_prefixed_zoo_state_dict(tmp_path, caplog):
    torch.manual_seed(5)
    model = zoo.load("effnetv2_cls", variant="b0", num_classes=3)
    ddp_like = torch.nn.Module()
    ddp_like.module = model  # DistributedDataParallel keeps the model as `.module`: the same keys
    torch.save(ddp_like.state_dict(), tmp_path / "ddp.pt")
    with caplog.at_level(logging.INFO, logger="zoo.weights.specs"):
        loaded, messages = load_recording(pretrained=tmp_path / "ddp.pt")
    assert sum("'module.'" in r.getMessage() for r in caplog.records) == 1 and not messages
    assert (loaded.config.variant, loaded.config.num_classes) == ("b0", 3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(X), model.eval()(X))


def test_unknown_layout_names_keys_and_what_loads(tmp_path):
    torch.save({"conv_stem.weight": torch.zeros(24, 3, 3, 3), "bn1.weight": torch.ones(24)}, tmp_path / "timm.pth")
    with pytest.raises(ValueError) as err:
        zoo.load("effnetv2_cls", pretrained=tmp_path / "timm.pth")
    message = str(err.value)
    assert "conv_stem.weight" in message and "torchvision efficientnet_v2_{s,m,l} state dict" in message
