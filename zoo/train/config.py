"""The training config and the command-line flags every train script shares."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainConfig:
    data: str | None = None
    epochs: int | None = None  # either epochs or steps; steps are optimiser steps
    steps: int | None = None
    batch_size: int = 32  # per process and micro-batch; global batch = batch_size * processes * grad_accum
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.05  # not applied to norms and biases
    warmup: int = 100  # optimiser steps of linear warm-up
    grad_accum: int = 1
    clip: float | None = 1.0  # max global gradient norm; None disables
    amp: str = "off"  # off | bf16 | fp16
    compile: bool = False
    ema: float | None = None  # EMA decay, e.g. 0.999; evaluation and saved weights then use the EMA
    dist: str = "none"  # none | ddp | fsdp (under torchrun)
    workers: int | None = None  # DataLoader workers; None picks from the machine
    out: str = "runs/latest"
    resume: str | None = None  # "auto" (latest in --out) or a checkpoint folder
    pretrained: str | None = None
    num_classes: int | None = None
    seed: int = 0
    deterministic: bool = False  # deterministic kernels (CUDA: cuBLAS workspace, no atomics where avoidable)
    profile: bool = False
    eval_only: bool = False
    eval_every: int | None = None  # optimiser steps between evaluations; default: once per epoch
    save_every: int | None = None  # optimiser steps between checkpoints; default: at each evaluation
    keep: int = 3  # checkpoints kept
    log_every: int = 10
    device: str = "auto"
    save_dtype: str = "fp32"  # dtype of the final weights file: fp32 | fp16 | bf16
    note: str = ""  # free text stored with the final weights (e.g. why a run was stopped early)
    extra: dict[str, Any] = field(default_factory=dict)  # the script's own flags, recorded with the run

    def __post_init__(self):
        if self.epochs is None and self.steps is None and not self.eval_only:
            raise ValueError("give --epochs or --steps")
        for name in ("batch_size", "grad_accum", "keep", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.amp not in ("off", "bf16", "fp16"):
            raise ValueError(f"--amp must be off, bf16 or fp16, got {self.amp!r}")
        if self.dist not in ("none", "ddp", "fsdp"):
            raise ValueError(f"--dist must be none, ddp or fsdp, got {self.dist!r}")
        if self.ema is not None and not 0.0 < self.ema < 1.0:
            raise ValueError(f"--ema is a decay in (0, 1), e.g. 0.999; got {self.ema}")
        if self.save_dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"--save-dtype must be fp32, fp16 or bf16, got {self.save_dtype!r}")


def add_train_args(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """Add the shared flags; `defaults` sets a family's own defaults (e.g. lr=5e-5)."""
    d = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    d.update(defaults)
    g = parser.add_argument_group("training (shared by every train script)")
    g.add_argument("--data", default=d.get("data"), help="training data (format depends on the family)")
    g.add_argument("--epochs", type=int, default=d["epochs"])
    g.add_argument("--steps", type=int, default=d["steps"], help="optimiser steps (instead of --epochs)")
    g.add_argument("--batch-size", type=int, default=d["batch_size"], help="per process, per micro-batch")
    g.add_argument("--lr", type=float, default=d["lr"])
    g.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"])
    g.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    g.add_argument("--warmup", type=int, default=d["warmup"], help="warm-up optimiser steps")
    g.add_argument("--grad-accum", type=int, default=d["grad_accum"])
    g.add_argument("--clip", type=float, default=d["clip"], help="max gradient norm (0 disables)")
    g.add_argument("--amp", choices=["off", "bf16", "fp16"], default=d["amp"])
    g.add_argument("--compile", action="store_true", default=d["compile"])
    g.add_argument("--ema", type=float, default=d["ema"], metavar="DECAY")
    g.add_argument("--dist", choices=["none", "ddp", "fsdp"], default=d["dist"])
    g.add_argument("--workers", type=int, default=d["workers"])
    g.add_argument("--out", default=d["out"], help="run folder: checkpoints, metrics, final weights")
    g.add_argument("--resume", nargs="?", const="auto", default=d["resume"],
                   help="resume from the latest checkpoint in --out, or from PATH")
    g.add_argument("--pretrained", default=d["pretrained"], help="TAG | PATH | hf://owner/repo to start from")
    g.add_argument("--num-classes", type=int, default=d["num_classes"])
    g.add_argument("--seed", type=int, default=d["seed"])
    g.add_argument("--deterministic", action="store_true", default=d["deterministic"],
                   help="deterministic kernels, so CUDA runs and resumes repeat bit for bit (slower)")
    g.add_argument("--profile", action="store_true", help="profile a few steps, print top operators, exit")
    g.add_argument("--eval-only", action="store_true", help="evaluate --pretrained / --resume weights and exit")
    g.add_argument("--eval-every", type=int, default=d["eval_every"], metavar="STEPS")
    g.add_argument("--save-every", type=int, default=d["save_every"], metavar="STEPS")
    g.add_argument("--keep", type=int, default=d["keep"], help="checkpoints to keep")
    g.add_argument("--log-every", type=int, default=d["log_every"], metavar="STEPS")
    g.add_argument("--device", default=d["device"], help="auto | cpu | cuda | cuda:N")
    g.add_argument("--save-dtype", choices=["fp32", "fp16", "bf16"], default=d["save_dtype"])
    g.add_argument("--note", default=d["note"], help="free text stored in the final weights' metadata")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed args; the script's own flags go to `extra`."""
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}
    values = vars(args)
    kwargs = {k: v for k, v in values.items() if k in names}
    if kwargs.get("clip") == 0:
        kwargs["clip"] = None
    return TrainConfig(**kwargs, extra={k: v for k, v in values.items() if k not in names})
