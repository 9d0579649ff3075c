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
