"""Test-time augmentation by flips (issue 17 item 7): effnetv2_cls averages the logits of an image and its mirror
in predict, `zoo predict --tta flip` and the train script's evaluation; unet3d_seg averages the probabilities
over the 8 flips of a volume. Each is checked against the forwards computed here, one by one."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import zoo
from zoo.blocks.sliding_window import sliding_window_inference

ROOT = Path(__file__).resolve().parents[1]


def small_effnet():
    torch.manual_seed(0)  # b0's six stages, narrow and one block deep: 50k parameters
    return zoo.load("effnetv2_cls", num_classes=3, drop_path_rate=0.0, widths=(8, 8, 16, 16, 24, 32, 32, 64),
                    depths=(1, 1, 1, 1, 1, 1)).eval()


def test_effnet_predict_with_flip_is_the_mean_of_the_two_forwards(tmp_path):
    from PIL import Image

    from zoo.data.images import open_image
    from zoo.predict import run
    g = np.random.default_rng(0)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(g.integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(paths[-1])
    model = small_effnet()
    x = torch.stack([model.transforms()(open_image(p)) for p in paths])
    with torch.no_grad():
        want = ((model(x) + model(x.flip(-1))) / 2).softmax(-1)
    got = model.predict(paths, top_k=3, tta="flip")
    for row, top in zip(want, got):
        assert dict(top) == pytest.approx({model.labels[i]: float(p) for i, p in enumerate(row)}, abs=1e-4)
    assert got != model.predict(paths, top_k=3), "the mirror changed nothing: the test would not see a missing flip"
    result, _ = run("effnetv2_cls", model, [str(p) for p in paths], {"top_k": "3", "tta": "flip"})
    assert [[(t["label"], t["prob"]) for t in r["top"]] for r in result] == got
    with pytest.raises(ValueError, match="--tta takes none or flip"):
        run("effnetv2_cls", model, [str(paths[0])], {"tta": "rotate"})


def train_script(name: str):
    spec = importlib.util.spec_from_file_location(f"train_script_{name}_tta", ROOT / "train_scripts" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_train_script_eval_only_with_tta_flip_scores_the_averaged_logits(tmp_path):
    script = train_script("effnetv2_cls")
    g = np.random.default_rng(0)
    x_test, y_test = g.integers(0, 255, (24, 16, 16, 3), dtype=np.uint8), np.arange(24) % 3
    np.savez(tmp_path / "tiny.npz", x_train=x_test, y_train=y_test, x_test=x_test, y_test=y_test)
    model = small_effnet()
    zoo.save(model, tmp_path / "m.safetensors")
    from zoo.data.images import tensor_eval_transform
    transform = tensor_eval_transform(16, small=True, mean=script.CIFAR_MEAN, std=script.CIFAR_STD)
    x = torch.stack([transform(torch.from_numpy(im).permute(2, 0, 1)) for im in x_test])
    with torch.no_grad():
        plain, mirrored = model(x), model(x.flip(-1))

    def confusion(logits):
        return torch.bincount(torch.from_numpy(y_test) * 3 + logits.argmax(-1), minlength=9).view(3, 3).tolist()
    assert confusion((plain + mirrored) / 2) != confusion(plain), "choose images where the mirror matters"
    for tta, logits in (("flip", (plain + mirrored) / 2), ("none", plain)):
        metrics = script.main(["--eval-only", "--pretrained", str(tmp_path / "m.safetensors"), "--data",
                               str(tmp_path / "tiny.npz"), "--workers", "0", "--tta", tta])
        assert metrics["confusion"] == confusion(logits), tta


def test_unet3d_flip_averages_probabilities_over_the_8_flips():
    torch.manual_seed(0)
    model = zoo.load("unet3d_seg", channels=(4, 8), blocks=1).eval()
    volume = torch.randn(1, 12, 10, 14)
    flips = [(), (-3,), (-2,), (-1,), (-3, -2), (-3, -1), (-2, -1), (-3, -2, -1)]
    with torch.no_grad():
        probs = [sliding_window_inference(model, volume[None].flip(f), (8, 8, 8), overlap=0.25, blend="gaussian",
                                          batch_size=2, device="cpu").softmax(1).flip(f) for f in flips]
    want = (sum(probs) / 8)[0].argmax(0)
    got = model.predict_volume(volume, window=8, tta="flip")
    assert torch.equal(got, want)
    assert not torch.equal(got, model.predict_volume(volume, window=8)), "the flips changed nothing"


def test_unet3d_train_script_scores_the_flip_averaged_segmentation(tmp_path, monkeypatch):
    from zoo.models.unet3d import UNet3d
    torch.manual_seed(0)
    zoo.save(zoo.load("unet3d_seg", channels=(4, 8), blocks=1), tmp_path / "m.safetensors")
    calls = []
    predict = UNet3d.predict_volume

    def spy(self, volume, **kw):  # the flips themselves are checked above
        calls.append(kw.get("tta", "none"))
        return predict(self, volume, **kw)
    monkeypatch.setattr(UNet3d, "predict_volume", spy)
    argv = ["--eval-only", "--pretrained", str(tmp_path / "m.safetensors"), "--data", "synthetic", "--volume", "16",
            "--crop", "16", "--val-volumes", "1", "--unseen-volumes", "1", "--workers", "0"]
    train_script("unet3d_seg").main([*argv, "--tta", "flip"])
    assert calls == ["flip"] * 2, "both evaluation volumes (own and unseen generator) segmented with the 8 flips"
