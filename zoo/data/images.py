"""Image loading and transforms shared by the image families' predict and training."""
from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["open_image", "eval_transform", "load_image_split", "load_train_and_held_out", "MissingSplit",
           "ImageFiles", "image_folder_datasets", "run_counting_skipped"]

log = logging.getLogger(__name__)
HELD_OUT_SPLITS = ("test", "val")  # an ImageFolder's held-out sub-folder, first found


class MissingSplit(ValueError):
    """The data has no such split (an .npz without x_test, an ImageFolder without test/ or val/)."""


def _high_depth_to_8bit(im):
    """16-bit ("I;16*", and "I", which 16-bit PNGs open as in some Pillow versions) and float ("F") grey
    images as 8-bit "L". Pillow's own convert clips them at 255, so a 16-bit image would turn almost white.
    Integers are taken as 0..65535; floats as 0..1 when none exceeds 1, else as 0..255."""
    import numpy as np
    from PIL import Image
    a = np.asarray(im, dtype=np.float64)
    if im.mode == "F":
        bad = int((~np.isfinite(a)).sum())
        if bad:
            raise ValueError(f"the float image has {bad} non-finite (NaN or Inf) pixel(s)")
        scale = 255.0 if a.max(initial=0) <= 1.0 else 1.0
    else:
        scale = 255.0 / 65535.0
    return Image.fromarray(np.clip(np.rint(a * scale), 0, 255).astype(np.uint8), mode="L")


class UndecodableImage(ValueError):
    """An image file Pillow opened but could not decode; `reason` is Pillow's error."""

    def __init__(self, message: str, reason: Exception):
        super().__init__(message)
        self.reason = reason


def open_image(source):
    """A PIL RGB image from a path, a binary file object (named by its str in errors) or a PIL image;
    grey-scale (8-bit, 16-bit or float), palette, CMYK and RGBA (onto white) are converted; a file's EXIF
    orientation is applied."""
    from PIL import Image, ImageOps, UnidentifiedImageError
    if isinstance(source, Image.Image):
        if source.mode.startswith("I") or source.mode == "F":
            source = _high_depth_to_8bit(source)
        return source.convert("RGB")
    from zoo._io import existing
    path = source if hasattr(source, "read") else existing(source, "file", "image",
                                                            "an image file (JPEG, PNG, BMP, ...)")
    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im)  # phones store portrait photos landscape, with an EXIF rotation
            if im.mode in ("RGBA", "LA", "P", "PA"):
                im = im.convert("RGBA")
                background = Image.new("RGBA", im.size, (255, 255, 255, 255))
                return Image.alpha_composite(background, im).convert("RGB")  # transparent -> white
            if im.mode.startswith("I") or im.mode == "F":
                return _high_depth_to_8bit(im).convert("RGB")
            return im.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"{str(path)!r} is not an image file Pillow can read (JPEG, PNG, BMP, ...)") from None
    except Image.DecompressionBombError:
        raise ValueError(f"{str(path)!r} has more than {2 * Image.MAX_IMAGE_PIXELS:,} pixels, too many to decode "
                         "safely (Pillow's decompression-bomb limit); resize it first, or raise "
                         "PIL.Image.MAX_IMAGE_PIXELS if you trust the file") from None
    except OSError as e:  # a truncated JPEG/PNG
        raise UndecodableImage(f"{str(path)!r} could not be decoded ({e}); is the file truncated?", e) from None
    except ValueError as e:
        raise ValueError(f"{str(path)!r}: {e}") from None


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
    """(images as uint8 (N, H, W, C), labels, class names) for `split` in train|test.

    An .npz holds x_train/y_train (and x_test/y_test, class_names); a folder is an ImageFolder tree
    (one sub-folder per class), with train/ and test/ (or val/) sub-folders if it has them. A missing
    test split raises MissingSplit (`load_train_and_held_out` then holds out training images instead).
    """
    import numpy as np
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data {str(path)!r} does not exist; give an ImageFolder directory or an .npz")
    if path.suffix == ".npz" and path.is_dir():
        raise ValueError(f"data {str(path)!r} is a directory named .npz; give an .npz file or rename the "
                                "ImageFolder directory")
    if path.suffix == ".npz":
        try:
            data = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{path} is not a readable .npz archive ({type(e).__name__}); write it with "
                             "numpy.savez(path, x_train=..., y_train=...)") from None
        with data:
            if f"x_{split}" not in data:
                raise MissingSplit(f"{path} has no x_{split} array (it has {', '.join(data.files) or 'none'})")
            if f"y_{split}" not in data:
                raise ValueError(f"{path} has x_{split} but no y_{split} (the labels; it has "
                                 f"{', '.join(data.files)}); save the integer labels as y_{split}")
            try:
                x, y = data[f"x_{split}"], data[f"y_{split}"]
                names = [str(n) for n in data["class_names"]] if "class_names" in data else None
            except ValueError:  # an object array: loading it would unpickle
                raise ValueError(f"{path} holds Python objects in x_{split}, y_{split} or class_names; save "
                                 "numeric arrays (class_names as strings)") from None
        if y.dtype.kind not in "iu" or y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"{path}: y_{split} must be one integer class id per image of x_{split} ({len(x)}), "
                             f"got {y.dtype} of shape {y.shape}")
        if len(y) and int(y.min()) < 0:
            raise ValueError(f"{path}: y_{split} holds negative label {int(y.min())}; class ids run 0..C-1")
        names = names or [str(i) for i in range(int(y.max()) + 1 if len(y) else 0)]
        if len(y) and int(y.max()) >= len(names):
            raise ValueError(f"{path}: y_{split} holds label {int(y.max())} but class_names names {len(names)} "
                             f"classes (0..{len(names) - 1})")
        return x, y, names
    if path.is_dir():
        root, folder = _folder_split(path, split)
        images = np.stack([np.asarray(open_image(p)) for p, _ in folder.samples]) if _same_size(folder) else None
        if images is None:
            raise ValueError(f"{root}: images differ in size; resize them to one size first (e.g. 224x224)")
        return images, np.array(folder.targets), list(folder.classes)
    raise ValueError(f"{path}: expected an ImageFolder directory or an .npz file")


