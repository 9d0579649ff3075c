"""The Markdown card of a model and its weights: the README of a saved folder and a section of MODEL_CARDS.md.

It lives with the weights (not in `zoo.cards`) so that `save_pretrained` can write a README without
importing `zoo.cards`, which reads the shipped weights: `zoo.cards` imports `zoo.weights`, never the reverse.
"""
from __future__ import annotations

import json
import re

from zoo.registry import get_entry
from zoo.weights.files import WeightsMeta


def render_card(name: str, metas: dict[str, WeightsMeta], level: int = 2) -> str:
    """The card of registry model `name` with one section per weights tag in `metas`."""
    entry = get_entry(name)
    h = "#" * level
    lines = [f"{h} `{name}`", "", entry.description or "", ""]
    lines.append(f"- class: `{entry.model_cls.__module__}.{entry.model_cls.__qualname__}`")
    variants = sorted(entry.model_cls.variants)
    if variants:
        lines.append(f"- variants: {', '.join(variants)}")
    if not metas:
        lines += ["- shipped weights: none yet", ""]
    for tag, m in metas.items():
        default = " (default)" if tag == entry.default_tag else ""
        lines += ["", f"{h}# weights `{tag}`{default}", ""]
        lines.append(f"- data set: {m.dataset or 'not recorded'}")
        lines.append(f"- stored as: {m.dtype}")
        if m.parent:  # only then: cards of weights trained from scratch stay as they were
            lines.append(f"- trained from: `{m.parent.get('source', '?')}` (sha256 {m.parent.get('sha256', '?')})")
        if m.labels:
            lines.append(f"- labels ({len(m.labels)}): {', '.join(m.labels[:20])}"
                         + (" ..." if len(m.labels) > 20 else ""))
        for key, value in sorted(m.metrics.items()):
            lines.append(f"- {key}: {_fmt_metric(value)}")
        if m.command:
            lines += ["", "Training command:", "", "```", m.command, "```", ""]
            if re.search(r"--amp (bf16|fp16)(\s|$)", m.command):
                # the recorded command is what ran; say what it does on hardware without native bf16/fp16
                lines += ["On hardware without native bf16/fp16 (e.g. AVX2 CPUs) this `--amp` runs fp32 with "
                          "one warning (`--amp auto` chooses by hardware; `--amp bf16!` forces the slow path), "
                          "so a rerun there gives slightly different weights.", ""]
            lines += ["Run details:", ""]
        for key, value in sorted(m.extra.items()):
            if key == "bench":
                lines += ["", "Benchmark:", "", "```", str(value).rstrip(), "```"]
            else:
                lines.append(f"- {key}: {json.dumps(value) if not isinstance(value, str) else value}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _fmt_metric(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
