"""Weights: safetensors files with zoo metadata, the shipped-weights manifest, and spec resolution.

A zoo weights file is a plain safetensors file whose header metadata holds one JSON entry,
`zoo`, with the `WeightsMeta` below. The metadata also carries the sha256 of the tensor
data, so a corrupt file given by path is caught too; shipped files are additionally checked
against the full-file sha256 and size in `weights/manifest.json`.

A weights spec is one of: True / "default" (the registry's default tag), a tag, a path to
a `.safetensors` / `.pt` / `.bin` file or a folder holding one, or
`hf://owner/repo[/file][@revision]`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zoo._io import atomic_write_bytes

log = logging.getLogger(__name__)

__all__ = ["WeightsMeta", "save", "save_pretrained", "push_to_hub", "read_weights",
           "resolve_weights", "load_state_dict_into", "weights_dir", "read_manifest"]

MANIFEST = "manifest.json"
HUB_FILE = "model.safetensors"
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


@dataclass(frozen=True)
class WeightsMeta:
    """Everything a weights file says about itself; stored as JSON in the safetensors header."""
    model: str
    config: dict[str, Any]
    labels: list[str] | None = None
    preprocessing: dict[str, Any] = field(default_factory=dict)
    dataset: str = ""
    command: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    data_sha256: str = ""  # sha256 of the tensor bytes, filled in by `save`
    dtype: str = "float32"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "WeightsMeta":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class WeightsError(ValueError):
    """A weights file or spec that cannot be used; the message says why and what to do."""


# --------------------------------------------------------------------------- files


def weights_dir() -> Path:
    """Shipped weights: `zoo/_weights` in an installed wheel, `weights/` in a source checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "_weights", package.parent / "weights"):
        if (candidate / MANIFEST).is_file():
            return candidate
    return package.parent / "weights"


def read_manifest() -> dict[str, dict[str, Any]]:
    path = weights_dir() / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_state_dict(state_dict: dict[str, torch.Tensor], path: str | os.PathLike,
                    meta: WeightsMeta, dtype: torch.dtype | None = None) -> WeightsMeta:
    """Write `state_dict` with `meta` atomically; returns the meta with `data_sha256` filled in."""
    from safetensors.torch import save as st_save

    tensors, seen = {}, set()
    for k, v in state_dict.items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        # safetensors refuses tensors that share memory (tied embeddings): store each key's own copy
        v = v.clone() if v.data_ptr() in seen else v.contiguous()
        seen.add(v.data_ptr())
        tensors[k] = v
    meta = dataclasses.replace(meta, dtype=str(dtype or "float32").replace("torch.", ""))
    # The tensor bytes do not depend on the header, so hash them from a first serialisation.
    data_hash = hashlib.sha256(_split_safetensors(st_save(tensors))[1]).hexdigest()
    meta = dataclasses.replace(meta, data_sha256=data_hash)
    atomic_write_bytes(path, st_save(tensors, metadata={"zoo": meta.to_json()}))
    return meta


