"""Weights: safetensors files with zoo metadata, the shipped-weights manifest, and spec resolution.

One module per job, each importing only those above it:

    files     the file format: `WeightsMeta` in the safetensors header, sha256, reading pickles safely
    specs     `pretrained=...` -> state dict + metadata + provenance: tags shipped in weights/ (checked
              against weights/manifest.json), paths, folders and hf:// URIs
    loading   a state dict into a model, strictly except a head meant to be re-initialised
    card      the Markdown card of a model's weights (a saved folder's README, MODEL_CARDS.md)
    saving    `save`, `save_pretrained`, `push_to_hub`, and `publish` into weights/

`zoo.cards` imports this package, never the reverse.
"""
from zoo.weights.files import (WeightsError, WeightsFile, WeightsMeta, file_sha256, read_weights,
                               read_weights_file, save_state_dict)
from zoo.weights.loading import load_state_dict_into
from zoo.weights.specs import (HUB_FILE, MANIFEST, ResolvedWeights, parse_hub_uri, read_manifest,
                               resolve_weights, weights_dir)
from zoo.weights.saving import publish, push_to_hub, save, save_pretrained

__all__ = ["WeightsMeta", "WeightsError", "WeightsFile", "save", "save_pretrained", "push_to_hub", "publish",
           "read_weights", "read_weights_file", "resolve_weights", "ResolvedWeights", "load_state_dict_into",
           "weights_dir", "read_manifest", "file_sha256", "save_state_dict", "parse_hub_uri",
           "HUB_FILE", "MANIFEST"]
