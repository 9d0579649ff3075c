"""unet3d_seg: checkpointing policies, sliding-window inference, odd sizes, Dice, data."""
import numpy as np
import pytest
import torch
from torch import nn

import zoo
from zoo import predict
from zoo.blocks.sliding_window import gaussian_importance, sliding_window_inference, window_starts
from zoo.data.volumes import SyntheticVolumes, VolumeFolder, synthetic_volume
from zoo.models.unet3d import ResBlock3d, dice_ce_loss, dice_per_class

from .conftest import assert_eval_only_reproduces


def test_deep_preset_has_at_least_50_conv_layers():
    model = zoo.load("unet3d_seg", preset="deep")
    assert sum(isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)) for m in model.modules()) >= 50


@pytest.mark.parametrize("policy", ["blocks", "every_k", "selective", "callable"])
def test_checkpointing_policies_give_identical_gradients(policy):
    torch.manual_seed(0)
    model = zoo.load("unet3d_seg", preset="small", norm="group").train()
    x, y = torch.randn(1, 1, 16, 16, 16), torch.randint(0, 3, (1, 16, 16, 16))

    def grads():
        model.zero_grad()
        dice_ce_loss(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    chosen = (lambda m: isinstance(m, ResBlock3d)) if policy == "callable" else policy
    zoo.accel.checkpointing(model, chosen)
    for a, b in zip(plain, grads()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_checkpointing_from_config_keeps_keys():
    plain = zoo.load("unet3d_seg", preset="small")
    ckpt = zoo.load("unet3d_seg", preset="small", checkpointing="blocks")
    assert list(plain.state_dict()) == list(ckpt.state_dict())


@pytest.mark.parametrize("shape", [(1, 1, 17, 19, 23), (2, 1, 8, 8, 8)])
def test_odd_sizes_are_padded_and_cropped_back(shape):
    model = zoo.load("unet3d_seg", preset="small")
    assert model(torch.randn(shape)).shape == (shape[0], 3, *shape[2:])


@pytest.mark.parametrize("blend", ["gaussian", "constant"])
def test_one_window_equals_the_direct_forward_pass(blend):
    model = zoo.load("unet3d_seg", preset="small").eval()
    x = torch.randn(1, 1, 16, 16, 16)
    with torch.no_grad():
        direct = model(x)
    out = sliding_window_inference(model, x, (16, 16, 16), overlap=0.5, blend=blend)
    torch.testing.assert_close(out, direct, atol=1e-5, rtol=1e-5)
    # a window larger than the volume: padded, then cropped back
    assert sliding_window_inference(model, torch.randn(1, 1, 10, 12, 9), (16, 16, 16)).shape == (1, 3, 10, 12, 9)


def test_sliding_window_of_a_pointwise_predictor_is_exact():
    predictor = lambda v: torch.cat([v * 2, -v], dim=1)  # noqa: E731  (no context: every window agrees)
    x = torch.randn(2, 1, 30, 21, 25)
    out = sliding_window_inference(predictor, x, (8, 8, 8), overlap=0.25, batch_size=3)
    torch.testing.assert_close(out, torch.cat([x * 2, -x], dim=1), atol=1e-5, rtol=1e-5)


def test_window_helpers_and_errors():
    assert window_starts(10, 4, 0.5) == [0, 2, 4, 6]
    assert window_starts(11, 4, 0.0) == [0, 4, 7]
    assert window_starts(3, 4, 0.5) == [0]
    w = gaussian_importance((5, 7, 9))
    assert w.shape == (5, 7, 9) and w.max() == 1 and w.min() > 0
    with pytest.raises(ValueError, match="spatial dims"):
        sliding_window_inference(lambda v: v, torch.randn(1, 1, 8, 8), (4, 4, 4))


def test_dice_on_known_masks():
    target = torch.zeros(4, 4, 4, dtype=torch.long)
    target[:2] = 1
    pred = torch.zeros_like(target)
    pred[:1] = 1
    pred[3, 0, 0] = 2  # class 2 predicted but absent from the target: Dice 0
    scores = dice_per_class(pred, target, num_classes=4)  # class 3 absent from both: left out
    assert scores == {1: pytest.approx(2 * 16 / (16 + 32)), 2: 0.0}


def test_dice_ce_loss_is_low_for_a_perfect_prediction():
    target = torch.randint(0, 3, (2, 6, 6, 6))
    perfect = torch.nn.functional.one_hot(target, 3).movedim(-1, 1).float() * 20
    assert dice_ce_loss(perfect, target) < 1e-3 < dice_ce_loss(torch.zeros_like(perfect), target)


def test_synthetic_volumes_are_deterministic(tmp_path):
    a, la = synthetic_volume(3, (24, 24, 24))
    b, lb = synthetic_volume(3, (24, 24, 24))
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert set(la.unique().tolist()) <= {0, 1, 2} and (la > 0).any()
    assert not torch.equal(synthetic_volume(4, (24, 24, 24))[1], la)
    assert len(SyntheticVolumes(5, shape=(16, 16, 16))) == 5


def test_synthetic_classes_are_identifiable_by_intensity_across_volumes():
    # the class of a voxel must be learnable: class c is brighter than class c-1 in every volume
    for seed in range(4):
        image, label = synthetic_volume(seed, (32, 32, 32))
        means = [image[0][label == c].mean() for c in range(3) if (label == c).any()]
        assert all(a < b for a, b in zip(means, means[1:]))


def test_volume_folder(tmp_path):
    image, label = synthetic_volume(0, (16, 16, 16))
    np.save(tmp_path / "case1.npy", image[0].numpy())
    np.save(tmp_path / "case1_label.npy", label.numpy())
    x, y = VolumeFolder(tmp_path)[0]
    assert x.shape == (1, 16, 16, 16) and y.dtype == torch.long
    np.save(tmp_path / "case2.npy", image[0].numpy())
    with pytest.raises(FileNotFoundError, match="no label file case2_label.npy"):
        VolumeFolder(tmp_path)


def test_predict_volume_and_cli(tmp_path):
    model = zoo.load("unet3d_seg", preset="small")
    image, _ = synthetic_volume(0, (20, 20, 20))
    np.save(tmp_path / "vol.npy", image[0].numpy())
    result, text = predict.run("unet3d_seg", model, [str(tmp_path / "vol.npy")], {"window": "16"})
    assert np.load(result["out"]).shape == (20, 20, 20)
    assert sum(result["voxels_per_class"].values()) == 20 ** 3 and "voxels per class" in text


def test_shipped_weights_reproduce_their_dice_on_held_out_volumes():
    model = zoo.load("unet3d_seg", pretrained=True)
    metrics = model.pretrained_meta.metrics
    # trained on randomised volumes; the goal is foreground Dice on a generator it never saw (issue 21)
    assert metrics["fg_dice_unseen"] >= 0.85 and metrics["fg_dice"] >= 0.85
    # evaluated under the precision it trained in; bf16 3D convolutions without native bf16 are ~165x slower
    # than fp32 (hours instead of about a minute): there fp32, within 0.5 pt of Dice
    dice_within = dict.fromkeys(("mean_dice", "fg_dice", "fg_dice_unseen"), 0.005)
    assert_eval_only_reproduces("unet3d_seg.py", ["--data", "synthetic-random", "--workers", "0"],
                                model.pretrained_meta, dice_within, default_amp="off")
