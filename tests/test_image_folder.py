"""ImageFolder data as users have it (issue 17 item 1): mixed sizes and modes decoded lazily, EXIF
orientation applied, undecodable files skipped with one warning (or refused with strict), a train run."""
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from zoo.data.images import ImageFiles, image_folder_datasets, tensor_eval_transform

ROOT = Path(__file__).resolve().parents[1]
MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]


def _rgb(w, h, seed):
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


def mixed_folder(d: Path, corrupt: bool = False, name: str = "photos") -> Path:
    """3 classes of files differing in size (40x50 up to 300x200), format and mode."""
    root = d / name
    for c in "abc":
        (root / c).mkdir(parents=True)
    for c, seed in zip("abc", (0, 10, 20)):
        Image.fromarray(_rgb(40, 50, seed)).save(root / c / "rgb.jpg", quality=90)
        Image.fromarray(_rgb(300, 200, seed + 1)).save(root / c / "rgb.png")
        Image.fromarray(_rgb(64, 48, seed + 2)[..., 0], mode="L").save(root / c / "grey.png")
        rgba = np.dstack([_rgb(70, 60, seed + 3), np.full((60, 70), 128, np.uint8)])
        Image.fromarray(rgba, mode="RGBA").save(root / c / "rgba.png")
        Image.fromarray(_rgb(80, 90, seed + 4)).convert("P", palette=Image.Palette.ADAPTIVE).save(root / c / "p.png")
        deep = np.random.default_rng(seed + 5).integers(0, 65535, (50, 120), dtype=np.uint16)
        Image.fromarray(deep).save(root / c / "deep16.png")  # 16-bit grey
        Image.fromarray(_rgb(100, 75, seed + 6)).convert("CMYK").save(root / c / "cmyk.jpg")
        Image.fromarray(_rgb(120, 80, seed + 7)).save(root / c / "photo.webp")
        Image.fromarray(_rgb(55, 45, seed + 8)).save(root / c / "old.bmp")
    if corrupt:
        (root / "b" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 8)
    return root


def test_mixed_sizes_and_modes_decode_to_rgb_and_transform_to_one_size(tmp_path):
    root = mixed_folder(tmp_path)
    train, held_out, names = image_folder_datasets(root, val_fraction=0.0)
    assert names == ["a", "b", "c"] and held_out is None and len(train) == 27
    sizes = set()
    for i in range(len(train)):
        x, label = train[i]  # no transform: the decoded file, uint8 (3, H, W)
        assert x.dtype == torch.uint8 and x.shape[0] == 3 and label == train.labels[i]
        sizes.add(tuple(x.shape[1:]))
    assert (50, 40) in sizes and (200, 300) in sizes and len(sizes) >= 8
    train.transform = tensor_eval_transform(32, small=False, mean=MEAN, std=STD)
    batch = torch.stack([train[i][0] for i in range(len(train))])
    assert batch.shape == (27, 3, 32, 32) and torch.isfinite(batch).all()
    assert train.skipped() == []


def test_modes_are_converted_faithfully(tmp_path):
    root = tmp_path / "modes" / "a"
    root.mkdir(parents=True)
    Image.fromarray(np.full((4, 6), 32768, np.uint16)).save(root / "half.png")  # 16-bit: scaled, not clipped
    Image.fromarray(np.zeros((4, 6, 4), np.uint8), mode="RGBA").save(root / "clear.png")  # transparent -> white
    data, _, _ = image_folder_datasets(root.parent, val_fraction=0.0)
    by_name = {Path(p).name: data[i][0] for i, (p, _) in enumerate(data.samples)}
    assert (by_name["half.png"] == 128).all() and (by_name["clear.png"] == 255).all()