def _split_safetensors(blob: bytes) -> tuple[dict, bytes]:
    if len(blob) < 8:
        raise WeightsError("file is shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len > len(blob) - 8:
        raise WeightsError("header length points past the end of the file (truncated)")
    try:
        header = json.loads(blob[8:8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError("header is not valid JSON (corrupt file)") from None
    return header, blob[8 + header_len:]


def read_weights(path: str | os.PathLike, expected_sha256: str | None = None,
                 expected_size: int | None = None) -> tuple[dict[str, torch.Tensor], WeightsMeta | None]:
    """Read a weights file, verifying its integrity; returns (state_dict, meta or None)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.suffix in _PICKLE_SUFFIXES:
        return _read_pickle(path), None
    if path.suffix != ".safetensors":
        raise WeightsError(f"{path}: unsupported weights format {path.suffix!r}; "
                           f"use .safetensors or one of {', '.join(_PICKLE_SUFFIXES)}")
    blob = path.read_bytes()
    where = f"weights file {str(path)!r}"
    if expected_size is not None and len(blob) != expected_size:
        raise WeightsError(f"{where} is {len(blob)} bytes, the manifest says {expected_size}: it is "
                           "truncated or replaced. Restore it (e.g. `git checkout weights/`) or reinstall zoo.")
    if expected_sha256 is not None:
        actual = hashlib.sha256(blob).hexdigest()
        if actual != expected_sha256:
            raise WeightsError(f"{where} has sha256 {actual}, the manifest says {expected_sha256}: it is corrupt. "
                               "Restore it (e.g. `git checkout weights/`) or reinstall zoo.")
    try:
        header, data = _split_safetensors(blob)
    except WeightsError as e:
        raise WeightsError(f"{where}: {e}. Re-download or re-save it.") from None
    meta_json = (header.get("__metadata__") or {}).get("zoo")
    meta = WeightsMeta.from_json(meta_json) if meta_json else None
    if meta is not None and meta.data_sha256:
        actual = hashlib.sha256(data).hexdigest()
        if actual != meta.data_sha256:
            raise WeightsError(f"{where}: tensor data sha256 {actual} does not match the {meta.data_sha256} "
                               "recorded when it was saved: the file is corrupt or truncated. Re-download or re-save it.")
    from safetensors.torch import load as st_load
    try:
        state_dict = st_load(blob)
    except Exception as e:  # safetensors raises its own error types for malformed files
        raise WeightsError(f"{where} is not a valid safetensors file ({e}). Re-download or re-save it.") from None
    return state_dict, meta


def _read_pickle(path: Path) -> dict[str, torch.Tensor]:
    # weights_only=True: a pickle from the internet must not be able to run code.
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsError(f"cannot read {str(path)!r} with torch.load(weights_only=True): {e}. "
                           "Only plain state dicts of tensors are accepted; convert it to safetensors.") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"{str(path)!r} does not hold a state dict of tensors")
    return obj


# --------------------------------------------------------------------------- specs


@dataclass
class ResolvedWeights:
    state_dict: dict[str, torch.Tensor]
    meta: WeightsMeta | None
    source: str  # human-readable, for messages
    folder: Path | None = None  # the folder it came from, for foreign checkpoints with a config.json


def resolve_weights(entry, spec) -> ResolvedWeights:
    """Turn a weights spec for a registry entry into a state dict and its metadata."""
    if spec is True or spec == "default":
        if entry.default_tag is None:
            raise WeightsError(f"{entry.name!r} has no shipped default weights yet; "
                               "use pretrained=False, a path, or an hf:// URI")
        spec = entry.default_tag
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"pretrained must be False, True, a tag, a path or an hf:// URI; got {spec!r}")
    spec_str = os.fspath(spec)
    if spec_str in entry.weights:
        return _resolve_shipped(entry, spec_str)
    if spec_str.startswith("hf://"):
        return _resolve_hub(spec_str)
    path = Path(spec_str).expanduser()
    if path.exists():
        return _resolve_path(path)
    tags = ", ".join(map(repr, entry.weights)) or "none shipped yet"
    raise WeightsError(f"pretrained={spec_str!r} is not a weights tag of {entry.name!r} (tags: {tags}), "
                       "an existing file or folder, or an hf://owner/repo URI")


def _resolve_shipped(entry, tag: str) -> ResolvedWeights:
    filename = entry.weights[tag]
    record = read_manifest().get(filename)
    path = weights_dir() / filename
    if record is None or not path.is_file():
        raise FileNotFoundError(f"shipped weights {filename!r} for {entry.name}.{tag} are missing from "
                                f"{weights_dir()}; reinstall zoo or restore weights/")
    state_dict, meta = read_weights(path, record["sha256"], record["size"])
    return ResolvedWeights(state_dict, meta, f"{entry.name}.{tag}")


def _resolve_path(path: Path) -> ResolvedWeights:
    folder = None
    if path.is_dir():
        folder = path
        candidates = [path / HUB_FILE, path / "pytorch_model.bin"]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"folder {str(path)!r} holds neither {HUB_FILE} nor pytorch_model.bin")
        path = found
    state_dict, meta = read_weights(path)
    return ResolvedWeights(state_dict, meta, str(path), folder or path.parent)


def parse_hub_uri(uri: str) -> tuple[str, str | None, str | None]:
    """`hf://owner/repo[/file][@revision]` -> (repo_id, filename or None, revision or None)."""
    rest = uri[len("hf://"):]
    rest, _, revision = rest.partition("@")
    parts = [p for p in rest.split("/") if p]
    if len(parts) < 2:
        raise WeightsError(f"{uri!r} is not a Hub URI; expected hf://owner/repo[/file][@revision]")
    return "/".join(parts[:2]), ("/".join(parts[2:]) or None), (revision or None)


def _resolve_hub(uri: str) -> ResolvedWeights:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, filename, revision = parse_hub_uri(uri)
    try:
        if filename is not None:
            path = Path(hf_hub_download(repo_id, filename, revision=revision))
            return ResolvedWeights(*read_weights(path), uri, path.parent)
        folder = Path(snapshot_download(repo_id, revision=revision,
                                        allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt", "*.md"]))
    except LocalEntryNotFoundError:
        what = f"file {filename!r} of " if filename else ""
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else "it could not be downloaded"
        fetch = f"huggingface-cli download {repo_id}" + (f" {filename}" if filename else "")
        raise FileNotFoundError(f"{what}Hub repo {repo_id!r}{'@' + revision if revision else ''}: {why}. "
                                f"Fetch it on a machine with network (`{fetch}`), then retry.") from None
    except Exception as e:
        if type(e).__name__ in ("RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError"):
            raise FileNotFoundError(f"{uri}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
        raise
    resolved = _resolve_path(folder)
    return dataclasses.replace(resolved, source=uri)


# --------------------------------------------------------------------------- state dicts


def load_state_dict_into(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *,
                         source: str, reinit_head: bool) -> None:
    """Load strictly, except that a head whose shape changed (new num_classes) keeps its fresh init.

    `reinit_head` is True when the user asked for a num_classes different from the checkpoint's;
    only then may the keys under the model's `head_prefixes` be skipped, with a warning naming them.
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    mismatched = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
    head_prefixes = tuple(getattr(model, "head_prefixes", ()))
    skipped: list[str] = []
    if reinit_head and head_prefixes:
        def in_head(key):
            return key.startswith(head_prefixes)
        skipped = sorted(k for k in set(mismatched) | set(missing) | set(unexpected) if in_head(k))
        missing = [k for k in missing if not in_head(k)]
        unexpected = [k for k in unexpected if not in_head(k)]
        mismatched = [k for k in mismatched if not in_head(k)]
    problems = []
    for label, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            problems.append(f"{len(keys)} {label} keys: {_key_list(keys)}")
    if mismatched:
        shapes = [f"{k} (checkpoint {tuple(state_dict[k].shape)}, model {tuple(own[k].shape)})" for k in mismatched]
        problems.append(f"{len(mismatched)} mis-shaped keys: {_key_list(shapes)}")
    if problems:
        hint = " Pass num_classes=... to re-initialise the head." if any(
            k.startswith(head_prefixes) for k in mismatched) and head_prefixes else ""
        raise WeightsError(f"weights {source} do not fit {type(model).__name__}: {'; '.join(problems)}.{hint}")
    if skipped:
        warnings.warn(f"{type(model).__name__}: head re-initialised (new num_classes, or no head in the "
                      f"checkpoint); not loaded from {source}: {', '.join(skipped)}", UserWarning, stacklevel=3)
    model.load_state_dict({k: v for k, v in state_dict.items() if k not in skipped}, strict=False)


def class_labels(model: torch.nn.Module) -> list[str]:
    """Label names from the loaded weights' metadata, else "0".."num_classes-1"."""
    meta = getattr(model, "pretrained_meta", None)
    if meta is not None and meta.labels:
        return list(meta.labels)
    return [str(i) for i in range(model.config.num_classes)]


def _key_list(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


# --------------------------------------------------------------------------- saving models


def _plain_model(model: torch.nn.Module) -> torch.nn.Module:
    # torch.compile wraps the model in OptimizedModule; save the original so keys have no `_orig_mod.`
    return getattr(model, "_orig_mod", model)


def save(model: torch.nn.Module, path: str | os.PathLike, meta: dict[str, Any] | WeightsMeta | None = None,
         *, dtype: torch.dtype | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> WeightsMeta:
    """Save a registry model as safetensors with its config and metadata; `zoo.load(name, pretrained=path)` reads it.

    `meta` may set labels, preprocessing, dataset, command, metrics and extra; the model name
    and config are always taken from the model itself. `dtype` (e.g. torch.float16) stores floating
    tensors in that precision; `state_dict` overrides the model's own (e.g. one gathered from FSDP).
    """
    from zoo.registry import entry_for_model

    model = _plain_model(model)
    entry = entry_for_model(model)
    base = getattr(model, "pretrained_meta", None)
    fields = dataclasses.asdict(base) if base is not None else {}
    given = dataclasses.asdict(meta) if isinstance(meta, WeightsMeta) else dict(meta or {})
    known = {f.name for f in dataclasses.fields(WeightsMeta)} - {"model", "config", "data_sha256", "dtype"}
    unknown = sorted(set(given) - known - {"model", "config", "data_sha256", "dtype"})
    if unknown:
        raise ValueError(f"unknown metadata keys {unknown}; valid: {sorted(known)}")
    fields.update({k: v for k, v in given.items() if k in known})
    fields.update(model=entry.name, config=dataclasses.asdict(model.config))
    fields.setdefault("command", " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]))
    labels = fields.get("labels")
    num_classes = getattr(model.config, "num_classes", None)
    if labels is not None and num_classes is not None and len(labels) != num_classes:
        raise ValueError(f"{len(labels)} labels given for a model with num_classes={num_classes}")
    state_dict = model.state_dict() if state_dict is None else state_dict
    meta_obj = save_state_dict(state_dict, path, WeightsMeta(**fields), dtype)
    model.pretrained_meta = meta_obj
    return meta_obj


def save_pretrained(model: torch.nn.Module, folder: str | os.PathLike, meta=None, *, dtype=None) -> Path:
    """Write a Hub-style folder (model.safetensors + README.md) that `pretrained=folder` or hf:// reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta_obj = save(model, folder / HUB_FILE, meta, dtype=dtype)
    from zoo.cards import render_card
    (folder / "README.md").write_text(render_card(meta_obj.model, {"hub": meta_obj}, level=1))
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
    """Copy a trained weights file into weights/ as `{name}.{tag}.safetensors` and record its sha256 and
    size in the manifest. The model's registration must name the tag (and make it the default if it is)."""
    import shutil

    src = Path(src)
    _, meta = read_weights(src)  # verifies the file before it is shipped
    if meta is None or meta.model != name:
        raise WeightsError(f"{src} is not a zoo weights file for {name!r}")
    folder = weights_dir()
    filename = f"{name}.{tag}.safetensors"
    shutil.copyfile(src, folder / filename)
    manifest = read_manifest()
    manifest[filename] = {"sha256": file_sha256(folder / filename), "size": (folder / filename).stat().st_size}
    atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return folder / filename
