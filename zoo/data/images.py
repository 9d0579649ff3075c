"""Image loading and transforms shared by the image families' predict and training."""
from __future__ import annotations

from pathlib import Path

__all__ = ["open_image", "eval_transform"]


def open_image(source):
    """A PIL RGB image from a path or PIL image; grey-scale, palette and RGBA are converted."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"image {str(path)!r} does not exist")
    try:
        with Image.open(path) as im:
            if im.mode in ("RGBA", "LA", "P"):
                im = im.convert("RGBA")
                background = Image.new("RGBA", im.size, (255, 255, 255, 255))
                return Image.alpha_composite(background, im).convert("RGB")  # transparent -> white
            return im.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"{str(path)!r} is not an image file Pillow can read (JPEG, PNG, BMP, ...)") from None


def eval_transform(pre: dict):
    """Resize the short side, centre-crop, to tensor, normalise: from a weights' preprocessing dict."""
    from torchvision.transforms import v2 as T
    import torch
    interpolation = T.InterpolationMode(pre.get("interpolation", "bilinear"))
    return T.Compose([T.PILToTensor(), T.Resize(pre["resize"], interpolation=interpolation, antialias=True),
                      T.CenterCrop(pre["crop"]), T.ToDtype(torch.float32, scale=True),
                      T.Normalize(pre["mean"], pre["std"])])


class ArrayImages:
    """uint8 images (N, H, W, C) with integer labels, as a map-style dataset of (transformed image, label)."""

    def __init__(self, images, labels, transform=None):
        import numpy as np
        if images.ndim != 4 or images.dtype != np.uint8:
            raise ValueError(f"images must be uint8 (N, H, W, C); got {images.dtype} {images.shape}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels, self.transform = images, [int(v) for v in labels], transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        import torch
        x = torch.from_numpy(self.images[i]).permute(2, 0, 1)  # (C, H, W) uint8
        return (self.transform(x) if self.transform else x), self.labels[i]


def load_image_split(path: str | Path, split: str):
    """(images as uint8 (N, H, W, C) or an ImageFolder, labels, class names) for `split` in train|test.

    An .npz holds x_train/y_train (and x_test/y_test, class_names); a folder is an ImageFolder tree
    (one sub-folder per class), with `split` sub-folders if it has them.
    """
    import numpy as np
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data {str(path)!r} does not exist; give an ImageFolder directory or an .npz")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            if f"x_{split}" not in data:
                raise ValueError(f"{path} has no x_{split} array (it has {', '.join(data.files)})")
            x, y = data[f"x_{split}"], data[f"y_{split}"]
            names = [str(n) for n in data["class_names"]] if "class_names" in data else None
        names = names or [str(i) for i in range(int(y.max()) + 1)]
        return x, y, names
    if path.is_dir():
        from torchvision.datasets import ImageFolder
        root = path / split if (path / split).is_dir() else path
        folder = ImageFolder(str(root), loader=open_image)
        if not folder.samples:
            raise ValueError(f"{root} holds no images in class sub-folders")
        images = np.stack([np.asarray(open_image(p)) for p, _ in folder.samples]) if _same_size(folder) else None
        if images is None:
            raise ValueError(f"{root}: images differ in size; resize them to one size first (e.g. 224x224)")
        return images, np.array(folder.targets), list(folder.classes)
    raise ValueError(f"{path}: expected an ImageFolder directory or an .npz file")


def _same_size(folder) -> bool:
    from PIL import Image
    sizes = {Image.open(p).size for p, _ in folder.samples[:256]}
    return len(sizes) == 1


def train_transform(size: int, *, small: bool, augment: str = "trivial", mean=None, std=None):
    """Training augmentation on uint8 (C, H, W) tensors: pad-crop (small images) or random-resized-crop,
    flip, TrivialAugment / RandAugment, then normalise."""
    import torch
    from torchvision.transforms import v2 as T
    ops = [T.RandomCrop(size, padding=size // 8, padding_mode="reflect") if small
           else T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()]
    if augment == "trivial":
        ops.append(T.TrivialAugmentWide())
    elif augment == "randaugment":
        ops.append(T.RandAugment())
    elif augment != "none":
        raise ValueError(f"unknown --augment {augment!r}; choose trivial, randaugment or none")
    return T.Compose(ops + [T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)])


def tensor_eval_transform(size: int, *, small: bool, mean, std):
    """Evaluation on uint8 (C, H, W) tensors: as-is for small images, resize + centre-crop otherwise."""
    import torch
    from torchvision.transforms import v2 as T
    ops = [] if small else [T.Resize(int(size * 256 / 224), antialias=True), T.CenterCrop(size)]
    return T.Compose(ops + [T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)])