def test_exif_orientation_is_applied(tmp_path):
    root = tmp_path / "exif" / "a"
    root.mkdir(parents=True)
    pixels = np.zeros((20, 40, 3), np.uint8)  # stored 40 wide, 20 high; the left half red
    pixels[:, :20, 0] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display", as phones write portrait photos
    Image.fromarray(pixels).save(root / "portrait.jpg", exif=exif, quality=95)
    data, _, _ = image_folder_datasets(root.parent, val_fraction=0.0)
    x, _ = data[0]
    assert tuple(x.shape) == (3, 40, 20), "displayed 20 wide and 40 high"
    top, bottom = x[:, :20].float().mean((1, 2)), x[:, 20:].float().mean((1, 2))
    assert top[0] > 200 and bottom[0] < 50, "the stored left half is on top once turned clockwise"


def test_an_undecodable_file_is_skipped_with_one_warning(tmp_path, caplog):
    root = mixed_folder(tmp_path, corrupt=True)
    data, _, _ = image_folder_datasets(root, val_fraction=0.0)
    assert len(data) == 28
    with caplog.at_level(logging.WARNING, logger="zoo.data.images"):
        for _ in range(2):  # two epochs: still one warning
            for i in range(len(data)):
                x, _ = data[i]
                assert x.dtype == torch.uint8
        data.log_skipped()
    named = [r.getMessage() for r in caplog.records if "broken.jpg" in r.getMessage()]
    assert len(named) == 1, caplog.text
    assert data.skipped() == [str(root / "b" / "broken.jpg")]
    assert "1 of the 28 image files" in caplog.text

    strict, _, _ = image_folder_datasets(root, val_fraction=0.0, strict=True)
    bad = [i for i, (p, _) in enumerate(strict.samples) if p.endswith("broken.jpg")][0]
    with pytest.raises(ValueError, match="broken.jpg.*--strict-data"):
        strict[bad]


def test_val_fraction_holds_out_files_fixed_by_seed(tmp_path):
    root = mixed_folder(tmp_path)
    train, val, _ = image_folder_datasets(root, val_fraction=0.25)
    again_train, again_val, _ = image_folder_datasets(root, val_fraction=0.25)
    assert (len(train), len(val)) == (20, 7)
    assert val.samples == again_val.samples and train.samples == again_train.samples
    assert not set(p for p, _ in val.samples) & set(p for p, _ in train.samples)


def test_an_empty_folder_is_a_clear_error(tmp_path):
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises((ValueError, FileNotFoundError)):
        image_folder_datasets(tmp_path / "empty", val_fraction=0.0)


def _train(root, out, *extra):
    return subprocess.run([sys.executable, str(ROOT / "train_scripts" / "effnetv2_cls.py"), "--data", str(root),
                           "--variant", "b0", "--steps", "2", "--workers", "0", "--batch-size", "2",
                           "--out", str(out), *extra], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_effnetv2_script_trains_on_a_mixed_folder(tmp_path):
    tree = tmp_path / "tree"
    mixed_folder(tree, name="train")
    for c in "abc":  # val/: one image a class, and the corrupt file, all evaluated after the 2 steps
        (tree / "val" / c).mkdir(parents=True)
        Image.fromarray(_rgb(90, 70, ord(c))).save(tree / "val" / c / "one.jpg")
    (tree / "val" / "b" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 8)
    result = _train(tree, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "model.safetensors").is_file()
    assert result.stderr.count("broken.jpg") == 1, result.stderr[-3000:]
    assert "1 of the 4 image files" in result.stderr
    strict = _train(tree, tmp_path / "strict", "--strict-data")
    assert strict.returncode == 2 and "broken.jpg" in strict.stderr, strict.stderr[-3000:]


def test_diffusion_script_trains_on_a_mixed_folder(tmp_path):
    root = mixed_folder(tmp_path, corrupt=True)
    result = subprocess.run([sys.executable, str(ROOT / "train_scripts" / "diffusion_unet.py"), "--data", str(root),
                             "--widths", "8,8", "--image-size", "8", "--steps", "2", "--workers", "0",
                             "--batch-size", "2", "--val-fraction", "0", "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "model.safetensors").is_file()
