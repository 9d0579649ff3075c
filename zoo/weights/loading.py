"""Loading a state dict into a model: strict, except a task head that is meant to be re-initialised."""
from __future__ import annotations

import warnings

import torch

from zoo.weights.files import WeightsError


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
    head_prefixes = model.head_prefixes

    def in_head(key: str) -> bool:
        return bool(head_prefixes) and key.startswith(head_prefixes)

    skipped: list[str] = []
    if reinit_head:
        skipped = sorted(k for k in set(mismatched) | set(missing) | set(unexpected) if in_head(k))
        missing = [k for k in missing if not in_head(k)]
        unexpected = [k for k in unexpected if not in_head(k)]
        mismatched = [k for k in mismatched if not in_head(k)]
    shapes = [f"{k} (checkpoint {tuple(state_dict[k].shape)}, model {tuple(own[k].shape)})" for k in mismatched]
    problems = key_problems(missing=missing, unexpected=unexpected, **{"mis-shaped": shapes})
    if problems:
        hint = (" Pass num_classes=... to re-initialise the head." if any(map(in_head, mismatched)) else
                f" {type(model).__name__} loads a file zoo.save wrote (its config travels in the metadata), its own "
                "keys without metadata when the config it was saved with is passed to zoo.load as overrides "
                "(zoo.load(name, pretrained=path, **config)), or a foreign layout its convert_foreign converts")
        raise WeightsError(f"weights {source} do not fit {type(model).__name__}: {problems}.{hint}")
    if skipped:
        warnings.warn(f"{type(model).__name__}: head re-initialised (new num_classes, or no head in the "
                      f"checkpoint); not loaded from {source}: {', '.join(skipped)}", UserWarning, stacklevel=3)
    model.load_state_dict({k: v for k, v in state_dict.items() if k not in skipped}, strict=False)


def key_problems(**groups: list[str]) -> str:
    """"2 missing keys: a, b; 1 unexpected keys: c" for the non-empty groups; "" when all are empty."""
    return "; ".join(f"{len(keys)} {what} keys: {_key_list(keys)}" for what, keys in groups.items() if keys)


def _key_list(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
