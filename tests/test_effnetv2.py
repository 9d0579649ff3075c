"""effnetv2_cls: torchvision parity both ways (s, m, l), the timm contract, images and errors."""
import urllib.error

import numpy as np
import pytest
import torch
import torchvision

import zoo
from zoo.demo import demo
from zoo.models.effnetv2 import from_torchvision, to_torchvision

from .conftest import assert_eval_only_reproduces


@pytest.mark.parametrize("variant", ["s", "m", "l"])
def test_torchvision_parity_both_directions(variant):
    torch.manual_seed(0)
    tv = getattr(torchvision.models, f"efficientnet_v2_{variant}")(num_classes=7).eval()
    model = zoo.load("effnetv2_cls", variant=variant, num_classes=7)
    model.load_state_dict(from_torchvision(tv.state_dict(), model.config))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), tv(x), atol=1e-5, rtol=1e-5)
    fresh = getattr(torchvision.models, f"efficientnet_v2_{variant}")(num_classes=7).eval()
    fresh.load_state_dict(to_torchvision(model))  # strict: every key, every shape
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), atol=1e-5, rtol=1e-5)


def test_wrong_variant_names_the_key():
    tv = torchvision.models.efficientnet_v2_s()
    model = zoo.load("effnetv2_cls", variant="m")
    with pytest.raises(ValueError, match=r"features\..*has shape .* is it EfficientNetV2-M\?|lacks features"):
        from_torchvision(tv.state_dict(), model.config)
    with pytest.raises(ValueError, match="no EfficientNetV2-B0"):
        to_torchvision(zoo.load("effnetv2_cls", variant="b0"))


def test_torchvision_weights_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(RuntimeError, match="could not fetch torchvision's EfficientNet_V2_S.*needs network once"):
        zoo.load("effnetv2_cls", variant="s", pretrained="torchvision")


@pytest.mark.parametrize("variant,params_m", [("b0", 7.14), ("b1", 8.14), ("b2", 10.10), ("b3", 14.38)])
def test_b_variants_sizes(variant, params_m):
    model = zoo.load("effnetv2_cls", variant=variant)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - params_m) < 0.01