def load_train_and_held_out(path: str | Path, *, val_fraction: float, eval_path: str | Path | None = None,
                            seed: int = 0):
    """(x_train, y_train, x_val, y_val, class names): the held-out set from `eval_path`'s test split, else
    from `path`'s own (x_test / test/ / val/), else `val_fraction` of the training images drawn at random
    with a fixed `seed` (0: no evaluation, x_val and y_val None). Logs which one it used."""
    import numpy as np
    _check_val_fraction(val_fraction)
    x, y, names = load_image_split(path, "train")
    held, split = _held_out(lambda: load_image_split(eval_path or path, "test"), len(x), val_fraction=val_fraction,
                            eval_path=eval_path, path=path, seed=seed)
    if held is not None:
        return x, y, held[0], held[1], names
    if split is None:
        return x, y, None, None, names
    train, val = split
    y = np.asarray(y)
    return x[train], y[train], x[val], y[val], names


def _check_val_fraction(val_fraction: float) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction is the share of training images held out, in [0, 1); got {val_fraction}")


def _held_out(load_test, n: int, *, val_fraction: float, eval_path, path, seed: int):
    """The one rule for the evaluation set, for arrays and folders alike: (held, None) with held = load_test(),
    `eval_path`'s or `path`'s own test split, when there is one; else (None, (train indices, held-out indices))
    for `val_fraction` of the `n` training images; (None, None) for --val-fraction 0. Logs which."""
    try:
        held = load_test()
        log.info("evaluating on the held-out split of %s", eval_path or path)
        return held, None
    except MissingSplit as e:
        if eval_path:
            raise
        reason = str(e)
    if val_fraction == 0:
        log.info("%s; --val-fraction 0: no evaluation, no metrics stored", reason)
        return None, None
    return None, _hold_out(n, val_fraction, seed, path, reason)


