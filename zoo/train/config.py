"""The training config and the command-line flags every train script shares.

Each field of `TrainConfig` is one flag (`batch_size` -> `--batch-size`); its type, default and help
text come from the field, so the config and the command line cannot drift apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainConfig", "add_train_args", "config_from_args"]

# each optimiser's weight decay when neither the command line nor the train script sets one
DEFAULT_WEIGHT_DECAY = {"adamw": 0.05, "sgd": 5e-4}


def _flag(default: Any, help: str | None = None, **argparse_options: Any) -> Any:
    """A config field and its flag: `help` and the argparse options (choices, metavar, ...) live in metadata."""
    return field(default=default, metadata={"help": help, **argparse_options})


@dataclass(frozen=True)
class TrainConfig:
    data: str | None = _flag(None, "training data (format depends on the family)")
    epochs: int | None = _flag(None, "epochs to train (or --steps)")
    steps: int | None = _flag(None, "optimiser steps (instead of --epochs)")
    batch_size: int = _flag(32, "per process, per micro-batch; global batch = batch size x processes x grad accum")
    lr: float = _flag(1e-3, "peak learning rate")
    schedule: str = _flag("cosine", "learning-rate schedule after the warm-up (wsd: warm-up, stable, decay)",
                          choices=["cosine", "linear", "constant", "wsd"])
    min_lr_ratio: float = _flag(0.1, "the schedule decays to lr x this")
    decay_fraction: float = _flag(0.2, "wsd: the last fraction of the steps, in which the rate decays")
    optimizer: str = _flag("adamw", "adamw (betas 0.9 and 0.95 at lr >= 5e-4, else 0.999; decoupled decay) or sgd "
                                    "(Nesterov momentum, --momentum; L2 decay added to the gradient)",
                           choices=["adamw", "sgd"])
    momentum: float | None = _flag(None, "--optimizer sgd: the Nesterov momentum (default 0.9; 0: plain SGD)")
    # None until resolved: the decays of the two optimisers differ by ~100x (AdamW's 0.05 as an L2 term would
    # stop SGD learning), so an unset decay follows the optimiser rather than the script's AdamW value
    weight_decay: float | None = _flag(None, "decay of weights (not of norms and biases): decoupled for AdamW, L2 "
                                             "for SGD (default: the script's AdamW value; 5e-4 with --optimizer sgd)")
    layer_decay: float = _flag(1.0, "layer-wise LR decay: a part d groups below the head trains at lr x this^d "
                                    "(1 = off; families with depth groups: bert_cls, effnetv2_cls)")
    unfreeze: str | None = _flag(None, "progressive unfreezing, e.g. head@0,top:2@300,all@1000: from each step on, "
                                       "the head, the head and the K groups under it, or all parts train",
                                 metavar="SPEC")
    warmup: int = _flag(100, "warm-up optimiser steps (linear)")
    grad_accum: int = _flag(1, "micro-batches accumulated per optimiser step")
    clip: float | None = _flag(1.0, "max global gradient norm (0 disables)")
    amp: str = _flag("off", "mixed precision; auto: bf16 where native (AMX/AVX512-BF16 CPUs, Ampere+ GPUs), fp16 "
                            "on older GPUs, else fp32; bf16/fp16 on hardware without native kernels run fp32 with "
                            "a warning, bf16! / fp16! force the slow path",
                     choices=["off", "auto", "bf16", "fp16", "bf16!", "fp16!"])
    qat: str | None = _flag(None, "quantization-aware training: fine-tune through fake int8 quantization (PT2E, x86 "
                                  "quantizer) for the int8 model that zoo.accel.quantize and `zoo export --int8` make "
                                  "of the saved fp32 weights (static activation ranges with convolutions, else "
                                  "dynamic); evaluations and the saved metrics are the fake-quantized model's, and "
                                  "dropout and stochastic depth are off", choices=["int8"])
    compile: bool = _flag(False, "torch.compile the model")
    compile_mode: str | None = _flag(None, "torch.compile mode (implies --compile)",
                                     choices=["default", "reduce-overhead", "max-autotune"])
    ema: float | None = _flag(None, "EMA decay, e.g. 0.999; evaluation and saved weights then use the averaged "
                              "weights (and BatchNorm statistics)", metavar="DECAY")
    dist: str = _flag("none", "data parallel under torchrun", choices=["none", "ddp", "fsdp"])
    fsdp_param_dtype: str | None = _flag(None, "--dist fsdp: compute with the gathered parameters in this dtype "
                                               "(sharded fp32 masters kept); fp32 with a warning where it is not "
                                               "native, bf16! / fp16! force it", choices=["bf16", "fp16", "bf16!", "fp16!"])
    fsdp_reduce_dtype: str | None = _flag(None, "--dist fsdp: dtype of the gradient reduce-scatter (default: the "
                                                "parameter dtype)", choices=["fp32", "bf16", "fp16"])
    fsdp_offload: bool = _flag(False, "--dist fsdp: keep the sharded parameters, gradients and optimiser state in "
                                      "CPU memory (the optimiser steps on the CPU)")
    workers: int | None = _flag(None, "DataLoader worker processes that read and augment the training and "
                                      "evaluation data; they persist across epochs (map-style data), and on CUDA "
                                      "batches come in pinned memory (default: 0 with 2 cores or fewer per "
                                      "process, else one core fewer than each process has, at most 8). Each "
                                      "sample's augmentation is seeded from --seed, its epoch and its index, so "
                                      "results and --resume do not depend on the number")
    prefetch_factor: int = _flag(2, "batches each worker loads ahead (with --workers > 0); raise it when reading "
                                    "is bursty, lower it when a batch is large in memory", metavar="BATCHES")
    out: str = _flag("runs/latest", "run folder: checkpoints, metrics, final weights")
    resume: str | None = _flag(None, "resume from the latest checkpoint in --out, or from PATH",
                               nargs="?", const="auto", metavar="PATH")
    overwrite: bool = _flag(False, "start over in an --out that holds a run: delete its checkpoints, weights "
                                   "and metrics first")
    pretrained: str | None = _flag(None, "TAG | PATH | hf://owner/repo to start from")
    teacher: str | None = _flag(None, "distil from these weights of the same task (TAG | PATH | hf://...)",
                                metavar="SPEC")
    distill_alpha: float = _flag(0.5, "--teacher: weight of the soft-target loss (1 - it: the task's loss)")
    distill_temperature: float = _flag(2.0, "--teacher: softmax temperature of teacher and student outputs")
    num_classes: int | None = _flag(None, "classes of a new task head")
    seed: int = _flag(0, "seed of weights, data order and augmentation")
    deterministic: bool = _flag(False, "deterministic kernels, so CUDA runs and resumes repeat bit for bit (slower)")
    profile: bool = _flag(False, "profile a few steps, print top operators, exit")
    eval_only: bool = _flag(False, "evaluate --pretrained / --resume weights and exit")
    eval_every: int | None = _flag(None, "optimiser steps between evaluations (default: once per epoch)",
                                   metavar="STEPS")
    save_every: int | None = _flag(None, "optimiser steps between checkpoints (default: at each evaluation)",
                                   metavar="STEPS")
    keep: int = _flag(3, "checkpoints to keep")
    keep_best: str | None = _flag(None, "keep the weights of the best evaluation by this metric and ship them "
                                        "(lower is better for *loss/*ppl/*error, higher otherwise; force with "
                                        "METRIC:min or METRIC:max)", metavar="METRIC")
    early_stop: int | None = _flag(None, "stop after this many evaluations without a better --keep-best metric",
                                   metavar="PATIENCE")
    log_every: int = _flag(10, "optimiser steps between training-loss records", metavar="STEPS")
    device: str = _flag("auto", "auto | cpu | cuda | cuda:N")
    save_dtype: str = _flag("fp32", "dtype of the final weights file", choices=["fp32", "fp16", "bf16"])
    note: str = _flag("", "free text stored in the final weights' metadata (e.g. why a run was stopped early)")
    # the script's own flags, recorded with the run; not a flag itself
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.clip == 0:  # `--clip 0` is the command line's way to say "no clipping"
            object.__setattr__(self, "clip", None)
        if self.momentum is not None and self.optimizer != "sgd":
            raise ValueError(f"--momentum applies to --optimizer sgd (now --optimizer {self.optimizer}, whose "
                             "betas are fixed)")
        if self.optimizer == "sgd" and self.momentum is None:
            object.__setattr__(self, "momentum", 0.9)
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", DEFAULT_WEIGHT_DECAY.get(self.optimizer))
        for name, value in [(f.name, getattr(self, f.name)) for f in _flag_fields()] + list(self.extra.items()):
            if isinstance(value, float) and not math.isfinite(value):  # `--lr nan` parses as a float
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        if self.epochs is None and self.steps is None and not self.eval_only:
            raise ValueError("give --epochs or --steps")
        for name in ("epochs", "steps"):  # 0 steps would save the untrained model as the result
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out and --overwrite deletes it: give one of them")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"--workers is a number of processes >= 0 (0: read in the training process), "
                             f"got {self.workers}")
        for name in ("batch_size", "grad_accum", "keep", "log_every", "prefetch_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.momentum is not None and not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"--momentum is a fraction in [0, 1), e.g. 0.9; got {self.momentum}")
        for f in _flag_fields():
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"--{_flag_name(f)} must be one of {', '.join(choices)}, got {value!r}")
        fsdp_flags = [name for name in ("fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_offload") if getattr(self, name)]
        if fsdp_flags and self.dist != "fsdp":
            raise ValueError(f"--{fsdp_flags[0].replace('_', '-')} applies to --dist fsdp only (now --dist {self.dist})")
        if self.qat is not None:
            self._check_qat()
        if self.compile_mode is not None:  # a mode without compiling would be silently ignored
            object.__setattr__(self, "compile", True)
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"--decay-fraction is a fraction of the steps in (0, 1], got {self.decay_fraction}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"--min-lr-ratio is a fraction of --lr in [0, 1], got {self.min_lr_ratio}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 steps, got {self.warmup}")
        if not 0.0 <= self.distill_alpha <= 1.0:
            raise ValueError(f"--distill-alpha is a weight in [0, 1], got {self.distill_alpha}")
        if self.distill_temperature <= 0:
            raise ValueError(f"--distill-temperature must be > 0, got {self.distill_temperature}")
        if not 0.0 < self.layer_decay <= 1.0:
            raise ValueError(f"--layer-decay is a factor in (0, 1], got {self.layer_decay}")
        if self.unfreeze is not None:
            from zoo.train.groups import Unfreezing
            Unfreezing.parse(self.unfreeze)
        if self.keep_best is not None:
            from zoo.train.best import parse_metric
            parse_metric(self.keep_best)
        if self.early_stop is not None:
            if self.keep_best is None:
                raise ValueError("--early-stop needs --keep-best METRIC: the metric whose improvement it waits for")
            if self.early_stop < 1:
                raise ValueError(f"--early-stop is a number of evaluations >= 1, got {self.early_stop}")
        if self.ema is not None and not 0.0 < self.ema < 1.0:
            raise ValueError(f"--ema is a decay in (0, 1), e.g. 0.999; got {self.ema}")

    def _check_qat(self) -> None:
        """The combinations --qat cannot train: one line each, naming why."""
        if self.dist == "fsdp":
            raise ValueError("--qat trains a traced graph of the model, which FSDP cannot shard block by block: "
                             "use --dist ddp (or none)")
        if self.amp != "off":
            raise ValueError(f"--qat trains in fp32 (the fake quantizers simulate int8 kernels fed with fp32 "
                             f"activations): drop --amp {self.amp}")
        if self.unfreeze is not None:
            raise ValueError("--qat fixes in its traced graph which BatchNorm layers update their statistics, and "
                             "--unfreeze changes that during the run: drop one of them")
        if self.eval_only:
            raise ValueError("--qat is a way to train; evaluate the int8 model of trained weights with "
                             "zoo.accel.quantize (or bench/qat.py), or drop --qat for the fp32 evaluation")
        if self.batch_size == 1:
            raise ValueError("--qat traces the model on a training batch, and a batch of 1 would fix the graph to "
                             "one example (torch.export specialises sizes of 1): use --batch-size 2 or more")


# where add_train_args leaves the script's AdamW decay for config_from_args (not a flag, not recorded)
_ADAMW_DECAY = "_adamw_weight_decay"


def _flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if f.name != "extra"]


def _flag_name(f: dataclasses.Field) -> str:
    return f.name.replace("_", "-")


def _value_type(annotation: Any) -> type:
    """`int | None` -> int: the type argparse converts the flag's text with."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner
    return annotation


