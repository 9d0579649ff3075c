"""What `zoo predict NAME INPUTS... [--option value]` does for each family: read the inputs, call the model's
own API (`predict`, `generate`, `predict_volume`, `sample`), format the result.

Each adapter takes (model, inputs, **options) and returns (JSON-able result, text for the terminal). Its
keyword-only parameters are the command line's options: `--max-new-tokens 50` becomes `max_new_tokens=50`,
converted to the parameter's annotated type (a float must be finite: `--guidance nan` is refused). A family
without an adapter here cannot be used by `zoo predict` (CONTRIBUTING.md says how to add one).
"""
from __future__ import annotations

import inspect
import math
import typing
from typing import Any, Callable

import torch

Adapter = Callable[..., "tuple[Any, str]"]


def bert_cls(model, inputs: list[str], *, max_length: int | None = None, pair_separator: str = "",
             threshold: float = 0.5):
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


def effnetv2_cls(model, inputs: list[str], *, top_k: int = 5):
    if not inputs:
        raise ValueError("give one or more image files, e.g. zoo predict effnetv2_cls cat.jpg")
    results = model.predict(inputs, top_k)
    text = "\n".join(f"{path}:\n" + "\n".join(f"  {p:6.3f}  {label}" for label, p in r)
                     for path, r in zip(inputs, results))
    return [{"image": path, "top": [{"label": lbl, "prob": p} for lbl, p in r]} for path, r in zip(inputs, results)], text


def transformer_lm(model, inputs: list[str], *, max_new_tokens: int = 300, temperature: float = 0.8,
                   top_k: int | None = None, top_p: float | None = None, seed: int = 0):
    if not inputs:
        raise ValueError('give a prompt, e.g. zoo predict transformer_lm "ROMEO:"')
    prompt = " ".join(inputs)
    text = model.generate(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return {"prompt": prompt, "text": text}, text


def unet3d_seg(model, inputs: list[str], *, out: str = "", window: int = 64):
    import numpy as np
    if len(inputs) != 1:
        raise ValueError("give one volume file (.npy of shape (D, H, W) or (C, D, H, W))")
    volume = _finite(torch.as_tensor(np.load(inputs[0], allow_pickle=False)).float(), inputs[0])
    volume = volume[None] if volume.dim() == 3 else volume
    labels = model.predict_volume(volume, window=window)
    out = out or inputs[0].rsplit(".npy", 1)[0] + "_pred.npy"
    np.save(out, labels.numpy().astype(np.uint8))
    counts = {int(k): int(v) for k, v in zip(*torch.unique(labels, return_counts=True))}
    text = f"wrote {out}; voxels per class: " + ", ".join(f"{k}: {v}" for k, v in counts.items())
    return {"out": out, "voxels_per_class": counts}, text


def diffusion_unet(model, inputs: list[str], *, classes: str = "", n: int = 16, out: str = "grid.png",
                   steps: int = 50, sampler: str = "ddim", guidance: float = 2.0, seed: int = 0):
    from torchvision.utils import save_image
    if inputs:
        raise ValueError("diffusion_unet takes no inputs; e.g. zoo predict diffusion_unet --classes 0,1 --n 8")
    labels = [int(v) for v in classes.split(",")] if classes else None
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


def run(name: str, model, inputs: list[str], options: dict[str, str]) -> tuple[Any, str]:
    """`zoo predict`'s work: the family's adapter with the command line's string options converted."""
    if name not in ADAPTERS:
        raise ValueError(f"{name} does not support `zoo predict` yet (no adapter in zoo/predict.py)")
    adapter = ADAPTERS[name]
    return adapter(model, inputs, **_convert(name, adapter, options))


def _convert(name: str, adapter: Adapter, options: dict[str, str]) -> dict[str, Any]:
    params = {p.name: p for p in inspect.signature(adapter).parameters.values() if p.kind is p.KEYWORD_ONLY}
    hints = typing.get_type_hints(adapter)
    converted = {}
    for key, text in options.items():
        if key not in params:
            valid = ", ".join(f"--{p.replace('_', '-')}" for p in params) or "none"
            raise ValueError(f"unknown option --{key.replace('_', '-')} for `zoo predict {name}`; options: {valid}")
        kinds = [t for t in typing.get_args(hints[key]) or (hints[key],) if t is not type(None)]
        try:
            converted[key] = kinds[0](text)
        except ValueError:
            raise ValueError(f"--{key.replace('_', '-')} takes {kinds[0].__name__}, got {text!r}") from None
        if isinstance(converted[key], float) and not math.isfinite(converted[key]):  # float() takes "nan", "inf"
            raise ValueError(f"--{key.replace('_', '-')} must be a finite number, got {text!r}")
    return converted

