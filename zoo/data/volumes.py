"""3D volumes: a deterministic synthetic generator, and folders of .npy (or NIfTI) volume/label pairs."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["synthetic_volume", "SyntheticVolumes", "VolumeFolder"]


def synthetic_volume(seed: int, shape: Sequence[int] = (64, 64, 64), num_classes: int = 3,
                     objects: int = 6) -> tuple[Tensor, Tensor]:
    """(image (1, D, H, W) float32, label (D, H, W) int64): random ellipsoids of classes 1..num_classes-1 on
    background 0, each class with its own mean intensity (jittered per volume), plus a smooth bias field and
    noise. The seed fixes all."""
    g = torch.Generator().manual_seed(seed)
    D, H, W = shape
    grid = torch.stack(torch.meshgrid(*(torch.linspace(-1, 1, n) for n in shape), indexing="ij"), dim=-1)
    label = torch.zeros(shape, dtype=torch.long)
    for _ in range(objects):
        cls = int(torch.randint(1, num_classes, (1,), generator=g))
        centre = (torch.rand(3, generator=g) * 1.2 - 0.6)
        radii = torch.rand(3, generator=g) * 0.25 + 0.12
        # a random rotation of the ellipsoid axes (QR of a Gaussian matrix)
        q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g))
        local = (grid - centre) @ q
        label[((local / radii) ** 2).sum(-1) <= 1] = cls
    # each class keeps its own intensity (as tissues do in CT), shifted a little per volume; a random
    # permutation per volume would leave nothing that tells class 1 from class 2
    means = torch.linspace(-1.0, 1.0, num_classes) + 0.1 * torch.randn(num_classes, generator=g)
    image = means[label]
    coarse = torch.randn(1, 1, 4, 4, 4, generator=g) * 0.3  # smooth intensity field
    image = image + F.interpolate(coarse, size=shape, mode="trilinear", align_corners=True)[0, 0]
    image = image + 0.25 * torch.randn(shape, generator=g)
    return image[None].float(), label


class SyntheticVolumes(torch.utils.data.Dataset):
    """Volumes from `synthetic_volume` for seeds first_seed .. first_seed + n - 1 (held-out sets use other seeds)."""

    def __init__(self, n: int, first_seed: int = 0, shape: Sequence[int] = (64, 64, 64), num_classes: int = 3,
                 transform=None):
        self.n, self.first_seed, self.shape, self.num_classes, self.transform = n, first_seed, tuple(shape), num_classes, transform

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        image, label = synthetic_volume(self.first_seed + i, self.shape, self.num_classes)
        return self.transform(image, label) if self.transform else (image, label)


class VolumeFolder(torch.utils.data.Dataset):
    """Pairs NAME.npy + NAME_label.npy (or .nii/.nii.gz with nibabel) in a folder; image (C, D, H, W) or (D, H, W)."""

    def __init__(self, folder: str | Path, transform=None):
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"volume folder {str(folder)!r} does not exist")
        suffixes = (".npy", ".nii", ".nii.gz")
        self.pairs = []
        for image in sorted(folder.iterdir()):
            name = image.name
            suffix = next((s for s in suffixes if name.endswith(s)), None)
            if suffix is None or name[: -len(suffix)].endswith("_label"):
                continue
            label = folder / (name[: -len(suffix)] + "_label" + suffix)
            if not label.is_file():
                raise FileNotFoundError(f"{image} has no label file {label.name}")
            self.pairs.append((image, label))
        if not self.pairs:
            raise ValueError(f"{folder} holds no NAME.npy / NAME_label.npy pairs")
        self.transform = transform

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        image, label = (torch.as_tensor(_read(p)) for p in self.pairs[i])
        image = image.float()[None] if image.dim() == 3 else image.float()
        label = label.long()
        return self.transform(image, label) if self.transform else (image, label)


def _read(path: Path):
    import numpy as np
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    try:
        import nibabel
    except ImportError:
        raise RuntimeError(f"{path} is NIfTI: pip install nibabel to read it") from None
    return np.asarray(nibabel.load(str(path)).dataobj)
