"""Metrics for people and machines: metrics.jsonl, metrics.csv, TensorBoard and curves.png in the run folder."""
from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

from zoo._io import atomic_write_bytes

log = logging.getLogger(__name__)


def _scalar(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class MetricsLogger:
    """Append-only records (one dict per line in metrics.jsonl); only rank 0 creates one."""

    def __init__(self, out: str | Path, resume_step: int = 0):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out / "metrics.jsonl"
        self.records = self._read(resume_step)
        # drop records past the resume point; atomically, so a kill now cannot lose the earlier ones
        atomic_write_bytes(self.jsonl, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.out / "tb"))
        except Exception:  # tensorboard is optional
            self.tb = None

    def _read(self, resume_step: int) -> list[dict]:
        if not self.jsonl.is_file() or resume_step == 0:
            return []
        records = []
        for number, line in enumerate(self.jsonl.read_text().splitlines(), start=1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a process killed mid-write leaves a torn line: the rest is good
                if line.strip():
                    log.warning("%s line %d is cut short (a killed run); dropped", self.jsonl, number)
        return [r for r in records if r.get("step", 0) <= resume_step]

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if _scalar(v) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{record.get('split', 'train')}/{k}", v, record.get("step", 0))
        if record.get("split") == "eval":
            self._write_csv()
            self._plot()

    def _write_csv(self) -> None:
        rows = [{k: v for k, v in r.items() if _scalar(v) or k == "split"} for r in self.records]
        first = ["split", "step", "epoch"]
        columns = first + sorted({k for r in rows for k in r} - set(first))
        with open(self.out / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)

    def _plot(self) -> None:
        try:  # a bare Figure draws with Agg by itself: no pyplot, so the caller's backend stays as it is
            from matplotlib.figure import Figure
        except ImportError:
            return
        train = [r for r in self.records if r.get("split") == "train"]
        evals = [r for r in self.records if r.get("split") == "eval"]
        keys = [k for k in (evals[-1] if evals else {}) if _scalar(evals[-1][k]) and k not in ("step", "epoch")]
        fig = Figure(figsize=(4 * (1 + len(keys)), 3))
        axes = fig.subplots(1, 1 + len(keys), squeeze=False)
        axes[0][0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
        axes[0][0].set_title("loss")
        for ax, k in zip(axes[0][1:], keys):
            ax.plot([r["step"] for r in evals if k in r], [r[k] for r in evals if k in r], marker="o")
            ax.set_title(f"eval {k}")
        for ax in axes[0]:
            ax.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(self.out / "curves.png", dpi=80)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def format_metrics(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float) and math.isfinite(v):
            parts.append(f"{k} {v:.4f}")
        elif _scalar(v):
            parts.append(f"{k} {v}")
    return "  ".join(parts)
