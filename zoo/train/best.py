"""--keep-best and --early-stop: follow one evaluation metric, keep the weights of its best evaluation.

The best weights are written to `<out>/best-<step>.safetensors` (full precision, the EMA weights when
--ema is on). The checkpoints record which step was best, so a resumed run knows its best file; a file
newer than the checkpoint a run resumes from belongs to steps that will be trained again and is deleted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "best-"
_NAME = re.compile(rf"^{PREFIX}(\d{{8}})\.safetensors$")
# metrics where lower is better, by the end of their name; any other metric is maximised
_LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "error", "nll", "mse", "mae", "fid", "bpc")


def parse_metric(spec: str) -> tuple[str, str]:
    """'val_loss' -> ('val_loss', 'min'); 'accuracy' -> ('accuracy', 'max'); 'dice:max' as given."""
    name, _, mode = spec.partition(":")
    if not name:
        raise ValueError(f"--keep-best {spec!r}: name an evaluation metric, e.g. val_loss or accuracy")
    if mode and mode not in ("min", "max"):
        raise ValueError(f"--keep-best {spec!r}: the direction after ':' is min or max, got {mode!r}")
    return name, mode or ("min" if name.lower().endswith(_LOWER_IS_BETTER) else "max")


def best_file(out: Path, step: int) -> Path:
    return Path(out) / f"{PREFIX}{step:08d}.safetensors"


def best_files(out: Path) -> dict[int, Path]:
    out = Path(out)
    if not out.is_dir():
        return {}
    return {int(m.group(1)): p for p in out.iterdir() if (m := _NAME.match(p.name))}


@dataclass
class BestTracker:
    metric: str
    mode: str  # "min" | "max"
    patience: int | None = None  # evaluations without improvement before stopping; None: never stop
    value: float | None = None
    step: int | None = None
    evals_since_best: int = 0

    @classmethod
    def from_flags(cls, keep_best: str, early_stop: int | None) -> "BestTracker":
        metric, mode = parse_metric(keep_best)
        return cls(metric, mode, early_stop)

    def update(self, metrics: dict[str, Any], step: int) -> bool:
        """Record one evaluation; True when it is the best so far (its weights should be kept)."""
        if self.metric not in metrics:
            raise ValueError(f"--keep-best {self.metric}: the evaluation has no such metric; it reports "
                             f"{', '.join(sorted(metrics))}")
        value = float(metrics[self.metric])
        better = self.value is None or (value < self.value if self.mode == "min" else value > self.value)
        if better:
            self.value, self.step, self.evals_since_best = value, step, 0
        else:
            self.evals_since_best += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.evals_since_best >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step,
                "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["metric"], state["mode"]) != (self.metric, self.mode):
            raise ValueError(f"the run being resumed kept the best {state['metric']} ({state['mode']}); "
                             f"--keep-best now asks for {self.metric} ({self.mode}): give the same --keep-best")
        self.value, self.step, self.evals_since_best = state["value"], state["step"], state["evals_since_best"]
