"""effnetv2_cls loads torchvision's and timm's EfficientNetV2 weights to any head: pretrained="torchvision" through
torchvision's own weights API and its cache, torchvision and timm state dicts given by path (or hf://timm/<name>)
with their layout detected; checkpoints are written by the peer library's own classes (random init, no network)
and outputs compared with the peer's own model. Also the generic torch.compile / DDP key prefixes on effnetv2
state dicts, and in_chans adaptation of the stem."""
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
    torch.save({"stem.weight": torch.zeros(24, 3, 3, 3), "bn1.weight": torch.ones(24)}, tmp_path / "other.pth")
    with pytest.raises(ValueError) as err:
        zoo.load("effnetv2_cls", pretrained=tmp_path / "other.pth")
    message = str(err.value)
    assert "stem.weight" in message and "torchvision efficientnet_v2_{s,m,l} state dict" in message
    assert "timm tf_efficientnetv2_*" in message


def test_in_chans_adapts_torchvision_stem(torchvision_cache):
    tv = torchvision_cache
    model, messages = load_recording(pretrained="torchvision", variant="s", in_chans=1)
    assert model.stem.conv.weight.shape[1] == 1 and any("in_chans=1" in m for m in messages)
    grey = X[:, :1]
    torch.testing.assert_close(zoo_pooled(model, grey), pooled(tv, grey.expand(-1, 3, -1, -1)), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- timm

ODD = torch.randn(2, 3, 65, 71, generator=torch.Generator().manual_seed(1))


def timm_model(name, seed=0, **kw):
    """timm's own model, random init, with BatchNorm statistics made non-trivial (so that eps and the
    statistics' mapping matter)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **kw).eval()
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.05)
    return model


def assert_logits(ours, theirs):
    scale = max(1.0, theirs.abs().max().item())  # atol 1e-4 of the logits' scale
    torch.testing.assert_close(ours, theirs, atol=1e-4 * scale, rtol=1e-4)


@pytest.fixture(scope="module")
def b0_file(tmp_path_factory):
    tm = timm_model("tf_efficientnetv2_b0", seed=10)
    path = tmp_path_factory.mktemp("timm") / "tf_efficientnetv2_b0.pth"
    torch.save(tm.state_dict(), path)
    return tm, path


def test_timm_architecture_table_matches_timm():
    """Every timm architecture effnetv2_cls claims to load has the shapes zoo builds (meta device: no memory)."""
    timm = pytest.importorskip("timm")
    from zoo.models.effnetv2 import TIMM_ARCHS, EfficientNetV2, EffNetV2Config, from_timm
    for name, row in TIMM_ARCHS.items():
        with torch.device("meta"):
            tm = timm.create_model(name, pretrained=False, num_classes=3)
            config = EffNetV2Config(**row, num_classes=3)
            own = EfficientNetV2(config).state_dict()
        assert (tm.conv_stem.__class__.__name__ == "Conv2dSame") == (config.padding == "same"), name
        assert tm.bn1.eps == config.bn_eps, name
        converted = from_timm(tm.state_dict(), config)  # every key placed, every shape checked
        assert set(converted) == set(own), name


def test_timm_tf_b0_by_path_logits_at_odd_size(b0_file):
    tm, path = b0_file
    model, messages = load_recording(pretrained=path)
    assert not messages
    c = model.config
    assert (c.variant, c.num_classes, c.padding, c.bn_eps, c.in_chans) == ("b0", 1000, "same", 1e-3, 3)
    x = torch.randn(2, 3, 97, 113, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = tm(x)
        assert_logits(model(x), want)
        # the TF padding is what makes them equal: symmetric padding gives other logits
        symmetric = zoo.load("effnetv2_cls", pretrained=path, padding="torch")
        assert not torch.allclose(symmetric(x), want, atol=1e-3)


def test_timm_tf_s_by_path_logits_at_odd_size(tmp_path):
    from safetensors.torch import save_file
    tm = timm_model("tf_efficientnetv2_s", seed=11, num_classes=10)
    save_file(tm.state_dict(), tmp_path / "s.safetensors")
    model, _ = load_recording(pretrained=tmp_path / "s.safetensors")
    assert (model.config.variant, model.config.num_classes, model.config.padding) == ("s", 10, "same")
    with torch.no_grad():
        assert_logits(model(ODD), tm(ODD))


def test_timm_config_round_trips_through_zoo_save(b0_file, tmp_path):
    _, path = b0_file
    model = zoo.load("effnetv2_cls", pretrained=path)
    zoo.save(model, tmp_path / "b0.safetensors")
    again = zoo.load("effnetv2_cls", pretrained=tmp_path / "b0.safetensors")
    assert again.config == model.config and again.config.padding == "same"
    with torch.no_grad():
        torch.testing.assert_close(again(ODD), model(ODD))


def test_timm_new_head_names_the_head_keys(b0_file):
    tm, path = b0_file
    model, messages = load_recording(pretrained=path, num_classes=5)
    head = [m for m in messages if "head re-initialised" in m]
    assert len(head) == 1 and "head.weight" in head[0] and "head.bias" in head[0]
    assert model.head.out_features == 5
    with torch.no_grad():
        assert_logits(model.forward_head(model.forward_features(ODD), pre_logits=True), tm.forward_head(
            tm.forward_features(ODD), pre_logits=True))


def test_timm_in_chans_1_adapts_the_stem_as_timm(b0_file):
    from timm.models._manipulate import adapt_input_conv
    tm, path = b0_file
    model, messages = load_recording(pretrained=path, in_chans=1)
    assert any("stem.conv.weight" in m and "in_chans=1" in m for m in messages)
    grey = timm_model("tf_efficientnetv2_b0", in_chans=1)
    sd = tm.state_dict()
    grey.load_state_dict({**sd, "conv_stem.weight": adapt_input_conv(1, sd["conv_stem.weight"])})
    x = ODD[:, :1]
    with torch.no_grad():
        assert_logits(model(x), grey(x))


def test_in_chans_more_repeats_and_rescales():
    from zoo.models.effnetv2 import adapt_input_conv
    timm = pytest.importorskip("timm")
    w = torch.randn(8, 3, 3, 3)
    for n in (1, 2, 4, 5):
        torch.testing.assert_close(adapt_input_conv(n, w), timm.models._manipulate.adapt_input_conv(n, w.clone()))


def test_forward_intermediates_match_timm_features_only(b0_file):
    timm = pytest.importorskip("timm")
    tm, path = b0_file
    model = zoo.load("effnetv2_cls", pretrained=path)
    features = timm.create_model("tf_efficientnetv2_b0", pretrained=False, features_only=True).eval()
    own = features.state_dict()
    features.load_state_dict({k: v for k, v in tm.state_dict().items() if k in own})
    with torch.no_grad():
        ours, theirs = model.forward_intermediates(ODD), features(ODD)
        assert [i["reduction"] for i in model.feature_info()] == features.feature_info.reduction() == [2, 4, 8, 16, 32]
        assert [i["channels"] for i in model.feature_info()] == features.feature_info.channels()
        assert len(ours) == len(theirs) == 5
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert [f.shape[-2:] for f in model.forward_intermediates(ODD, indices=2)] == [b.shape[-2:] for b in theirs[3:]]
        assert [f.shape[1] for f in model.forward_intermediates(ODD, indices=[0, -1])] == [16, 192]
    with pytest.raises(ValueError, match="5 feature maps"):
        model.forward_intermediates(ODD, indices=[5])


def test_timm_rw_t_by_path_symmetric_padding(tmp_path):
    tm = timm_model("efficientnetv2_rw_t", seed=12, num_classes=4)
    torch.save(tm.state_dict(), tmp_path / "rw_t.pth")
    model, _ = load_recording(pretrained=tmp_path / "rw_t.pth")
    c = model.config
    assert (c.padding, c.bn_eps, c.num_classes, c.depths) == ("torch", 1e-5, 4, (2, 4, 4, 6, 9, 14))
    with torch.no_grad():
        assert_logits(model(ODD), tm(ODD))


def test_timm_layout_both_ways(b0_file):
    from zoo.models.effnetv2 import to_timm
    tm, path = b0_file
    model = zoo.load("effnetv2_cls", pretrained=path)
    fresh = timm_model("tf_efficientnetv2_b0", seed=99)
    fresh.load_state_dict(to_timm(model))  # strict: every key, every shape
    with torch.no_grad():
        torch.testing.assert_close(fresh(ODD), tm(ODD))


def test_timm_hub_uri_offline(tmp_path, offline_hub):
    """hf://timm/<name>: timm's own save_for_hf folder (model.safetensors + config.json naming the
    architecture) in a local Hub cache."""
    timm = pytest.importorskip("timm")
    tm = timm_model("tf_efficientnetv2_b0", seed=13, num_classes=6)
    timm.models.save_for_hf(tm, tmp_path / "saved", safe_serialization=True)
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    offline_hub.publish("timm/tf_efficientnetv2_b0.test", tmp_path / "saved")
    model = zoo.load("effnetv2_cls", pretrained="hf://timm/tf_efficientnetv2_b0.test")
    assert (model.config.variant, model.config.num_classes, model.config.padding) == ("b0", 6, "same")
    with torch.no_grad():
        assert_logits(model(ODD), tm(ODD))


def test_timm_config_json_naming_another_architecture_is_refused(b0_file, tmp_path):
    from safetensors.torch import save_file
    tm, _ = b0_file
    save_file(tm.state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"architecture": "tf_efficientnetv2_s", "num_classes": 1000}')
    with pytest.raises(ValueError, match="do not have the shapes of timm's tf_efficientnetv2_s"):
        zoo.load("effnetv2_cls", pretrained=tmp_path)
    (tmp_path / "config.json").write_text('{"architecture": "resnet50", "num_classes": 1000}')
    with pytest.raises(ValueError, match="'resnet50'.*tf_efficientnetv2_b0"):
        zoo.load("effnetv2_cls", pretrained=tmp_path)