def add_train_args(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """Add the shared flags; `defaults` sets a family's own defaults (e.g. lr=5e-5)."""
    fields = _flag_fields()
    unknown = set(defaults) - {f.name for f in fields}
    if unknown:
        raise TypeError(f"add_train_args got defaults for {sorted(unknown)}, which are not TrainConfig fields")
    hints = typing.get_type_hints(TrainConfig)
    g = parser.add_argument_group("training (shared by every train script)")
    # the script's decay is an AdamW one: it applies where --weight-decay is not given and the optimiser is AdamW
    adamw_decay = defaults.pop("weight_decay", DEFAULT_WEIGHT_DECAY["adamw"])
    parser.set_defaults(**{_ADAMW_DECAY: adamw_decay})
    for f in fields:
        options = {k: v for k, v in f.metadata.items() if v is not None}
        default = defaults.get(f.name, f.default)
        if f.name == "weight_decay":
            options["help"] = options["help"].replace("the script's AdamW value", f"{adamw_decay:g} with AdamW")
        kind = _value_type(hints[f.name])
        if kind is bool:
            g.add_argument(f"--{_flag_name(f)}", action="store_true", default=default, **options)
        else:
            g.add_argument(f"--{_flag_name(f)}", type=kind, default=default, **options)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed args; the script's own flags go to `extra`."""
    names = {f.name for f in _flag_fields()}
    values = dict(vars(args))
    adamw_decay = values.pop(_ADAMW_DECAY, None)
    if values.get("weight_decay") is None and values.get("optimizer", "adamw") == "adamw" and adamw_decay is not None:
        values["weight_decay"] = adamw_decay
    return TrainConfig(**{k: v for k, v in values.items() if k in names},
                       extra={k: v for k, v in values.items() if k not in names})