def test_feature_maps_and_small_image_stem():
    model = zoo.load("effnetv2_cls", variant="b0", stem_stride=1, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_intermediates(x)
    info = model.feature_info()
    assert [f.shape[1] for f in feats] == [i["channels"] for i in info]
    assert [32 // f.shape[-1] for f in feats] == [i["reduction"] for i in info] == [1, 2, 4, 8, 16]
    assert model(x).shape == (2, 10)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 1280)


def test_stage_strides_override_moves_the_mbconv_stages_to_larger_maps(tmp_path):
    # b0's table with strides (1, 2, 2, 1, 1, 2): on a 32x32 image (stem stride 1) its MBConv stages see 8x8 and
    # 4x4 maps instead of 4x4 and 2x2; the weights' shapes do not change, the config travels with a saved file
    torch.manual_seed(0)
    table = {"variant": "b0", "stem_stride": 1, "num_classes": 10, "depths": (1, 2, 1, 1, 1, 1)}
    model = zoo.load("effnetv2_cls", strides=(1, 2, 2, 1, 1, 2), **table).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_intermediates(x)
    assert [f.shape[-1] for f in feats] == [32, 16, 8, 4]
    assert [i["reduction"] for i in model.feature_info()] == [1, 2, 4, 8]
    assert model.forward_features(x).shape[-2:] == (4, 4)
    default = zoo.load("effnetv2_cls", **table)
    assert {k: v.shape for k, v in default.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    default.load_state_dict(model.state_dict())
    assert default.forward_features(x).shape[-2:] == (2, 2)
    zoo.save(model, tmp_path / "m.safetensors", {"labels": [str(i) for i in range(10)]})
    loaded = zoo.load("effnetv2_cls", pretrained=tmp_path / "m.safetensors").eval()
    assert loaded.config.strides == (1, 2, 2, 1, 1, 2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
    for bad in ((1, 2, 2, 1, 1), (1, 2, 3, 1, 1, 2)):
        with pytest.raises(ValueError, match=r"strides for variant 'b0' must be 6 values of 1 or 2"):
            zoo.load("effnetv2_cls", variant="b0", strides=bad)


def test_reset_head_and_new_num_classes_from_saved_weights(tmp_path):
    model = zoo.load("effnetv2_cls", variant="b0", num_classes=10)
    zoo.save(model, tmp_path / "m.safetensors", {"labels": [str(i) for i in range(10)]})
    with pytest.warns(UserWarning, match=r"head\.bias, head\.weight"):
        tuned = zoo.load("effnetv2_cls", pretrained=tmp_path / "m.safetensors", num_classes=3)
    assert torch.equal(tuned.stem.conv.weight, model.stem.conv.weight)
    assert tuned(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    tuned.reset_head(0)
    assert tuned(torch.randn(1, 3, 32, 32)).shape == (1, 1280)


def test_channels_last_gives_the_same_output():
    model = zoo.load("effnetv2_cls", variant="b0", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = model(x)
        model = model.to(memory_format=torch.channels_last)
        got = model(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("side, stride, channels_last", [(1, 1, True), (2, 1, True), (2, 2, False), (3, 2, True),
                                                         (1, 2, False), (4, 1, True)])
def test_depthwise_conv_on_maps_smaller_than_its_kernel_matches_the_plain_conv(side, stride, channels_last):
    # the training pass pads explicitly (or takes the centre tap at 1x1) where oneDNN's backward is slow
    from zoo.models.effnetv2 import DepthwiseConv2d
    torch.manual_seed(0)
    conv = DepthwiseConv2d(12, 12, 3, stride, 1, groups=12, bias=True)
    x = torch.randn(3, 12, side, side + 1 if side > 1 else 1)
    if channels_last:
        x, conv = x.contiguous(memory_format=torch.channels_last), conv.to(memory_format=torch.channels_last)
    x.requires_grad_(True)
    got = conv(x)
    want = torch.nn.functional.conv2d(x, conv.weight, conv.bias, stride, 1, 1, 12)
    assert got.shape == want.shape
    upstream = torch.arange(want.numel(), dtype=torch.float32).view_as(want).cos()
    got.backward(upstream)
    want_grads = torch.autograd.grad(want, (x, conv.weight, conv.bias), upstream)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for grad, want_grad in zip((x.grad, conv.weight.grad, conv.bias.grad), want_grads):
        torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-5)


def test_gradients_match_torchvision_on_images_that_shrink_to_1x1():
    # 32 px through a stride-2 stem ends in 2x2 and 1x1 maps: the depthwise convs' small-map path
    torch.manual_seed(0)
    tv = torchvision.models.efficientnet_v2_s(num_classes=5).eval()  # eval: no dropout, BN running statistics
    model = zoo.load("effnetv2_cls", variant="s", num_classes=5).eval()
    model.load_state_dict(from_torchvision(tv.state_dict(), model.config))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.functional.cross_entropy(tv(x), y).backward()
    ours = dict(model.named_parameters())
    mapped = from_torchvision({k: p.grad for k, p in tv.named_parameters()} | {
        k: v for k, v in tv.state_dict().items() if "running" in k or "num_batches" in k}, model.config)
    for name, p in ours.items():
        torch.testing.assert_close(p.grad, mapped[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("num_classes", [10, 3])
def test_a_fresh_classifier_starts_near_the_uniform_loss(num_classes):
    # torchvision's 1/sqrt(classes) bound gave 10 classes logits of std ~4.6 and a first loss of ~4.1
    torch.manual_seed(0)
    model = zoo.load("effnetv2_cls", variant="b0", stem_stride=1, num_classes=num_classes).train()
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, num_classes, (32,))
    for _ in range(2):
        logits = model(x)
        assert 0.02 < logits.std() < 1.0
        assert torch.nn.functional.cross_entropy(logits, y) < np.log(num_classes) + 0.3
        model.reset_head(num_classes)


def test_grad_checkpointing_same_gradients():
    torch.manual_seed(0)
    model = zoo.load("effnetv2_cls", variant="b0", num_classes=10, drop_path_rate=0.0, drop_rate=0.0).train()
    x = torch.randn(4, 3, 32, 32)

    def grads():
        model.zero_grad()
        model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.set_grad_checkpointing(True)
    for a, b in zip(plain, grads()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    model.set_grad_checkpointing(False)


def test_predict_converts_images_and_rejects_non_images(tmp_path):
    from PIL import Image
    Image.fromarray((np.random.rand(50, 70) * 255).astype("uint8")).save(tmp_path / "grey.png")
    Image.fromarray((np.random.rand(31, 45, 4) * 255).astype("uint8"), "RGBA").save(tmp_path / "rgba.png")
    (tmp_path / "notes.jpg").write_text("not an image")
    model = zoo.load("effnetv2_cls", variant="b0", num_classes=10)
    results = model.predict([tmp_path / "grey.png", tmp_path / "rgba.png"], top_k=3)
    assert [len(r) for r in results] == [3, 3]
    assert abs(sum(p for _, p in model.predict([tmp_path / "grey.png"], top_k=10)[0]) - 1) < 1e-3
    with pytest.raises(ValueError, match="not an image file"):
        model.predict([tmp_path / "notes.jpg"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model.predict([tmp_path / "missing.png"])


def test_training_script_npz_eval_only_and_linear_probe(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    g = np.random.default_rng(0)
    np.savez(tmp_path / "tiny.npz", x_train=g.integers(0, 255, (48, 16, 16, 3), dtype=np.uint8),
             y_train=np.arange(48) % 3, x_test=g.integers(0, 255, (12, 16, 16, 3), dtype=np.uint8),
             y_test=np.arange(12) % 3, class_names=np.array(["a", "b", "c"]))
    script = str(root / "train_scripts" / "effnetv2_cls.py")
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    common = ["--data", str(tmp_path / "tiny.npz"), "--batch-size", "8", "--workers", "0"]
    table = ["--widths", "16,8,16,24,32,40,48,64", "--depths", "1,1,1,1,1,1", "--strides", "1,2,2,1,1,2"]
    run = subprocess.run([sys.executable, script, *common, "--steps", "3", "--out", str(tmp_path / "run"),
                          "--cutmix", "1.0", "--progressive-resize", "8:0.67", *table], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    saved = zoo.load("effnetv2_cls", pretrained=tmp_path / "run" / "model.safetensors")
    assert saved.labels == ["a", "b", "c"] and saved.config.stem_stride == 1
    assert (saved.config.widths, saved.config.depths, saved.config.strides) == (
        (16, 8, 16, 24, 32, 40, 48, 64), (1,) * 6, (1, 2, 2, 1, 1, 2))
    again = subprocess.run([sys.executable, script, *common, "--eval-only", "--pretrained",
                            str(tmp_path / "run" / "model.safetensors")], capture_output=True, text=True, env=env,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["eval"]["top1"] == saved.pretrained_meta.metrics["top1"]
    probe = subprocess.run([sys.executable, script, *common, "--steps", "2", "--pretrained",
                            str(tmp_path / "run" / "model.safetensors"), "--num-classes", "3", "--freeze-backbone",
                            "--out", str(tmp_path / "probe")], capture_output=True, text=True, env=env, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    probed = zoo.load("effnetv2_cls", pretrained=tmp_path / "probe" / "model.safetensors")
    assert torch.equal(probed.stem.conv.weight, saved.stem.conv.weight), "frozen backbone unchanged"
    assert torch.equal(probed.stem.bn.running_mean, saved.stem.bn.running_mean), "BN statistics frozen too"
    assert not torch.equal(probed.head.weight, saved.head.weight)
    clash = subprocess.run([sys.executable, script, *common, "--steps", "1", "--pretrained",
                            str(tmp_path / "run" / "model.safetensors"), "--strides", "1,2,2,2,1,2", "--out",
                            str(tmp_path / "clash")], capture_output=True, text=True, env=env, timeout=600)
    assert clash.returncode != 0 and "--strides shape a new model" in clash.stderr
    assert not (tmp_path / "clash" / "model.safetensors").exists()


def test_freeze_backbone_trains_only_the_head_and_keeps_bn_statistics():
    model = zoo.load("effnetv2_cls", variant="b0", num_classes=4, stem_stride=1)
    model.freeze_backbone()
    model.train()
    before = model.stem.bn.running_mean.clone()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert torch.equal(model.stem.bn.running_mean, before)
    assert model.head.weight.grad is not None and model.stem.conv.weight.grad is None
    model.freeze_backbone(False)
    model.train()
    assert model.stem.bn.training and model.stem.conv.weight.requires_grad


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
CIFAR_SMALL = ROOT.parent / "shared" / "data" / "cifar10" / "cifar10_small.npz"


def test_shipped_cifar10_weights_load_offline_and_classify():
    model = zoo.load("effnetv2_cls", pretrained=True)
    meta = model.pretrained_meta
    assert meta.metrics["top1"] >= 0.75 and model.labels[:3] == ["airplane", "automobile", "bird"]
    assert "train_scripts/effnetv2_cls.py" in meta.command and model.config.stem_stride == 1
    assert model.transforms() is not None and meta.preprocessing["resize"] == 32
    assert "drawn ship at sea (32x32): ship" in demo("effnetv2_cls", model)  # the drawn ship is recognised as one


@pytest.mark.skipif(not CIFAR_SMALL.is_file(), reason="../shared/data/cifar10 is not beside this checkout")
def test_shipped_cifar10_accuracy_is_reproduced_by_eval_only():
    meta = zoo.load("effnetv2_cls", pretrained=True).pretrained_meta
    assert_eval_only_reproduces("effnetv2_cls.py", ["--data", str(CIFAR_SMALL), "--workers", "0"], meta,
                                {"top1": 0.005}, default_amp="off")
