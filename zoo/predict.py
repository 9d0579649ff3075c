"""What `zoo predict NAME INPUTS... [--option value]` does for each family: read the inputs, call the model's
own API (`predict`, `generate`, `predict_volume`, `sample`), format the result.

Each adapter takes (model, inputs, **options) and returns (JSON-able result, text for the terminal). Its
keyword-only parameters are the command line's options: `--max-new-tokens 50` becomes `max_new_tokens=50`,
converted to the parameter's annotated type (a float must be finite: `--guidance nan` is refused) and checked
against its range where the annotation carries one (`Annotated[int, ">= 1"]`: `--top-k 0` is refused), before
the model is loaded. A family without an adapter here cannot be used by `zoo predict` (CONTRIBUTING.md says how
to add one).
"""
from __future__ import annotations

import inspect
import math
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import torch

Adapter = Callable[..., "tuple[Any, str]"]


def bert_cls(model, inputs: list[str], *, max_length: Annotated[int | None, ">= 1"] = None, pair_separator: str = "",
             threshold: Annotated[float, "[0, 1]"] = 0.5):
    """--pair-separator ' ||| ' reads each input as a sentence pair "a ||| b"; --threshold is the multi-label
    models' probability cut."""
    if not inputs:
        raise ValueError('give one or more texts, e.g. zoo predict bert_cls "a gripping film"')
    texts = inputs
    if pair_separator:
        texts = [tuple(part.strip() for part in text.split(pair_separator, 1)) for text in inputs]
        lone = [text for text, parts in zip(inputs, texts) if len(parts) != 2]
        if lone:
            raise ValueError(f"--pair-separator {pair_separator!r} is not in {lone[0]!r}; give each pair as "
                             f'"first{pair_separator}second"')
    results = model.predict(texts, max_length=max_length, threshold=threshold)
    problem = model.config.problem
    if problem == "regression":
        lines = [f"{str(r):<10} {text}" for r, text in zip(results, inputs)]
        return [{"text": t, "value": r} for t, r in zip(inputs, results)], "\n".join(lines)
    if problem == "multi_label":
        lines = [f"{','.join(r['labels']) or '-':<20} {text}" for r, text in zip(results, inputs)]
    else:
        lines = [f"{r['label']:<10} {max(r['probs'].values()):.3f}  {text}" for r, text in zip(results, inputs)]
    return [{"text": t, **r} for t, r in zip(inputs, results)], "\n".join(lines)


def effnetv2_cls(model, inputs: list[str], *, top_k: Annotated[int, ">= 1"] = 5,
                 tta: Literal["none", "flip"] = "none"):
    """--tta flip averages the logits of each image and its horizontal mirror."""
    if not inputs:
        raise ValueError("give one or more image files, e.g. zoo predict effnetv2_cls cat.jpg")
    results = model.predict(inputs, top_k, tta=tta)
    text = "\n".join(f"{path}:\n" + "\n".join(f"  {p:6.3f}  {label}" for label, p in r)
                     for path, r in zip(inputs, results))
    return [{"image": path, "top": [{"label": lbl, "prob": p} for lbl, p in r]} for path, r in zip(inputs, results)], text


