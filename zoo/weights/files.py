"""The weights file format: safetensors with zoo metadata in the header, hashing, and reading pickles safely.

A zoo weights file is a plain safetensors file whose header metadata holds one JSON entry, `zoo`, with
the `WeightsMeta` below. The metadata also carries the sha256 of the tensor data, so a corrupt file
given by path is caught too; shipped files are checked against the full-file sha256 in the manifest.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zoo._io import atomic_write_bytes

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


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
    # the weights this file was trained from: {"sha256": full-file sha256, "source": tag, path or hf:// URI,
    # "parent": that file's own parent}, so provenance is a chain; None for a run from scratch (and old files)
    parent: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "WeightsMeta":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class WeightsError(ValueError):
    """A weights file or spec that cannot be used; the message says why and what to do."""


class WeightsFile(NamedTuple):
    state_dict: dict[str, torch.Tensor]
    meta: WeightsMeta | None  # None for pickles and foreign safetensors files
    sha256: str  # of the whole file, as `sha256sum` and the Hub show it


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- writing


def check_storage_dtype(dtype: torch.dtype | None) -> None:
    # Casting float weights to an integer type zeroes almost all of them, and the file still loads.
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r} cannot store weights: use a floating dtype (torch.float32, "
                         "torch.float16 or torch.bfloat16). For int8 weights use zoo.accel.quantize(model, ...).")


def encode_state_dict(state_dict: dict[str, torch.Tensor], meta: WeightsMeta,
                      dtype: torch.dtype | None = None) -> tuple[bytes, WeightsMeta]:
    """The safetensors bytes of `state_dict` with `meta`, and the meta with `dtype` and `data_sha256` filled in."""
    from safetensors.torch import save as st_save

    check_storage_dtype(dtype)
    tensors, seen = {}, set()
    for k, v in state_dict.items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        # safetensors refuses tensors that share memory (tied embeddings): store each key's own copy
        v = v.clone() if v.data_ptr() in seen else v.contiguous()
        seen.add(v.data_ptr())
        tensors[k] = v
    # The tensor bytes do not depend on the header, so hash them from a first serialisation.
    data_hash = hashlib.sha256(split_safetensors(st_save(tensors))[1]).hexdigest()
    meta = dataclasses.replace(meta, dtype=str(dtype or "float32").replace("torch.", ""), data_sha256=data_hash)
    return st_save(tensors, metadata={"zoo": meta.to_json()}), meta


def save_state_dict(state_dict: dict[str, torch.Tensor], path: str | os.PathLike,
                    meta: WeightsMeta, dtype: torch.dtype | None = None) -> WeightsMeta:
    """Write `state_dict` with `meta` atomically; returns the meta with `data_sha256` filled in."""
    blob, meta = encode_state_dict(state_dict, meta, dtype)
    atomic_write_bytes(path, blob)
    return meta


# --------------------------------------------------------------------------- reading


def split_safetensors(blob: bytes) -> tuple[dict, bytes]:
    """(header, tensor data) of a safetensors file's bytes."""
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
    state_dict, meta, _ = read_weights_file(path, expected_sha256, expected_size)
    return state_dict, meta


def read_weights_file(path: str | os.PathLike, expected_sha256: str | None = None,
                      expected_size: int | None = None) -> WeightsFile:
    """`read_weights`, plus the file's sha256 (the provenance of a model loaded from it)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.suffix not in (".safetensors", *PICKLE_SUFFIXES):
        raise WeightsError(f"{path}: unsupported weights format {path.suffix!r}; "
                           f"use .safetensors or one of {', '.join(PICKLE_SUFFIXES)}")
    blob = path.read_bytes()
    sha256 = hashlib.sha256(blob).hexdigest()
    where = f"weights file {str(path)!r}"
    if expected_size is not None and len(blob) != expected_size:
        raise WeightsError(f"{where} is {len(blob)} bytes, the manifest says {expected_size}: it is "
                           "truncated or replaced. Restore it (e.g. `git checkout weights/`) or reinstall zoo.")
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise WeightsError(f"{where} has sha256 {sha256}, the manifest says {expected_sha256}: it is corrupt. "
                           "Restore it (e.g. `git checkout weights/`) or reinstall zoo.")
    if path.suffix in PICKLE_SUFFIXES:
        return WeightsFile(_read_pickle(blob, path), None, sha256)
    state_dict, meta = _read_safetensors(blob, where, verify_data=expected_sha256 is None)
    return WeightsFile(state_dict, meta, sha256)


def _read_safetensors(blob: bytes, where: str, verify_data: bool
                      ) -> tuple[dict[str, torch.Tensor], WeightsMeta | None]:
    from safetensors.torch import load as st_load

    try:
        header, data = split_safetensors(blob)
    except WeightsError as e:
        raise WeightsError(f"{where}: {e}. Re-download or re-save it.") from None
    meta_json = (header.get("__metadata__") or {}).get("zoo")
    meta = WeightsMeta.from_json(meta_json) if meta_json else None
    # A file whose full sha256 matched the manifest needs no second check of its tensor data.
    if verify_data and meta is not None and meta.data_sha256:
        actual = hashlib.sha256(data).hexdigest()
        if actual != meta.data_sha256:
            raise WeightsError(f"{where}: tensor data sha256 {actual} does not match the {meta.data_sha256} "
                               "recorded when it was saved: the file is corrupt or truncated. Re-download or re-save it.")
    try:
        state_dict = st_load(blob)
    except Exception as e:  # safetensors raises its own error types for malformed files
        raise WeightsError(f"{where} is not a valid safetensors file ({e}). Re-download or re-save it.") from None
    return state_dict, meta


def _read_pickle(blob: bytes, path: Path) -> dict[str, torch.Tensor]:
    # weights_only=True: a pickle from the internet must not be able to run code.
    try:
        obj = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:
        # torch's own text tells the user to re-run with weights_only=False (running the pickle's code), with
        # terminal escapes: name only what it refused, and the safe conversion
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"a {found.group(1)} object, not only tensors" if found else f"no plain state dict ({type(e).__name__})"
        raise WeightsError(f"{str(path)!r} is a pickle holding {what}; zoo reads pickles with "
                           "torch.load(weights_only=True) only, as unpickling other objects can run code. If you "
                           "trust its source, convert it once to a state dict of tensors: "
                           "safetensors.torch.save_file(model.state_dict(), 'weights.safetensors') on the model "
                           "it holds, then load that file") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"{str(path)!r} does not hold a state dict of tensors")
    return obj
