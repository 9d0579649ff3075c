"""Saving a model (file, Hub-style folder, the Hub itself) and publishing weights into weights/."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import zoo.weights as _package
from zoo._io import atomic_path, atomic_write_bytes
from zoo.registry import get_entry
from zoo.weights.card import render_card
from zoo.weights.files import (WeightsError, WeightsMeta, check_storage_dtype, encode_state_dict, file_sha256,
                               read_weights_file)
from zoo.weights.specs import HUB_FILE, MANIFEST, read_manifest

# What the caller of `save` may set; the model name, config, dtype and data hash come from the save itself.
_CALLER_FIELDS = ("labels", "preprocessing", "dataset", "command", "metrics", "extra", "parent")
# What describes the model rather than the run that produced it, so it is kept from the loaded weights.
_MODEL_FIELDS = ("labels", "preprocessing")


def save(model: torch.nn.Module, path: str | os.PathLike, meta: dict[str, Any] | WeightsMeta | None = None,
         *, dtype: torch.dtype | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> WeightsMeta:
    """Save a registry model as safetensors with its config and metadata; `zoo.load(name, pretrained=path)` reads it.

    The file holds the metadata of this save only: what `meta` sets (labels, preprocessing, dataset,
    command, metrics, extra; a WeightsMeta is taken whole), with `command` defaulting to the current
    command line. The loaded weights' dataset, command, metrics and extra describe the run that made
    *them* and are not carried over. Their labels and preprocessing describe the model (the classes its
    head predicts, the input its backbone expects), so they are kept unless `meta` sets them; labels are
    dropped when the head no longer has that many classes (zoo.load drops them when it re-initialises it).

    `parent` records where the weights came from: {"sha256": full-file sha256, "source": tag, path or
    hf:// URI, "parent": that file's own parent} of the weights the model was loaded from or last saved
    to (`model.pretrained_source`), None for a model trained from scratch; `meta` may set it.

    `dtype` (e.g. torch.float16) stores floating tensors in that precision; integer dtypes are refused
    (int8 is `zoo.accel.quantize`'s job). `state_dict` overrides the model's own (e.g. one gathered from FSDP).
    """
    from zoo.models.base import unwrap
    from zoo.registry import entry_for_model

    check_storage_dtype(dtype)
    if not os.fspath(path).endswith(".safetensors"):
        # zoo.load reads a file by its suffix: a safetensors file named .pt would be refused there as a pickle
        raise ValueError(f"zoo.save writes safetensors; give a path ending in .safetensors, not {os.fspath(path)!r}")
    if os.path.isdir(path):
        raise ValueError(f"zoo.save path {os.fspath(path)!r} is a directory; give the .safetensors file to write")
    # torch.compile and DDP wrap the model; save the original so keys have no `_orig_mod.` / `module.`
    model = unwrap(model)
    entry = entry_for_model(model)
    fields = {**_model_fields(model), **_caller_fields(meta)}
    fields.setdefault("command", " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]))
    if fields.get("parent") is None:
        fields["parent"] = model.pretrained_source
    labels, num_classes = fields.get("labels"), getattr(model.config, "num_classes", None)
    if labels is not None and num_classes is not None and len(labels) != num_classes:
        raise ValueError(f"{len(labels)} labels given for a model with num_classes={num_classes}")
    new_meta = WeightsMeta(model=entry.name, config=dataclasses.asdict(model.config), **fields)
    state_dict = model.state_dict() if state_dict is None else state_dict
    not_tensors = [(k, v) for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        key, value = not_tensors[0]
        raise ValueError(f"the state dict to save holds {len(not_tensors)} value(s) that are not tensors, e.g. "
                         f"{key!r}: {type(value).__name__}; safetensors stores tensors only (put other values in "
                         "meta's extra)")
    blob, new_meta = encode_state_dict(state_dict, new_meta, dtype)
    atomic_write_bytes(path, blob)
    # The model now holds these weights: a later save names this file as its parent.
    model.pretrained_meta = new_meta
    model.pretrained_source = {"sha256": hashlib.sha256(blob).hexdigest(), "source": os.fspath(path),
                               "parent": new_meta.parent}
    return new_meta


def _caller_fields(meta: dict[str, Any] | WeightsMeta | None) -> dict[str, Any]:
    given = dataclasses.asdict(meta) if isinstance(meta, WeightsMeta) else dict(meta or {})
    ignored = {"model", "config", "data_sha256", "dtype"}  # always those of this save
    unknown = sorted(set(given) - set(_CALLER_FIELDS) - ignored)
    if unknown:
        raise ValueError(f"unknown metadata keys {unknown}; valid: {sorted(_CALLER_FIELDS)}")
    return {k: v for k, v in given.items() if k in _CALLER_FIELDS}


def _model_fields(model: torch.nn.Module) -> dict[str, Any]:
    loaded = model.pretrained_meta
    if loaded is None:
        return {}
    fields = {k: getattr(loaded, k) for k in _MODEL_FIELDS}
    num_classes = getattr(model.config, "num_classes", None)
    if fields["labels"] is not None and num_classes is not None and len(fields["labels"]) != num_classes:
        fields["labels"] = None  # the head was replaced since loading: the old names do not describe it
    return fields


def save_pretrained(model: torch.nn.Module, folder: str | os.PathLike, meta=None, *, dtype=None) -> Path:
    """Write a Hub-style folder (model.safetensors + README.md) that `pretrained=folder` or hf:// reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    saved = save(model, folder / HUB_FILE, meta, dtype=dtype)
    atomic_write_bytes(folder / "README.md", render_card(saved.model, {"hub": saved}, level=1).encode())
    return folder


def push_to_hub(model: torch.nn.Module, repo_id: str, meta=None, *, private: bool = False,
                revision: str | None = None, commit_message: str = "Upload zoo model", dtype=None) -> str:
    """Publish the model to the Hugging Face Hub; `zoo.load(name, pretrained="hf://" + repo_id)` reads it back."""
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp, meta, dtype=dtype)
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=tmp, revision=revision, commit_message=commit_message)
    return f"hf://{repo_id}" + (f"@{revision}" if revision else "")


def publish(src: str | os.PathLike, name: str, tag: str) -> Path:
    """Copy a trained weights file into weights/ and record its sha256 and size in the manifest. The file is
    named as the model's registration names the tag, else `{name}.{tag}.safetensors`: the registration must
    then list the tag (and make it the default if it is).

    Both writes are atomic and the manifest is written only once the file is in place, so a failure
    leaves the previous file and manifest as they were (or, at worst, a new file the manifest does not
    name yet, which loading refuses until `publish` is run again).
    """
    src = Path(src)
    _, meta, _ = read_weights_file(src)  # verifies the file before it is shipped
    if meta is None or meta.model != name:
        raise WeightsError(f"{src} is not a zoo weights file for {name!r}")
    folder = _package.weights_dir()
    dest = folder / get_entry(name).weights.get(tag, f"{name}.{tag}.safetensors")
    with atomic_path(dest) as tmp:
        shutil.copyfile(src, tmp)
        # hash the copy, not the source: it is the bytes that ship
        record = {"sha256": file_sha256(tmp), "size": tmp.stat().st_size}
    manifest = read_manifest()
    manifest[dest.name] = record
    atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return dest