def transformer_lm(model, inputs: list[str], *, max_new_tokens: Annotated[int, ">= 1"] = 300,
                   temperature: Annotated[float, ">= 0"] = 0.8, top_k: Annotated[int | None, ">= 1"] = None,
                   top_p: Annotated[float | None, "(0, 1]"] = None, seed: int = 0):
    if not inputs:
        raise ValueError('give a prompt, e.g. zoo predict transformer_lm "ROMEO:"')
    prompt = " ".join(inputs)
    text = model.generate(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return {"prompt": prompt, "text": text}, text


def unet3d_seg(model, inputs: list[str], *, out: str = "", window: Annotated[int, ">= 1"] = 64,
               tta: Literal["none", "flip"] = "none"):
    """One volume, .npy ((D, H, W) or (C, D, H, W)) or NIfTI (.nii, .nii.gz; 4D: channels last). --out is the
    label volume (default: INPUT_pred with the input's format), written as NIfTI when it ends in .nii or .nii.gz,
    with the input's affine and header geometry, else as .npy; it may not be the input. --tta flip averages the
    probabilities over the 8 flips of the spatial axes."""
    from zoo.data.volumes import read_volume, volume_suffix, write_labels
    if len(inputs) != 1:
        raise ValueError("give one volume file (.npy of shape (D, H, W) or (C, D, H, W), or NIfTI .nii/.nii.gz)")
    source = inputs[0]
    suffix = volume_suffix(source) or ".npy"  # the old rule: any other name is read as .npy, and refused there
    stem = source[: -len(suffix)] if source.lower().endswith(suffix) else source
    out = out or stem + "_pred" + suffix
    out = out if volume_suffix(out) else out + suffix  # what is written: report the real path
    if Path(out).exists() and Path(out).resolve() == Path(source).resolve():
        raise ValueError(f"--out {out} is the input volume; give another file, e.g. --out {stem}_pred{suffix}")
    if Path(out).is_dir():
        raise ValueError(f"--out {out} is a directory; give the file to write (.npy, .nii or .nii.gz)")
    array, nifti = read_volume(source)
    if array.dtype.kind not in "biuf" or array.ndim not in (3, 4):
        raise ValueError(f"volume {source!r} must be numbers of shape (D, H, W) or (C, D, H, W), got "
                         f"{array.dtype} of shape {array.shape}")
    volume = _finite(torch.as_tensor(array).float(), source)
    volume = volume[None] if volume.dim() == 3 else volume
    channels = model.config.in_chans
    if volume.shape[0] != channels:
        raise ValueError(f"volume {source!r} has {volume.shape[0]} channel(s) (shape {tuple(array.shape)}); "
                         f"this model takes {channels}: give (D, H, W)" + (" or (1, D, H, W)" if channels == 1 else
                                                                           f" as ({channels}, D, H, W)"))
    labels = model.predict_volume(volume, window=window, tta=tta)
    write_labels(out, labels.numpy(), like=nifti)
    counts = {int(k): int(v) for k, v in zip(*torch.unique(labels, return_counts=True))}
    geometry = " with the input's geometry" if nifti is not None and volume_suffix(out) != ".npy" else ""
    text = f"wrote {out}{geometry}; voxels per class: " + ", ".join(f"{k}: {v}" for k, v in counts.items())
    return {"out": out, "voxels_per_class": counts}, text


def diffusion_unet(model, inputs: list[str], *, classes: str = "", n: Annotated[int, ">= 1"] = 16,
                   out: str = "grid.png", steps: Annotated[int, ">= 1"] = 50, sampler: str = "ddim",
                   guidance: Annotated[float, ">= 0"] = 2.0, seed: int = 0):
    """--classes 0,3 cycles those class ids over the --n samples; --guidance is the classifier-free guidance
    scale (0: unconditional, 1: conditional, above: stronger)."""
    from torchvision.utils import save_image
    if inputs:
        raise ValueError("diffusion_unet takes no inputs; e.g. zoo predict diffusion_unet --classes 0,1 --n 8")
    try:
        labels = [int(v) for v in classes.split(",")] if classes else None
    except ValueError:
        raise ValueError(f"--classes takes class ids separated by commas, e.g. --classes 0,3; got {classes!r}") from None
    if Path(out).is_dir():
        raise ValueError(f"--out {out} is a directory; give the image file to write, e.g. {Path(out) / 'grid.png'}")
    if labels is not None:
        labels = (labels * (n // len(labels) + 1))[:n]  # cycle the given classes
    images = model.sample(n, classes=labels, steps=steps, sampler=sampler, guidance=guidance, seed=seed)
    save_image(images, out, nrow=max(1, int(n ** 0.5)))
    return {"out": out, "n": n, "classes": labels}, f"wrote {n} samples to {out}"


def _finite(x: torch.Tensor, source: str) -> torch.Tensor:
    """`x` unchanged if every value is finite; one NaN or Inf would otherwise turn a whole prediction to
    nonsense (a unet3d volume came out all background) without a word."""
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise ValueError(f"{source} holds {bad} non-finite value(s) (NaN or Inf) of {x.numel()}; "
                         "replace them (e.g. numpy.nan_to_num) and run again")
    return x


ADAPTERS: dict[str, Adapter] = {fn.__name__: fn for fn in (bert_cls, effnetv2_cls, transformer_lm, unet3d_seg,
                                                            diffusion_unet)}


def run(name: str, model, inputs: list[str], options: dict[str, Any]) -> tuple[Any, str]:
    """`zoo predict`'s work: the family's adapter with the command line's string options converted (options
    already converted by `convert` pass through)."""
    return adapter_of(name)(model, inputs, **convert(name, options))


def adapter_of(name: str) -> Adapter:
    if name not in ADAPTERS:
        raise ValueError(f"{name} does not support `zoo predict` yet (no adapter in zoo/predict.py)")
    return ADAPTERS[name]


def convert(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The command line's string options for `name`'s adapter, converted to their types and range-checked."""
    from zoo.models.base import check_range
    adapter = adapter_of(name)
    params = {p.name: p for p in inspect.signature(adapter).parameters.values() if p.kind is p.KEYWORD_ONLY}
    hints = typing.get_type_hints(adapter, include_extras=True)
    converted = {}
    for key, text in options.items():
        if key not in params:
            valid = ", ".join(f"--{p.replace('_', '-')}" for p in params) or "none"
            raise ValueError(f"unknown option --{key.replace('_', '-')} for `zoo predict {name}`; options: {valid}")
        hint, ranges = hints[key], ()
        if typing.get_origin(hint) is Annotated:
            hint, *ranges = typing.get_args(hint)
        flag = f"--{key.replace('_', '-')}"
        if not isinstance(text, str):  # already converted
            converted[key] = text
            continue
        if typing.get_origin(hint) is Literal:  # one of the named choices
            if text not in typing.get_args(hint):
                raise ValueError(f"{flag} takes {' or '.join(typing.get_args(hint))}, got {text!r}")
            converted[key] = text
            continue
        kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
        try:
            converted[key] = kinds[0](text)
        except ValueError:
            raise ValueError(f"{flag} takes {'an int' if kinds[0] is int else kinds[0].__name__}, got {text!r}") from None
        if isinstance(converted[key], float) and not math.isfinite(converted[key]):  # float() takes "nan", "inf"
            raise ValueError(f"{flag} must be a finite number, got {text!r}")
        for spec in ranges:
            check_range(flag, converted[key], spec)
    return converted

