"""Weights specs: turn `pretrained=...` into a state dict, its metadata and where it came from.

A spec is one of: True / "default" (the registry's default tag), a tag of weights shipped in weights/
(checked against the full-file sha256 and size in weights/manifest.json), a path to a `.safetensors` /
`.pt` / `.bin` file or a folder holding one (or transformers' sharded `*.index.json` and its shards), or
`hf://owner/repo[/file][@revision]`. Keys that a torch.compile or DDP wrapper prefixed are stripped here,
for every family.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import zoo.weights as _package
from zoo.weights.files import WeightsError, WeightsMeta, read_weights_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
HUB_FILE = "model.safetensors"
# what a folder may hold, in the order looked for: transformers' single files and their sharded indexes
FOLDER_FILES = (HUB_FILE, HUB_FILE + ".index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# prefixes that wrappers put on every key: torch.compile's OptimizedModule and DDP / DataParallel
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def weights_dir() -> Path:
    """Shipped weights: `zoo/_weights` in an installed wheel, `weights/` in a source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_weights", package.parent / "weights"):
        if (candidate / MANIFEST).is_file():
            return candidate
    return package.parent / "weights"


def shipped_dir() -> Path:
    # Looked up through the package so that replacing `zoo.weights.weights_dir` (tests point it at a
    # temporary folder) changes where every reader and `publish` look.
    return _package.weights_dir()


def read_manifest() -> dict[str, dict[str, Any]]:
    path = shipped_dir() / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass
class ResolvedWeights:
    state_dict: dict[str, torch.Tensor]
    meta: WeightsMeta | None
    source: str  # the tag ("bert_cls.sst2"), path or hf:// URI: for messages and provenance
    folder: Path | None = None  # the folder it came from, for foreign checkpoints with a config.json
    sha256: str = ""  # of the file read

    def as_parent(self) -> dict[str, Any]:
        """The `parent` record that `zoo.save` writes into weights trained from these."""
        return {"sha256": self.sha256, "source": self.source, "parent": self.meta.parent if self.meta else None}


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
    path = shipped_dir() / filename
    if record is None or not path.is_file():
        raise FileNotFoundError(f"shipped weights {filename!r} for {entry.name}.{tag} are missing from "
                                f"{shipped_dir()}; reinstall zoo or restore weights/")
    state_dict, meta, sha256 = read_weights_file(path, record["sha256"], record["size"])
    return ResolvedWeights(state_dict, meta, f"{entry.name}.{tag}", sha256=sha256)


def _resolve_path(path: Path) -> ResolvedWeights:
    folder = None
    if path.is_dir():
        folder = path
        found = next((path / name for name in FOLDER_FILES if (path / name).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"folder {str(path)!r} holds neither {HUB_FILE} nor pytorch_model.bin "
                                    "(nor a sharded checkpoint's *.index.json)")
        path = found
    if path.name.endswith(".index.json"):
        state_dict, meta, sha256 = _read_sharded(path)
    else:
        state_dict, meta, sha256 = read_weights_file(path)
    return ResolvedWeights(strip_wrapper_prefixes(state_dict, str(path)), meta, str(path), folder or path.parent,
                           sha256)


def _read_sharded(index: Path) -> tuple[dict[str, torch.Tensor], WeightsMeta | None, str]:
    """A sharded checkpoint (transformers' `*.index.json` + shards) merged into one state dict; the sha256
    is the index file's, which names every shard."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise WeightsError(f"{str(index)!r} is not a sharded-checkpoint index (a JSON object with a "
                           "'weight_map' of key -> shard file); re-download or re-save it") from None
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (index.parent / shard).is_file():
            raise FileNotFoundError(f"shard {shard!r} named by {str(index)!r} is missing; download the whole "
                                    "checkpoint (every shard beside its index)")
        state_dict.update(read_weights_file(index.parent / shard).state_dict)
    absent = sorted(set(weight_map) - set(state_dict))
    if absent:
        raise WeightsError(f"the shards of {str(index)!r} lack {len(absent)} keys its weight_map names: "
                           f"{', '.join(absent[:12])}; re-download the checkpoint")
    return state_dict, None, hashlib.sha256(index.read_bytes()).hexdigest()


def strip_wrapper_prefixes(state_dict: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Keys saved from a wrapped model (`_orig_mod.` from torch.compile, `module.` from DDP, nested in any
    order) as the plain model's keys; one log line says what was stripped."""
    stripped = []
    while state_dict:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state_dict)), None)
        if prefix is None:
            break
        stripped.append(prefix)
        state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    if stripped:
        log.info("%s: stripped the wrapper prefix %r from every key (saved from a torch.compile / DDP "
                 "wrapped model)", source, "".join(stripped))
    return state_dict


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
            return dataclasses.replace(_resolve_path(path), source=uri)
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
    return dataclasses.replace(_resolve_path(folder), source=uri)