def _hold_out(n: int, val_fraction: float, seed: int, path, reason: str):
    """(train indices, held-out indices), sorted: `val_fraction` of `n` drawn with a fixed `seed`."""
    import numpy as np
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ValueError(f"{path}: {n} images are too few to hold out {val_fraction:.0%} and still train")
    order = np.random.default_rng(seed).permutation(n)
    log.info("%s; holding out %d of its %d training images (--val-fraction %g, seed %d) for evaluation",
             reason, n_val, n, val_fraction, seed)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def _folder_split(path: Path, split: str):
    """(root, torchvision ImageFolder) of `split` in train|test of an ImageFolder tree; files listed, none read."""
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import IMG_EXTENSIONS
    if split == "train":
        root = path / split if (path / split).is_dir() else path
    else:  # never the training images themselves: scores on them would be stored as held-out metrics
        found = [path / name for name in HELD_OUT_SPLITS if (path / name).is_dir()]
        if not found:
            raise MissingSplit(f"{path} has no {' or '.join(f'{n}/' for n in HELD_OUT_SPLITS)} sub-folder")
        root = found[0]
    if not any(d.is_dir() for d in root.iterdir()):
        raise ValueError(f"{root} has no class sub-folders; an ImageFolder holds one sub-folder of images per "
                         f"class ({root / 'cat' / '1.jpg'}, {root / 'dog' / '2.jpg'}, ...)")
    folder = ImageFolder(str(root), loader=open_image, allow_empty=True)
    empty = sorted(set(folder.classes) - {folder.classes[t] for t in folder.targets})
    if empty:  # a class without examples could never be predicted, and its metrics would be nonsense
        raise ValueError(f"{root}: class folder(s) {', '.join(map(repr, empty))} hold no images "
                         f"({', '.join(IMG_EXTENSIONS)}); add images or remove the folder(s)")
    return root, folder


# Pillow's ways of saying a file is not a readable image (broken headers, truncated data, bombs)
_UNDECODABLE = (OSError, ValueError, SyntaxError, EOFError)


class ImageFiles:
    """Image files with integer labels, as a map-style dataset of (transformed image, label), decoded one by
    one in `__getitem__` (so in the DataLoader's workers): memory does not grow with the number of files.

    Each file goes through `open_image` (any size and mode, EXIF orientation applied) to a uint8 (C, H, W)
    tensor, then `transform`. A file that cannot be decoded is named in one warning (once across workers)
    and the next file stands in for it; `skipped()` lists them for the count at the end. `strict=True`
    makes such a file an error instead.
    """

    def __init__(self, samples: list[tuple[str, int]], transform=None, *, strict: bool = False, root=None):
        import multiprocessing
        if not samples:
            raise ValueError(f"{root or 'the image folder'} holds no images")
        self.samples, self.transform, self.strict, self.root = list(samples), transform, strict, root
        self.labels = [int(label) for _, label in self.samples]
        # one byte per file, shared with the workers (inherited or sent when they start): 1 = undecodable
        self._bad = multiprocessing.Array("b", len(self.samples))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        import numpy as np
        import torch
        for j in range(len(self.samples)):  # an undecodable file: the next one stands in for it
            k = (i + j) % len(self.samples)
            if self._bad[k]:
                continue
            path, label = self.samples[k]
            try:
                image = open_image(path)
            except _UNDECODABLE as e:
                self._mark_bad(k, e)
                continue
            x = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # (C, H, W) uint8
            return (self.transform(x) if self.transform else x), label
        raise RuntimeError(f"none of the {len(self.samples)} images under {self.root} could be decoded")

    def _mark_bad(self, k: int, error: Exception) -> None:
        path = self.samples[k][0]
        error = error.reason if isinstance(error, UndecodableImage) else error  # its message names the path too
        if self.strict:
            raise ValueError(f"{path} cannot be decoded ({error}); remove it, or drop --strict-data to skip "
                             "such files with a warning") from None
        with self._bad.get_lock():
            first = not self._bad[k]
            self._bad[k] = 1
        if first:
            log.warning("skipping %s: it cannot be decoded (%s)", path, error)

    def skipped(self) -> list[str]:
        """The files found undecodable so far (by any worker)."""
        return [self.samples[k][0] for k, bad in enumerate(self._bad[:]) if bad]

    def log_skipped(self) -> None:
        """One warning with the count of skipped files, if any (at the end of a run)."""
        bad = self.skipped()
        if bad:
            log.warning("%d of the %d image files under %s could not be decoded and were skipped",
                        len(bad), len(self.samples), self.root)


