"""3D volumes: deterministic synthetic generators, and folders of .npy (or NIfTI) volume/label pairs.

Three generators, each deterministic per seed, each returning (image (1, D, H, W) float32, label (D, H, W) int64):

- `synthetic_volume`: the original one; classes told apart by a fixed intensity per class.
- `randomised_volume`: for training models that generalise; nested ellipsoids (class c + 1 always lies
  inside an object of class c, like a lesion in an organ), every appearance parameter drawn per volume, so
  only shape and context say which class a voxel is.
- `independent_volume`: for evaluation only (never train on it); the same nested label semantics as
  `randomised_volume`, built from other shapes, another intensity model and another noise model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo._deps import require

__all__ = ["synthetic_volume", "randomised_volume", "independent_volume", "GENERATORS", "SyntheticVolumes",
           "VolumeFolder", "read_volume", "write_labels", "volume_suffix"]


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


def _grid(shape: Sequence[int]) -> Tensor:
    """Voxel centres in [-1, 1]^3, (D, H, W, 3)."""
    return torch.stack(torch.meshgrid(*(torch.linspace(-1, 1, n) for n in shape), indexing="ij"), dim=-1)


def _smooth_noise(g: torch.Generator, shape: Sequence[int], coarse: int) -> Tensor:
    """Unit-scale random field, smooth over about 1/coarse of the volume: a coarse Gaussian grid, trilinear."""
    field = torch.randn(1, 1, coarse, coarse, coarse, generator=g)
    return F.interpolate(field, size=tuple(shape), mode="trilinear", align_corners=True)[0, 0]


def _box(grid: Tensor, centre: Tensor, extent: float) -> tuple[slice, ...]:
    """Index slices of the voxels within `extent` (grid units, along each axis) of `centre`: shapes are
    computed there only, which is what keeps generation cheap."""
    sizes = grid.shape[:3]
    box = []
    for axis, n in enumerate(sizes):
        lo = int(((float(centre[axis]) - extent + 1) / 2 * (n - 1)))
        hi = int(((float(centre[axis]) + extent + 1) / 2 * (n - 1))) + 2
        box.append(slice(min(max(lo, 0), n), min(max(hi, 0), n)))
    return tuple(box)


def _erode(mask: Tensor, voxels: int = 2) -> Tensor:
    """The voxels of a (D, H, W) mask at least `voxels` away (along each axis) from anything outside it; the
    volume's border does not count as outside."""
    outside = (~mask).float()[None, None]
    k = 2 * voxels + 1
    for size in ((k, 1, 1), (1, k, 1), (1, 1, k)):
        outside = F.max_pool3d(outside, size, stride=1, padding=[n // 2 for n in size])
    return outside[0, 0] == 0


def _margin(shape: Sequence[int]) -> int:
    """Voxels of its parent class kept around a nested object: 2 at 64^3, 1 below 48^3."""
    return max(1, round(min(shape) / 32))


def _fallback_child(label: Tensor, parents: list[Tensor], cls: int, margin: int) -> Tensor:
    """When no nested object of class `cls` survived clipping (tiny or border-cut parents), the largest
    parent's core becomes one, so that every class is present in every volume: the voxels `margin` deep in
    it, or its deepest voxels when it is thinner, or a single voxel of it when it is thinner still."""
    parent = max(parents, key=lambda m: int(m.sum()))
    inside = parent.nonzero()
    core = torch.zeros_like(parent)
    core[tuple(inside[len(inside) // 2])] = True
    for voxels in range(1, margin + 1):
        inner = _erode(parent, voxels)
        if not inner.any():
            break
        core = inner
    label[core] = cls
    return core


def _rotation(g: torch.Generator) -> Tensor:
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g))  # a random orthogonal matrix
    return q


def _gaussian_blur(image: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian blur of a (D, H, W) volume, sigma in voxels (replicate padding)."""
    if sigma < 0.3:
        return image
    radius = max(1, int(3 * sigma + 0.5))
    x = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (x / sigma) ** 2)
    kernel = kernel / kernel.sum()
    out = image[None, None]
    for axis in range(3):
        size = [1, 1, 1]
        size[axis] = kernel.numel()
        pad = [0] * 6
        pad[2 * (2 - axis)] = pad[2 * (2 - axis) + 1] = radius
        out = F.conv3d(F.pad(out, pad, mode="replicate"), kernel.view(1, 1, *size))
    return out[0, 0]


def _class_values(g: torch.Generator, num_classes: int, low: float, high: float, min_step: float) -> Tensor:
    """One intensity per class drawn uniformly from [low, high), each at least `min_step` from the one of the
    class it sits inside (class c is inside class c - 1; class 1 inside the background)."""
    values = [low + (high - low) * float(torch.rand((), generator=g))]
    for _ in range(1, num_classes):
        while True:
            v = low + (high - low) * float(torch.rand((), generator=g))
            if abs(v - values[-1]) >= min_step:
                break
        values.append(v)
    return torch.tensor(values)


def _ellipsoid(grid: Tensor, centre: Tensor, rotation: Tensor, radii: Tensor) -> Tensor:
    """Boolean (D, H, W) mask of the ellipsoid with these semi-axes along the columns of `rotation`."""
    mask = torch.zeros(grid.shape[:3], dtype=torch.bool)
    box = _box(grid, centre, float(radii.max()))
    mask[box] = (((grid[box] - centre) @ rotation / radii) ** 2).sum(-1) <= 1
    return mask


def randomised_volume(seed: int, shape: Sequence[int] = (64, 64, 64), num_classes: int = 3) -> tuple[Tensor, Tensor]:
    """A training volume whose appearance is drawn per volume, so a model must learn shape and context.

    Labels: 1 to 4 randomly rotated ellipsoids of class 1 ("organs", radii 0.15-0.45 of the half-side) on
    background 0; inside them smaller ellipsoids of class 2 ("lesions", 0-2 per organ, the first organ always
    holds one, clipped to keep two voxels of organ around them at 64^3), and so on: class c + 1 always lies inside class c, so with the default
    num_classes=3 the task is background / organ / lesion-in-organ, every class present in every volume.

    Image: one intensity per class drawn per volume (no fixed order: a lesion may be brighter or darker than
    its organ, an organ than the background, each step at least 0.3), then a Gaussian blur of random width
    (0-1.5 voxels, partial volume), a smooth multiplicative bias field (up to about +-50%), contrast
    inversion with probability 1/2, additive Gaussian noise of random level (0.01-0.35) and a random global
    scale (0.5-2) and offset (+-1)."""
    g = torch.Generator().manual_seed(seed)
    grid = _grid(shape)
    label = torch.zeros(tuple(shape), dtype=torch.long)
    parents: list[tuple[Tensor, Tensor, Tensor]] = []  # (mask, centre, radii) of the previous level
    for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
        centre = torch.rand(3, generator=g) * 1.2 - 0.6
        radii = torch.rand(3, generator=g) * 0.3 + 0.15
        mask = _ellipsoid(grid, centre, _rotation(g), radii)
        label[mask] = 1
        parents.append((mask, centre, radii))
    margin = _margin(shape)
    for cls in range(2, num_classes):
        children = []
        for i, (parent, centre, radii) in enumerate(parents):
            core = _erode(parent, margin)  # children keep `margin` voxels of their parent around them
            for _ in range(int(torch.randint(1 if i == 0 else 0, 3, (1,), generator=g))):
                # a child ellipsoid 35-65% of its parent's size, centred within the inner half of the parent
                offset = (torch.rand(3, generator=g) * 2 - 1) * radii * 0.5
                child_radii = radii * (torch.rand(3, generator=g) * 0.3 + 0.35)
                child_centre = centre + offset
                mask = core & _ellipsoid(grid, child_centre, _rotation(g), child_radii)
                if mask.any():
                    label[mask] = cls
                    children.append((mask, child_centre, child_radii))
        if not children:
            children.append((_fallback_child(label, [m for m, *_ in parents], cls, margin), centre, radii))
        parents = children
    values = _class_values(g, num_classes, -1.0, 1.0, min_step=0.3)
    image = values[label]
    image = _gaussian_blur(image, 1.5 * float(torch.rand((), generator=g)))
    bias = 0.4 * float(torch.rand((), generator=g)) * _smooth_noise(g, shape, 4)
    image = (image + 1.5) * torch.exp(bias) - 1.5  # multiplicative on positive intensities, back to about [-1, 1]
    if torch.rand((), generator=g) < 0.5:
        image = -image
    noise = 0.01 + 0.34 * float(torch.rand((), generator=g))
    image = image + noise * torch.randn(tuple(shape), generator=g)
    scale = 0.5 * 4 ** float(torch.rand((), generator=g))
    image = scale * image + (2 * float(torch.rand((), generator=g)) - 1)
    return image[None].float(), label


def independent_volume(seed: int, shape: Sequence[int] = (64, 64, 64), num_classes: int = 3) -> tuple[Tensor, Tensor]:
    """An evaluation volume from a generator written separately from `randomised_volume`: never train on it.

    Same label semantics: class 1 objects ("organs") on background 0, class c + 1 always inside class c, every
    class present. What differs:

    - shapes: organs are irregular lobed blobs, a sphere whose radius is modulated by a thresholded smoothed
      noise field (not ellipsoids); the nested objects are rotated cubes or tori, centred on a random voxel
      of their parent and clipped to keep two voxels of it around them;
    - intensity model: positive intensities as in magnitude MR, a log-normal background level and each
      class a random *ratio* (x/÷ 1.5-3.3) of the one it lies in, plus a multiplicative texture inside every
      class (5% - 20%, finer than the bias field); no contrast inversion, no global offset;
    - degradation: an anisotropic "thick slice" box blur along one random axis (1-3 voxels) instead of an
      isotropic Gaussian, a linear intensity ramp (up to +-30%) instead of a smooth random bias field;
    - noise model: Rician (the magnitude of complex Gaussian noise) or Poisson (photon counting), chosen
      per volume, instead of additive Gaussian."""
    g = torch.Generator().manual_seed(seed)
    grid = _grid(shape)
    label = torch.zeros(tuple(shape), dtype=torch.long)
    parents: list[Tensor] = []
    for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
        centre = torch.rand(3, generator=g) * 1.0 - 0.5
        radius = 0.2 + 0.25 * float(torch.rand((), generator=g))
        lobes = _smooth_noise(g, shape, 5).clamp(-2, 2)
        mask = torch.zeros(tuple(shape), dtype=torch.bool)
        box = _box(grid, centre, radius * 1.6)
        mask[box] = (grid[box] - centre).norm(dim=-1) <= radius * (1 + 0.3 * lobes[box])
        if not mask.any():
            continue
        label[mask] = 1
        parents.append(mask)
    if not parents:  # every blob fell outside the volume (rare): one in the middle
        mask = grid.norm(dim=-1) <= 0.3
        label[mask] = 1
        parents.append(mask)
    margin = _margin(shape)
    for cls in range(2, num_classes):
        children = []
        for i, parent in enumerate(parents):
            core = _erode(parent, margin)  # children keep `margin` voxels of their parent around them
            inside = core.nonzero()
            for _ in range(0 if len(inside) == 0 else int(torch.randint(1 if i == 0 else 0, 3, (1,), generator=g))):
                voxel = inside[int(torch.randint(0, len(inside), (1,), generator=g))]
                centre = grid[tuple(voxel)]
                size = 2 * float(inside.shape[0] / label.numel()) ** (1 / 3)  # the parent's extent, grid units
                rotation = _rotation(g)
                shape_mask = torch.zeros(tuple(shape), dtype=torch.bool)
                if torch.rand((), generator=g) < 0.5:  # a cube of half-side 0.2-0.35 of the parent's extent
                    half = size * (0.2 + 0.15 * float(torch.rand((), generator=g)))
                    box = _box(grid, centre, half * 1.75)
                    shape_mask[box] = ((grid[box] - centre) @ rotation).abs().amax(-1) <= half
                else:  # a torus: ring radius 0.2-0.35, tube radius 0.1-0.2 of the parent's extent
                    ring = size * (0.2 + 0.15 * float(torch.rand((), generator=g)))
                    tube = size * (0.1 + 0.1 * float(torch.rand((), generator=g)))
                    box = _box(grid, centre, ring + tube)
                    local = (grid[box] - centre) @ rotation
                    shape_mask[box] = (local[..., :2].norm(dim=-1) - ring) ** 2 + local[..., 2] ** 2 <= tube ** 2
                mask = core & shape_mask
                mask[tuple(voxel)] = True  # never empty
                label[mask] = cls
                children.append(mask)
        if not children:
            children.append(_fallback_child(label, parents, cls, margin))
        parents = children
    levels = [float(torch.exp(0.4 * torch.randn((), generator=g)))]
    for _ in range(1, num_classes):
        ratio = 1.5 + 1.8 * float(torch.rand((), generator=g))
        levels.append(levels[-1] * (ratio if torch.rand((), generator=g) < 0.5 else 1 / ratio))
    texture = 0.05 + 0.15 * float(torch.rand((), generator=g))
    image = torch.tensor(levels)[label] * (1 + texture * _smooth_noise(g, shape, 12))
    axis, width = int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    if width > 1:
        kernel = [1, 1, 1]
        kernel[axis] = width
        image = F.avg_pool3d(image[None, None], kernel, stride=1, padding=[k // 2 for k in kernel],
                             count_include_pad=False)[0, 0][:shape[0], :shape[1], :shape[2]]
    direction = torch.nn.functional.normalize(torch.randn(3, generator=g), dim=0)
    image = image * (1 + 0.3 * float(torch.rand((), generator=g)) * (grid @ direction))
    scale = sum(levels) / len(levels)
    if torch.rand((), generator=g) < 0.5:  # Rician: |signal + complex Gaussian noise|
        sigma = scale * (0.05 + 0.2 * float(torch.rand((), generator=g)))
        real = image + sigma * torch.randn(tuple(shape), generator=g)
        image = torch.sqrt(real ** 2 + (sigma * torch.randn(tuple(shape), generator=g)) ** 2)
    else:  # Poisson: counts at a random photon budget, rescaled
        photons = 10 + 90 * float(torch.rand((), generator=g)) / scale
        image = torch.poisson(image.clamp_min(0) * photons, generator=g) / photons
    return image[None].float(), label


GENERATORS = {"synthetic": synthetic_volume, "synthetic-random": randomised_volume, "unseen": independent_volume}


class SyntheticVolumes(torch.utils.data.Dataset):
    """Volumes from a generator (`synthetic_volume` by default, or a name in GENERATORS) for seeds
    first_seed .. first_seed + n - 1 (held-out sets use other seeds)."""

    def __init__(self, n: int, first_seed: int = 0, shape: Sequence[int] = (64, 64, 64), num_classes: int = 3,
                 transform=None, generator: str = "synthetic"):
        if generator not in GENERATORS:
            raise ValueError(f"unknown volume generator {generator!r}; choose {', '.join(GENERATORS)}")
        self.n, self.first_seed, self.shape, self.num_classes, self.transform = n, first_seed, tuple(shape), num_classes, transform
        self.generator = generator

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        image, label = GENERATORS[self.generator](self.first_seed + i, self.shape, self.num_classes)
        return self.transform(image, label) if self.transform else (image, label)


class VolumeFolder(torch.utils.data.Dataset):
    """Pairs NAME.npy + NAME_label.npy (or NAME.nii[.gz] + NAME_label.nii[.gz], with nibabel) in a folder, each
    read when its item is asked for (in the DataLoader's workers): image (C, D, H, W) or (D, H, W), label
    (D, H, W). Only the file names are listed up front, so memory does not grow with the number of volumes."""

    def __init__(self, folder: str | Path, transform=None):
        from zoo._io import existing
        folder = existing(folder, "dir", "volume folder", "a folder of NAME.npy + NAME_label.npy pairs")
        self.pairs = []
        for image in sorted(folder.iterdir()):
            name, suffix = image.name, volume_suffix(image)
            if suffix is None or name[: -len(suffix)].endswith("_label"):
                continue
            label = folder / (name[: -len(suffix)] + "_label" + name[-len(suffix):])  # the image's own spelling
            if not label.is_file():
                raise FileNotFoundError(f"{image} has no label file {label.name}")
            self.pairs.append((image, label))
        if not self.pairs:
            raise ValueError(f"{folder} holds no NAME.npy / NAME_label.npy pairs")
        if any(volume_suffix(image) != ".npy" for image, _ in self.pairs):
            _nibabel()  # a missing package said once, here, not in every worker
        self.transform = transform

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        image, label = (torch.as_tensor(read_volume(p)[0]) for p in self.pairs[i])
        image = image.float()[None] if image.dim() == 3 else image.float()
        label = label.long()
        return self.transform(image, label) if self.transform else (image, label)


# ---------------------------------------------------------------------- volume files: .npy and NIfTI

SUFFIXES = (".npy", ".nii.gz", ".nii")


def volume_suffix(path: str | Path) -> str | None:
    """".npy", ".nii.gz" or ".nii" (case-insensitive), or None for any other file."""
    name = str(path).lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def _nibabel():
    return require("nibabel", "reading and writing NIfTI volumes", "pip install nibabel")


def read_volume(path: str | Path, what: str = "volume"):
    """(array, NIfTI image or None) of a volume file. The array is in zoo's layout, (D, H, W) or (C, D, H, W):
    a NIfTI's voxel axes (i, j, k) are D, H, W, and a 4D NIfTI's last axis is the channels. The NIfTI image
    (data not loaded) carries the affine and header that `write_labels` gives a prediction; .npy has none."""
    import numpy as np
    from zoo._io import existing, load_npy
    if volume_suffix(path) in (None, ".npy"):  # any other name is read as .npy, and named if it is not one
        return load_npy(path, what), None
    nibabel = _nibabel()
    path = existing(path, "file", what, "a NIfTI file (.nii or .nii.gz)")
    try:
        image = nibabel.load(str(path))
        array = np.asarray(image.dataobj)  # the header's scaling (scl_slope, scl_inter) applied
    except Exception as e:  # nibabel's errors for broken files have no common base class
        raise ValueError(f"{what} {str(path)!r} is not a readable NIfTI file ({type(e).__name__}: {e})") from None
    if array.ndim == 4:
        array = np.moveaxis(array, -1, 0)  # (i, j, k, c) -> (c, i, j, k)
    return array, image


def write_labels(path: str | Path, labels, like=None) -> Path:
    """Write a label volume (D, H, W) as uint8, atomically: NIfTI when `path` ends in .nii or .nii.gz, with the
    affine, voxel sizes and orientation codes of `like` (the input's NIfTI image from `read_volume`; None: an
    identity affine), else .npy. -> the path written."""
    import gzip
    import io

    import numpy as np
    from zoo._io import atomic_write_bytes
    labels = np.asarray(labels).astype(np.uint8)
    suffix = volume_suffix(path)
    if suffix in (".nii", ".nii.gz"):
        nibabel = _nibabel()
        header = like.header.copy() if like is not None else None
        image = nibabel.Nifti1Image(labels, like.affine if like is not None else np.eye(4), header=header)
        image.set_data_dtype(np.uint8)
        image.header.set_slope_inter(1.0, 0.0)  # the input's intensity scaling must not rescale labels
        image.header["cal_min"] = image.header["cal_max"] = 0  # nor its display window apply to them
        if like is not None:  # Nifti1Image derives both from `affine`; keep the input's own codes and qform
            image.set_qform(like.get_qform(), int(like.header["qform_code"]))
            image.set_sform(like.get_sform(), int(like.header["sform_code"]))
        data = image.to_bytes()
        atomic_write_bytes(path, gzip.compress(data, mtime=0) if suffix == ".nii.gz" else data)
    else:
        buffer = io.BytesIO()
        np.save(buffer, labels)
        atomic_write_bytes(path, buffer.getvalue())
    return Path(path)
