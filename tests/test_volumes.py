"""Volume generators: the randomised training generator, the independent evaluation generator, and the
unet3d_seg train script's Dice on both."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zoo.data.volumes import GENERATORS, SyntheticVolumes, independent_volume, randomised_volume

SHAPE = (24, 24, 24)
ROOT = Path(__file__).resolve().parents[1]


def _touches(mask, other):
    """Voxels of `mask` with a face neighbour in `other`."""
    grown = F.max_pool3d(other.float()[None, None], (3, 1, 1), 1, (1, 0, 0))
    grown = torch.maximum(grown, F.max_pool3d(other.float()[None, None], (1, 3, 1), 1, (0, 1, 0)))
    grown = torch.maximum(grown, F.max_pool3d(other.float()[None, None], (1, 1, 3), 1, (0, 0, 1)))
    return mask & (grown[0, 0] > 0)


@pytest.mark.parametrize("generator", [randomised_volume, independent_volume])
def test_generators_are_deterministic_per_seed(generator):
    a, la = generator(5, SHAPE)
    b, lb = generator(5, SHAPE)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert a.shape == (1, *SHAPE) and a.dtype == torch.float32 and la.dtype == torch.int64
    c, lc = generator(6, SHAPE)
    assert not torch.equal(a, c) and not torch.equal(la, lc)


@pytest.mark.parametrize("generator", [randomised_volume, independent_volume])
def test_every_class_is_present_and_nested_in_the_one_below(generator):
    # the label semantics both generators share: class c + 1 lies inside class c, never against the background
    for seed in range(6):
        _, label = generator(seed, SHAPE)
        counts = torch.bincount(label.flatten(), minlength=3)
        assert len(counts) == 3 and (counts > 0).all(), (seed, counts)
        assert not _touches(label == 2, label == 0).any(), seed
    _, label = generator(0, (48, 48, 48), num_classes=4)  # a deeper nesting needs room
    assert set(label.unique().tolist()) == {0, 1, 2, 3}
    assert not _touches(label == 2, label == 0).any()


def test_randomised_appearance_varies_across_seeds():
    means, stds, organ_brighter, lesion_brighter = [], [], [], []
    for seed in range(12):
        image, label = randomised_volume(seed, SHAPE)
        image = image[0]
        means.append(float(image.mean()))
        stds.append(float(image[label == 0].std()))  # the background's spread: noise level and bias field
        level = [float(image[label == c].mean()) for c in range(3)]
        organ_brighter.append(level[1] > level[0])
        lesion_brighter.append(level[2] > level[1])
    assert max(means) - min(means) > 1.0
    assert max(stds) > 2 * min(stds)
    # no fixed intensity order: class identity has to come from shape and context
    assert 0 < sum(organ_brighter) < 12 and 0 < sum(lesion_brighter) < 12


def test_independent_generator_differs_from_the_training_one():
    ran = [randomised_volume(s, SHAPE) for s in range(8)]
    ind = [independent_volume(s, SHAPE) for s in range(8)]
    # intensity and noise model: magnitude (Rician) or counts (Poisson) are never negative; the randomised
    # generator's additive Gaussian noise, inversion and offset give negative voxels in most volumes
    assert all(float(image.min()) >= 0 for image, _ in ind)
    assert sum(float(image.min()) < 0 for image, _ in ran) >= 6
    # shapes: lobed blobs, cubes and tori are not the randomised generator's ellipsoids; the same seed gives
    # other labels, and the nested objects take a different share of the foreground
    assert all(not torch.equal(a[1], b[1]) for a, b in zip(ran, ind))
    share = [sum(float((lb == 2).sum() / (lb > 0).sum()) for _, lb in vols) / 8 for vols in (ran, ind)]
    assert share[0] != pytest.approx(share[1], rel=0.2)


def test_synthetic_volumes_dataset_picks_the_generator():
    data = SyntheticVolumes(2, first_seed=3, shape=SHAPE, generator="synthetic-random")
    image, label = data[1]
    expected = randomised_volume(4, SHAPE)
    assert torch.equal(image, expected[0]) and torch.equal(label, expected[1])
    assert set(GENERATORS) == {"synthetic", "synthetic-random", "unseen"}
    with pytest.raises(ValueError, match="unknown volume generator"):
        SyntheticVolumes(1, generator="spheres")


def test_train_script_reports_dice_on_its_generator_and_the_unseen_one(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "train_scripts" / "unet3d_seg.py"), "--data", "synthetic-random",
           "--preset", "small", "--volume", "24", "--crop", "16", "--train-volumes", "4", "--val-volumes", "2",
           "--unseen-volumes", "2", "--batch-size", "1", "--steps", "2", "--warmup", "1", "--workers", "0",
           "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    final = json.loads(result.stdout.strip().splitlines()[-1])["final"]
    for name in ("mean_dice", "dice_1", "dice_2", "fg_dice"):
        assert 0 <= final[name] <= 1 and 0 <= final[f"{name}_unseen"] <= 1
    refused = subprocess.run([*cmd[:3], "unseen", *cmd[4:-1], str(tmp_path / "refused")], capture_output=True,
                             text=True, env=env, timeout=600)
    assert refused.returncode != 0 and "evaluation-only generator" in refused.stderr