def image_folder_datasets(path: str | Path, *, val_fraction: float, eval_path: str | Path | None = None,
                          seed: int = 0, strict: bool = False):
    """(training ImageFiles, held-out dataset or None, class names) of an ImageFolder tree, lazily decoded.

    The held-out set is chosen as `load_train_and_held_out` chooses it: `eval_path`'s test split (an
    ImageFolder's test/ or val/, or an .npz's x_test as an in-memory `ArrayImages`), else `path`'s own
    test/ or val/, else `val_fraction` of the training files with a fixed `seed` (0: None). Transforms
    are left unset: assign `.transform` on each.
    """
    _check_val_fraction(val_fraction)
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: expected an ImageFolder directory")
    root, folder = _folder_split(path, "train")
    names = list(folder.classes)
    train = ImageFiles(folder.samples, strict=strict, root=root)
    source = Path(eval_path) if eval_path else path

    def load_test():
        if source.is_dir():
            held_root, held = _folder_split(source, "test")
            if list(held.classes) != names:  # ImageFolder numbers classes by name: they must be the same
                raise ValueError(f"{held_root} has classes {held.classes} but {root} has {names}")
            return ImageFiles(held.samples, strict=strict, root=held_root)
        x, y, _ = load_image_split(source, "test")
        return ArrayImages(x, y)
    held_out, split = _held_out(load_test, len(train), val_fraction=val_fraction, eval_path=eval_path, path=path,
                                seed=seed)
    if held_out is not None or split is None:
        return train, held_out, names
    kept, val = split
    samples = train.samples
    return (ImageFiles([samples[i] for i in kept], strict=strict, root=root),
            ImageFiles([samples[i] for i in val], strict=strict, root=root), names)


def run_counting_skipped(run, cfg, build_task):
    """`run(cfg, build_task)` of a train script, then one warning per ImageFolder split of its task that had
    undecodable files, with their count (also when the run stops with an error)."""
    folders = []

    def build(cfg):
        task = build_task(cfg)
        folders.extend(d for d in (task.train_data, task.eval_data) if isinstance(d, ImageFiles))
        return task

    try:
        return run(cfg, build)
    finally:
        for data in folders:
            data.log_skipped()


def _same_size(folder) -> bool:
    from PIL import Image, UnidentifiedImageError
    sizes = set()
    for p, _ in folder.samples[:256]:
        try:
            with Image.open(p) as im:
                sizes.add(im.size)
        except (UnidentifiedImageError, Image.DecompressionBombError):
            open_image(p)  # raises the one-line error naming the file
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


def tensor_eval_transform(size: int, *, small: bool, mean, std, resize: int | None = None):
    """Evaluation on uint8 (C, H, W) tensors: as-is for small images, resize the short side (`resize`,
    default size * 256/224) + centre-crop otherwise."""
    import torch
    from torchvision.transforms import v2 as T
    ops = [] if small else [T.Resize(resize or int(size * 256 / 224), antialias=True), T.CenterCrop(size)]
    return T.Compose(ops + [T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)])


class ProgressiveResize:
    """EfficientNetV2's progressive learning, the image-size half: train on smaller images first, the full size
    last. `spec` is "SIZE:UNTIL,..." with UNTIL the fraction of the run's steps up to which SIZE holds (e.g.
    "16:0.4,24:0.7": 16 px for the first 40% of the steps, 24 px to 70%, then the data's own size). A 16 px
    image has a quarter of a 32 px one's pixels, and a convolutional network's cost follows the pixels;
    evaluation stays at full size.
    Batches are resized on the fly (bilinear, antialiased), after the augmentation."""

    def __init__(self, spec: str):
        self.stages: list[tuple[int, float]] = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            size, sep, until = part.partition(":")
            try:
                stage = int(size), float(until)
            except ValueError:
                stage = None
            if not sep or stage is None or stage[0] < 1 or not 0.0 < stage[1] <= 1.0:
                raise ValueError(f"--progressive-resize {spec!r}: each part is SIZE:UNTIL, a side in pixels and "
                                 f"the fraction of the steps it lasts to, in (0, 1] (e.g. 16:0.4,24:0.7); got {part!r}")
            if self.stages and stage[1] <= self.stages[-1][1]:
                raise ValueError(f"--progressive-resize {spec!r}: the UNTIL fractions must increase")
            self.stages.append(stage)
        if not self.stages:
            raise ValueError("--progressive-resize is empty; give SIZE:UNTIL parts, e.g. 16:0.4,24:0.7")
        self.size: int | None = None  # the current stage's side; None: the data's own

    def set_step(self, step: int, total_steps: int) -> None:
        """Before each training step: the side for that step (the trainer's Task.before_step)."""
        done = step / max(total_steps, 1)
        self.size = next((size for size, until in self.stages if done < until), None)

    def __call__(self, images):
        """`images` (B, C, H, W) at the current stage's side (a larger side is never upsampled to)."""
        import torch.nn.functional as F
        if self.size is None or self.size >= max(images.shape[-2:]):
            return images
        return F.interpolate(images, size=(self.size, self.size), mode="bilinear", antialias=True,
                             align_corners=False)
