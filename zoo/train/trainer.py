"""The one training loop every train script shares.

A script describes its family as a `Task` (model, data, loss, evaluation) and calls `run(cfg, build_task)`.
The loop brings AMP, compile, gradient accumulation and clipping, warm-up + cosine LR, EMA,
DDP/FSDP2 under torchrun (with a check at the end that the DDP replicas hold equal weights), atomic
checkpoints with exact resume, progress bars, metrics files and a profiler switch. It is a library:
logging is configured by the script's command line (`setup_logging`), not here.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, Sampler

from zoo._deps import MissingPackage
from zoo._io import atomic_write_bytes
from zoo.accel.amp import autocast, fastest_dtype, grad_scaler, resolve_dtype
from zoo.accel.compile import compile as zoo_compile
from zoo.models.base import ZooModel
from zoo.train.best import BestTracker, best_file, best_files
from zoo.train.distill import Distillation
from zoo.train.checkpoint import (claim_run_folder, find_checkpoint, load_checkpoint, remove_stale_temporaries,
                                  save_checkpoint)
from zoo.train.config import TrainConfig
from zoo.train.distributed import DistContext, fingerprint, init_distributed
from zoo.train.groups import Unfreezing, depth_param_groups
from zoo.train.loaders import TrainBatches, default_workers, eval_batches, to_device
from zoo.train.ema import EMA
from zoo.train.qat import FakeQuantized, first_call
from zoo.train.metrics import MetricsLogger, format_metrics
from zoo.train.schedules import lr_schedule

log = logging.getLogger("zoo.train")

__all__ = ["Task", "Stream", "Trainer", "run", "seed_everything", "decay_param_groups", "setup_logging",
           "main_guard"]


@dataclass
class Task:
    """What a train script supplies; everything else is the shared loop."""
    name: str  # registry name, for the saved weights
    model: ZooModel
    train_data: Dataset | Stream | None  # map-style (sampled, split and resumed here) or a Stream
    eval_data: Dataset | None
    # (model, batch) -> scalar loss. `model` may be a DDP wrapper, which all-reduces the gradients only of
    # what runs through its forward: call `model(...)`, never a method of the unwrapped model.
    loss: Callable[[nn.Module, Any], Tensor]
    # (model, batch) -> sums, added over batches and ranks; the same keys and shapes for every batch
    eval_step: Callable[[nn.Module, Any], dict[str, Tensor]]
    summarize: Callable[[dict[str, Tensor]], dict[str, Any]]  # summed totals -> metrics
    collate: Callable | None = None
    batch_sampler: Callable[[Sampler, int], Iterable[list[int]]] | None = None  # e.g. group by length
    param_groups: Callable[[nn.Module, TrainConfig], list[dict]] | None = None  # e.g. layer-wise LR decay
    meta: dict[str, Any] = field(default_factory=dict)  # labels, preprocessing, dataset for zoo.save
    eval_batch_size: int | None = None
    # e.g. save a sample grid: (model, metrics, out, is_main); runs on every rank because a sharded (FSDP)
    # model needs all of them for a forward pass; only the main rank should write.
    after_eval: Callable[[nn.Module, dict, Path, bool], None] | None = None
    # expensive metrics measured once on the final weights (and by --eval-only), e.g. sample quality;
    # runs on every rank with the EMA weights in place, returns metrics merged into the saved ones
    final_eval: Callable[[nn.Module], dict[str, Any]] | None = None
    # the dimension of the model's output that holds the class logits (-1: (B, C) or (B, T, V); 1: (B, C, D, H, W));
    # None when the output is not logits: then --teacher (distillation) is refused
    class_dim: int | None = None
    # (step, total_steps) before each training step's forward passes (the step a resumed run is at), e.g. a
    # schedule of image sizes (zoo.data.images.ProgressiveResize)
    before_step: Callable[[int, int], None] | None = None


class Stream(Protocol):
    """What the loop needs of an iterable training dataset (`Task.train_data`), e.g. zoo.data.shards.ShardStream:
    it splits itself across the ranks, has a length, and resumes by skipping. It reads each sample's
    randomness from the sample (as `SeededSamples` does for map-style data), so a resume repeats it."""

    def split(self, *, rank: int, world_size: int, batch_size: int) -> None:
        """Once, before iterating: this rank's part; may refuse (a ValueError) data too small to split."""

    def __len__(self) -> int:
        """Examples each rank yields per epoch after `split`: a whole number of batches, the same on every rank."""

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Before each iteration: yield `epoch`'s examples after its first `skip` (a whole number of batches)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def use_deterministic_kernels() -> None:
    """Same inputs, same bits: on CUDA, kernels that add with atomics (index_add, scatter, some backward
    passes) and cuBLAS's workspace choice can make two identical runs differ, and Adam turns tiny gradient
    differences into lr-sized updates. Kernels with no deterministic version warn rather than stop the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: set it first
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def make_optimizer(cfg: TrainConfig, groups: list[dict], fused: bool) -> torch.optim.Optimizer:
    """--optimizer over the parameter groups (each carries its own weight decay). Fused: one kernel over all
    parameters instead of a loop per group (a third of a BERT fine-tuning step on CPU was the optimiser);
    FSDP's DTensor parameters need the foreach path (fused=False)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, fused=fused)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95 if cfg.lr >= 5e-4 else 0.999), fused=fused)


def decay_param_groups(model: nn.Module, weight_decay: float, lr: float | None = None) -> list[dict]:
    """Optimiser groups: decay on weight matrices and kernels, none on norms, biases and other vectors."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if lr is not None:
        for g in groups:
            g["lr"] = lr
    return [g for g in groups if g["params"]]


class Trainer:
    def __init__(self, cfg: TrainConfig, task: Task, ctx: DistContext):
        self.cfg, self.task, self.ctx = cfg, task, ctx
        self.device = ctx.device
        self.out = Path(cfg.out)
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.workers = cfg.workers if cfg.workers is not None else default_workers(ctx.world_size)
        self.train_data = TrainBatches(task, cfg, ctx, self.workers) if task.train_data is not None else None
        self.train_loader = self.train_data.loader if self.train_data is not None else None
        self.steps_per_epoch = (len(self.train_loader) // cfg.grad_accum) if self.train_loader else 0
        if self.train_loader is not None and self.steps_per_epoch == 0:
            if self.train_data.is_stream:  # its length is per process, in whole batches
                raise ValueError(f"the training stream yields {len(task.train_data)} examples per process, no full "
                                 f"step of batch {cfg.batch_size} x {cfg.grad_accum} accumulation: give a smaller "
                                 "--batch-size or --grad-accum, or more training data")
            fit = len(task.train_data) // (ctx.world_size * cfg.grad_accum)
            raise ValueError(f"{len(task.train_data)} training examples make no full step of batch "
                             f"{cfg.batch_size} x {ctx.world_size} processes x {cfg.grad_accum} accumulation: "
                             + (f"give --batch-size {fit} or less" if fit else "give more training data"))
        self.plain = task.model.to(self.device)
        self.qat = None  # --qat: the model's fake-quantized graph trains, over the model's own parameters and buffers
        if cfg.qat:
            with torch.random.fork_rng(devices=[]):  # tracing draws random numbers: the caller's stream stays
                self.qat = FakeQuantized(self.plain, *self._first_call())
        runs = self.qat if self.qat is not None else self.plain
        if cfg.compile:
            zoo_compile(runs, mode=cfg.compile_mode or "default")  # in place: keys and methods unchanged
        self.model = ctx.wrap(runs, **self._fsdp_options())
        self.unfreezing = Unfreezing.parse(cfg.unfreeze) if cfg.unfreeze else None
        self.optimizer = make_optimizer(cfg, self._param_groups(), fused=ctx.mode != "fsdp")
        # resolved once (one warning per run): bf16/fp16 without native kernels on this device fall back to
        # fp32 unless forced (--amp bf16!); the autocast calls below then take the resolved dtype as is
        self.amp_dtype = (fastest_dtype(self.device) if cfg.amp == "auto"
                          else resolve_dtype(self.device, cfg.amp if cfg.amp != "off" else "fp32"))
        self.scaler = grad_scaler(self.device, self.amp_dtype, force=True)
        self.ema = EMA(self.plain, cfg.ema) if cfg.ema else None
        # the loss of a training step: the task's own, or with --teacher the task's mixed with soft targets
        self.distillation = (Distillation(task.name, task.loss, task.class_dim, self.plain, cfg.teacher,
                                          cfg.distill_alpha, cfg.distill_temperature, self.device,
                                          task.meta.get("labels"))
                             if cfg.teacher else None)
        self.step_loss = self.distillation.loss if self.distillation else task.loss
        self.total_steps = cfg.steps if cfg.steps is not None else (cfg.epochs or 0) * self.steps_per_epoch
        factor = lr_schedule(cfg.schedule, min(cfg.warmup, self.total_steps), self.total_steps, cfg.min_lr_ratio,
                             cfg.decay_fraction)
        factors = factor
        if self.unfreezing is not None:  # a frozen group's rate is 0 until its stage begins
            factors = [lambda step, depth=g["depth"]: factor(step) * self.unfreezing.trains(depth, step)
                       for g in self.optimizer.param_groups]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factors)
        self.best = BestTracker.from_flags(cfg.keep_best, cfg.early_stop) if cfg.keep_best else None
        if self.best is not None and task.eval_data is None:
            raise ValueError(f"--keep-best {cfg.keep_best} needs evaluation data to measure it on")
        self._best_at_checkpoint: int | None = None  # the best step the newest checkpoint refers to
        self.stopped_early_at: int | None = None
        self.eval_pending = False  # this step's evaluation was abandoned for a stop signal: run it on resume
        self.skipped_steps = 0
        self.nonfinite_losses = 0  # micro-batches whose loss was inf/NaN (without fp16 scaling)
        self.train_time = 0.0  # seconds in fit(), summed over resumes (kept in the checkpoints)
        # train_time_s means little without the machines it was spent on: each one a resumed run ran on, in order
        self.hardware = [_hardware_line(self.device)]
        self._fit_started: float | None = None
        self.last_eval: dict[str, Any] = {}
        self._stop_signal: int | None = None

    def _first_call(self) -> tuple[tuple, dict]:
        """The model call of the task's loss on the first training batch: what --qat traces."""
        if self.train_loader is None:
            raise ValueError("--qat traces the model on a training batch: give training data (--data)")
        self._start_epoch()
        return first_call(self.task.loss, to_device(next(iter(self.train_loader)), self.device))

    def _fsdp_options(self) -> dict[str, Any]:
        """--fsdp-param-dtype / --fsdp-reduce-dtype / --fsdp-offload as DistContext.wrap's options; a dtype
        without native kernels here resolves to fp32 (one warning), as --amp does."""
        cfg = self.cfg
        if self.ctx.mode != "fsdp":
            return {}
        param = resolve_dtype(self.device, cfg.fsdp_param_dtype) if cfg.fsdp_param_dtype else None
        reduce = resolve_dtype(self.device, cfg.fsdp_reduce_dtype) if cfg.fsdp_reduce_dtype else None
        return {"param_dtype": None if param == torch.float32 else param, "reduce_dtype": reduce,
                "offload": cfg.fsdp_offload}

    def _param_groups(self) -> list[dict]:
        cfg, task = self.cfg, self.task
        by_depth = cfg.layer_decay != 1.0 or self.unfreezing is not None
        if task.param_groups is not None:
            if by_depth:
                raise ValueError(f"the {task.name} train script builds its own parameter groups; --layer-decay "
                                 "and --unfreeze are not available for it")
            return task.param_groups(self.plain, cfg)
        if not by_depth:
            return decay_param_groups(self.plain, cfg.weight_decay)
        try:
            groups = depth_param_groups(self.plain, cfg.lr, cfg.weight_decay, cfg.layer_decay)
        except NotImplementedError as e:
            raise ValueError(str(e)) from None
        self._norms_by_depth: dict[int, list[nn.Module]] = {}
        parts = self.plain.depth_groups()
        for index, (_, modules) in enumerate(parts):
            self._norms_by_depth[len(parts) - 1 - index] = [
                m for module in modules for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
        return groups

    def _hold_frozen_parts(self) -> None:
        """--unfreeze, before a step's forward: frozen parts' BatchNorm layers keep their statistics; at a new
        stage, say what trains from now on."""
        u = self.unfreezing
        for depth, norms in self._norms_by_depth.items():
            if not u.trains(depth, self.step):
                for m in norms:
                    m.eval()
        if u.starts_a_stage(self.step) and self.ctx.is_main:
            names = [g["name"] for g in self.optimizer.param_groups if u.trains(g["depth"], self.step)]
            log.info("--unfreeze: from step %d training %s", self.step, ", ".join(dict.fromkeys(reversed(names))))

    def _drop_frozen_grads(self) -> None:
        for group in self.optimizer.param_groups:
            if not self.unfreezing.trains(group["depth"], self.step):
                for p in group["params"]:
                    p.grad = None

    def _start_epoch(self) -> None:
        self.train_data.start_epoch(self.epoch, self.batch_in_epoch)

    # ------------------------------------------------------------------ checkpoints

    def _app_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def save_checkpoint(self) -> Path:
        trainer_state = {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                         "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                         "world_size": self.ctx.world_size, "skipped_steps": self.skipped_steps,
                         "train_time_s": self._train_time(), "hardware": self.hardware,
                         "best": self.best.state_dict() if self.best else None,
                         "stopped_early_at": self.stopped_early_at, "eval_pending": self.eval_pending,
                         "config": {k: v for k, v in vars(self.cfg).items() if k != "extra"}}
        path = save_checkpoint(self.out, self.step, self._app_state(), trainer_state, self.ctx, self.cfg.keep)
        if self.ctx.is_main:
            log.info("checkpoint %s", path)
        if self.best is not None:
            self._best_at_checkpoint = self.best.step
            self._prune_best_files(keep={self.best.step})
        return path

    def load_checkpoint(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        saved_config = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)["config"]
        saved_qat = saved_config.get("qat")
        if saved_qat != self.cfg.qat:  # the fake quantizers' state is in the checkpoint, or not
            saved = f"with --qat {saved_qat}" if saved_qat else "without --qat"
            raise ValueError(f"{path} was saved by a run {saved}: resume it {saved}")
        saved_optimizer = saved_config.get("optimizer", "adamw")  # checkpoints from before the flag: AdamW
        if saved_optimizer != self.cfg.optimizer:  # the other optimiser's state would not load
            raise ValueError(f"{path} was saved by a run with --optimizer {saved_optimizer}: resume it with "
                             f"--optimizer {saved_optimizer}")
        state = self._app_state()
        # "ema" partial: checkpoints from before the EMA kept BatchNorm statistics have only the parameters'
        trainer_state = load_checkpoint(path, state, self.ctx, partial=("ema",))
        if self.ema is not None and "updates" not in state["ema"]:
            raise ValueError(f"{path} has no EMA weights but --ema was given; resume without --ema")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])  # the statistics' averages it lacks restart from the model's
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        self._follow_schedule()
        self.scaler.load_state_dict(trainer_state["scaler"])
        self.step, self.epoch = trainer_state["step"], trainer_state["epoch"]
        self.skipped_steps = trainer_state.get("skipped_steps", 0)
        self.train_time = trainer_state.get("train_time_s", 0.0)  # checkpoints before it was kept: unknown
        saved_hardware = trainer_state.get("hardware") or ["unrecorded (a checkpoint from before it was kept)"]
        here = _hardware_line(self.device)
        self.hardware = saved_hardware + ([here] if here != saved_hardware[-1] else [])
        self.stopped_early_at = trainer_state.get("stopped_early_at")
        self.eval_pending = trainer_state.get("eval_pending", False)
        if self.best is not None:
            self._resume_best(trainer_state.get("best"), path)
        same_world = trainer_state["world_size"] == self.ctx.world_size
        # Another number of processes shards the data differently: restart the epoch's order.
        self.batch_in_epoch = trainer_state["batch_in_epoch"] if same_world else 0
        if self.ctx.is_main:
            log.info("resumed from %s at step %d (epoch %d%s)", path, self.step, self.epoch,
                     "" if same_world else f", saved by {trainer_state['world_size']} processes")
            saved = trainer_state["config"]
            if (saved.get("steps"), saved.get("epochs")) != (self.cfg.steps, self.cfg.epochs):
                log.info("the learning-rate schedule now runs to step %d (the saved run's ended sooner or later)",
                         self.total_steps)

    def _follow_schedule(self) -> None:
        """Set each group's learning rate from this run's schedule at the resumed step. The optimizer state
        holds the rate the saving run's schedule chose; when --steps/--epochs changed (a finished run
        extended), the first step after resuming would otherwise still use the old schedule's rate."""
        s = self.scheduler
        lrs = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs

    # ------------------------------------------------------------------ best weights (--keep-best)

    def _resume_best(self, saved: dict | None, path: Path) -> None:
        if saved is None:
            raise ValueError(f"{path} was saved by a run without --keep-best; resume it without --keep-best "
                             "(or start a new run with it)")
        self.best.load_state_dict(saved)
        self._best_at_checkpoint = self.best.step
        if self.best.step is not None and not best_file(self.out, self.best.step).is_file():
            raise FileNotFoundError(f"{path} says the best weights are {best_file(self.out, self.best.step)}, "
                                    "which is missing; resume from the newest checkpoint of this run folder")
        # files of steps after the checkpoint come from a run that went on and stopped; those steps run again
        self._prune_best_files(keep={s for s in best_files(self.out) if s <= self.step})

    def _prune_best_files(self, keep: set[int | None]) -> None:
        if self.ctx.is_main:
            for step, file in best_files(self.out).items():
                if step not in keep:
                    file.unlink(missing_ok=True)

    def _keep_if_best(self, metrics: dict[str, Any]) -> None:
        """After an evaluation: if it is the best so far, write its weights (collective under FSDP)."""
        from safetensors.torch import save_file
        from zoo._io import atomic_path
        if not self.best.update(metrics, self.step):
            return
        state = self.final_state_dict()
        if self.ctx.is_main:
            with atomic_path(best_file(self.out, self.step)) as tmp:
                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp),
                          metadata={"step": str(self.step), self.best.metric: repr(self.best.value)})
            # the previous best stays while the newest checkpoint still names it
            self._prune_best_files(keep={self.step, self._best_at_checkpoint})
            log.info("best %s so far: %s at step %d", self.best.metric, self.best.value, self.step)
        self.ctx.barrier()

    def restore_best(self) -> None:
        """Put the best evaluation's weights into the model (and the EMA, whose weights they are)."""
        if self.best.step is None:  # no evaluation ran (a resumed run that was already finished has one)
            return
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        self.ctx.barrier()
        state = load_file(str(best_file(self.out, self.best.step)))
        set_model_state_dict(self._weights_owner, state, options=StateDictOptions(full_state_dict=True))
        if self.ema is not None:
            self.ema.reset_to_live()
        if self.ctx.is_main:
            log.info("--keep-best: the final weights are step %d's (%s %s)", self.best.step, self.best.metric,
                     self.best.value)

    @property
    def amp_name(self) -> str:
        """The precision really used, in --amp's words ("off" for fp32, also after a fallback)."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.amp_dtype, "off")

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, interruptible: bool = False) -> dict[str, Any] | None:
        """The task's metrics on the evaluation data. `interruptible`: a stop signal (on any rank) abandons
        the evaluation between batches and returns None, so a run asked to stop checkpoints within a batch's
        time instead of finishing a long evaluation into the cluster's SIGKILL."""
        if self.task.eval_data is None:
            return {}
        self.model.eval()
        sums: dict[str, Tensor] = {}
        with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
            for batch, counted in eval_batches(self.task, self.cfg, self.ctx, self.workers):
                if interruptible and self._should_stop():
                    self.model.train()
                    return None
                batch = to_device(batch, self.device)
                with autocast(self.device, self.amp_dtype, force=True):
                    part = self.task.eval_step(self.model, batch)
                if not counted:
                    part = {k: torch.zeros_like(v) for k, v in part.items()}
                for k, v in part.items():
                    v = v.detach().double() if v.is_floating_point() else v.detach().long()
                    sums[k] = sums[k] + v if k in sums else v
        for k in sorted(sums):  # same order on every rank
            sums[k] = self.ctx.all_reduce_sum(sums[k]).cpu()
        self.model.train()
        return self.task.summarize(sums)

    # ------------------------------------------------------------------ training

    @contextlib.contextmanager
    def _stop_on_signals(self):
        """Inside, SIGINT/SIGTERM ask for a checkpoint and a stop after the current step (a second one stops
        at once); the caller's handlers are back afterwards. Python takes signals only in the main thread,
        so from another thread the loop runs without them."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._stop_signal is not None:  # second signal: stop now
                raise KeyboardInterrupt
            self._stop_signal = signum
            if self.ctx.is_main:
                log.warning("signal %d: saving a checkpoint after this step, then stopping", signum)
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _should_stop(self) -> bool:
        flag = torch.tensor(float(self._stop_signal is not None))
        return bool(self.ctx.all_reduce_sum(flag).item() > 0) if self.ctx.enabled else bool(flag)

    def _optimizer_step(self) -> float | None:
        """Unscale, clip, step; returns the gradient norm, or None when the step was skipped."""
        if self.unfreezing is not None:
            self._drop_frozen_grads()
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.clip if self.cfg.clip else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        finite = bool(torch.isfinite(norm))
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # skips by itself when gradients are not finite
            self.scaler.update()
        elif finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not finite:
            self.skipped_steps += 1
            if self.skipped_steps == 1:  # once; fit() reports the count at the end
                log.warning("step %d: gradient norm is %s, step skipped", self.step, norm.item())
            return None
        if self.ema is not None:
            self.ema.update()
        return float(norm)

    def fit(self) -> dict[str, Any]:
        """Train to `total_steps`; returns the last evaluation. Under DDP it ends by checking the replicas."""
        from tqdm import tqdm
        metrics = MetricsLogger(self.out, self.step) if self.ctx.is_main else None
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not self.ctx.is_main, dynamic_ncols=True,
                   desc=self.task.name, unit="step")
        self._fit_started = time.perf_counter()
        try:
            with self._stop_on_signals():
                self._train_loop(metrics, bar)
        finally:
            self.train_time = self._train_time()
            self._fit_started = None
            bar.close()
            if metrics:
                metrics.close()
        if self.ctx.is_main and (self.nonfinite_losses or self.skipped_steps):
            log.warning("%d micro-batch(es) had a non-finite loss and %d optimiser step(s) were skipped for "
                        "non-finite gradients", self.nonfinite_losses, self.skipped_steps)
        self.check_replicas()
        return self.last_eval

    def _train_time(self) -> float:
        running = time.perf_counter() - self._fit_started if self._fit_started is not None else 0.0
        return self.train_time + running

    def _train_loop(self, metrics: MetricsLogger | None, bar) -> None:
        cfg, ctx = self.cfg, self.ctx
        eval_every = cfg.eval_every or self.steps_per_epoch
        save_every = cfg.save_every or eval_every
        window_loss, window_n, window_samples, t0 = torch.zeros((), dtype=torch.float64), 0, 0, time.perf_counter()
        norms: list[float] = []  # gradient norms (before clipping) of the window's steps
        self.model.train()
        if self.eval_pending:  # the checkpoint was saved in place of this evaluation: it comes first
            self._evaluate_step(metrics, bar, done=self.step == self.total_steps)
        while self.step < self.total_steps and self.stopped_early_at is None:
            self._start_epoch()
            micro = 0
            for batch in self.train_loader:
                batch = to_device(batch, self.device)
                if self.unfreezing is not None:
                    self._hold_frozen_parts()
                if self.task.before_step is not None:
                    self.task.before_step(self.step, self.total_steps)
                last_micro = (micro + 1) % cfg.grad_accum == 0
                with ctx.no_sync(self.model) if not last_micro else contextlib.nullcontext():
                    with autocast(self.device, self.amp_dtype, force=True):
                        loss = self.step_loss(self.model, batch)
                    if not self.scaler.is_enabled() and not torch.isfinite(loss.detach()):
                        self.nonfinite_losses += 1
                        if self.nonfinite_losses == 1:  # once; fit() reports the count at the end
                            log.warning("step %d: loss is %s", self.step, loss.item())
                    self.scaler.scale(loss / cfg.grad_accum).backward()
                window_loss += loss.detach().double().cpu() / cfg.grad_accum
                window_samples += _batch_size(batch)
                micro += 1
                if not last_micro:
                    continue
                norm = self._optimizer_step()
                if norm is not None:
                    norms.append(norm)
                self.scheduler.step()
                self.step += 1
                self.batch_in_epoch += cfg.grad_accum
                window_n += 1
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    mean_loss = float(ctx.all_reduce_sum(window_loss.clone()).item() / (window_n * ctx.world_size))
                    rate = window_samples * ctx.world_size / (time.perf_counter() - t0)
                    lr = self.scheduler.get_last_lr()[0]
                    bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", samples_s=f"{rate:.1f}")
                    if metrics:
                        record = {"split": "train", "step": self.step, "epoch": self.epoch, "loss": mean_loss,
                                  "lr": lr, "samples_per_s": rate, "skipped_steps": self.skipped_steps}
                        if norms:  # the same on every rank: computed on the all-reduced gradients
                            record.update(grad_norm=sum(norms) / len(norms), grad_norm_max=max(norms))
                        metrics.log(record)
                    window_loss, window_n, window_samples, t0 = torch.zeros((), dtype=torch.float64), 0, 0, time.perf_counter()
                    norms = []
                done = self.step == self.total_steps
                if eval_every and (self.step % eval_every == 0 or done):
                    done = self._evaluate_step(metrics, bar, done)
                stop = self._should_stop()
                if (save_every and self.step % save_every == 0) or done or stop:
                    self.save_checkpoint()
                if stop:
                    raise SystemExit(128 + (self._stop_signal or signal.SIGTERM))
                if done:
                    return
            # the epoch ran out
            self.epoch += 1
            self.batch_in_epoch = 0

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Under DDP every rank holds a full copy of the weights, and after a step they must be equal; a loss
        computed outside the wrapper's forward has its gradients never all-reduced, and the copies drift apart
        without an error. Writes <out>/replicas.json (every rank's fingerprint of its parameters) from rank 0,
        then raises RuntimeError if any differs. (FSDP keeps one sharded copy: nothing to compare.)"""
        ctx = self.ctx
        if ctx.mode != "ddp":
            return
        prints = ctx.all_gather(fingerprint(list(self.plain.parameters())))  # (world, 3)
        if ctx.is_main:
            record = {"world_size": ctx.world_size, "fingerprints": prints.tolist()}
            atomic_write_bytes(self.out / "replicas.json", json.dumps(record).encode())
        differ = [r for r in range(ctx.world_size) if not torch.equal(prints[r], prints[0])]
        if differ:
            raise RuntimeError(
                f"after {self.step} steps the DDP replicas differ: rank(s) {differ} hold other weights than rank 0 "
                f"(fingerprints in {self.out / 'replicas.json'}). The gradients were not all-reduced: the task's "
                "loss must run through the wrapped model's forward (`model(...)`), not a method of the unwrapped one")

    def _evaluate_step(self, metrics: MetricsLogger | None, bar, done: bool) -> bool:
        """The evaluation after a step; returns whether training is done (the last step, or --early-stop)."""
        self.eval_pending = not self._eval_and_log(metrics, bar)
        if self.eval_pending:
            if self.ctx.is_main:
                log.warning("stop signal: the evaluation of step %d is abandoned; --resume runs it first", self.step)
            return done
        if self.best is not None and self.best.should_stop and not done:
            self.stopped_early_at = self.step
            if self.ctx.is_main:
                log.info("--early-stop: %d evaluations without a better %s (best %s at step %d); stopping at "
                         "step %d", self.best.evals_since_best, self.best.metric, self.best.value, self.best.step,
                         self.step)
            return True
        return done

    def _eval_and_log(self, metrics: MetricsLogger | None, bar) -> bool:
        """Evaluate, keep the best, log; False when a stop signal abandoned the evaluation."""
        if self.task.eval_data is None:
            return True
        evaluated = self.evaluate(interruptible=True)
        if evaluated is None:
            return False
        self.last_eval = evaluated
        if self.best is not None:
            self._keep_if_best(self.last_eval)
        if self.ctx.is_main:
            bar.write(f"step {self.step} epoch {self.epoch}: {format_metrics(self.last_eval)}")
            if metrics:
                metrics.log({"split": "eval", "step": self.step, "epoch": self.epoch, **self.last_eval})
        if self.task.after_eval is not None:
            self.model.eval()
            self.task.after_eval(self.plain, self.last_eval, self.out, self.ctx.is_main)
            self.model.train()
        return True

    # ------------------------------------------------------------------ final weights

    @property
    def _weights_owner(self) -> nn.Module:
        """What the shipped weights are read from and written to: the wrapped model (gathered under FSDP), or with
        --qat the plain model, whose parameters and buffers the fake-quantized graph trains."""
        return self.plain if self.qat is not None else self.model

    def final_state_dict(self) -> dict[str, Tensor]:
        """Full (gathered) state dict on CPU, with EMA weights when EMA is on; collective under FSDP."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
            state = get_model_state_dict(self._weights_owner,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            # copy inside the swap: on CPU the "offloaded" tensors are the parameters themselves, which
            # hold the training weights again once the EMA is swapped back out
            return {k: v.detach().clone() for k, v in state.items()}

    @torch.no_grad()
    def round_weights(self) -> None:
        """Round the (EMA) weights to --save-dtype in place, so final metrics describe the saved file."""
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[self.cfg.save_dtype]
        tensors = self.ema.shadow if self.ema is not None else [p for p in self.plain.parameters()]
        for t in tensors:
            t.copy_(t.to(dtype).to(t.dtype))
        for b in self.plain.buffers():
            if b.is_floating_point():
                b.copy_(b.to(dtype).to(b.dtype))

    def final_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        if self.task.final_eval is None:
            return metrics
        self.model.eval()
        with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
            extra = self.task.final_eval(self.plain)
        return {**metrics, **extra}

    def save_final(self, final_metrics: dict[str, Any]) -> Path | None:
        import zoo
        state_dict = self.final_state_dict()
        if not self.ctx.is_main:
            return None
        dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[self.cfg.save_dtype]
        meta = dict(self.task.meta)
        meta["command"] = command_line()
        meta["metrics"] = {k: v for k, v in final_metrics.items() if isinstance(v, (int, float, str))}
        extra = dict(meta.get("extra", {}))
        if self.cfg.note:
            extra["note"] = self.cfg.note
        extra.update(train_steps=self.step, world_size=self.ctx.world_size, eval_amp=self.amp_name,
                     train_time_s=round(self.train_time, 1), hardware=self.hardware, torch=torch.__version__,
                     skipped_steps=self.skipped_steps)
        if self.best is not None:
            extra.update(best_step=self.best.step, best_metric=self.best.metric)
        if self.stopped_early_at is not None:
            extra["stopped_early_at"] = self.stopped_early_at
        if self.qat is not None:  # fp32 weights trained for this int8 model (zoo.accel.quantize's method)
            extra.update(qat=self.cfg.qat, qat_method=self.qat.method)
        if self.distillation is not None:
            source = self.distillation.teacher.pretrained_source or {}
            extra["teacher"] = {"spec": self.cfg.teacher, "sha256": source.get("sha256"),
                                "alpha": self.cfg.distill_alpha, "temperature": self.cfg.distill_temperature}
        meta["extra"] = extra
        path = self.out / "model.safetensors"
        zoo.save(self.plain, path, meta, dtype=dtype, state_dict=state_dict)
        log.info("saved %s", path)
        return path

    # ------------------------------------------------------------------ profiling

    def profile(self, steps: int = 5) -> str:
        from torch.profiler import ProfilerActivity, profile, schedule
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._start_epoch()
        batches = iter(self.train_loader)
        self.model.train()
        self.out.mkdir(parents=True, exist_ok=True)
        try:  # a TensorBoard trace (open with `tensorboard --logdir <out>/tb`) when tensorboard is installed
            import tensorboard  # noqa: F401
            from torch.profiler import tensorboard_trace_handler
            on_trace_ready = tensorboard_trace_handler(str(self.out / "tb"))
        except ImportError:
            on_trace_ready = None
        with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps),
                     record_shapes=True, profile_memory=True, with_stack=True,
                     on_trace_ready=on_trace_ready) as prof:
            for _ in range(steps + 2):
                batch = to_device(next(batches), self.device)
                with autocast(self.device, self.amp_dtype, force=True):
                    loss = self.step_loss(self.model, batch)
                self.scaler.scale(loss).backward()
                self._optimizer_step()
                prof.step()
        trace = self.out / "trace.json"
        prof.export_chrome_trace(str(trace))
        device = "cuda" if self.device.type == "cuda" else "cpu"
        averages = prof.key_averages()
        time_table = averages.table(sort_by=f"self_{device}_time_total", row_limit=15)
        memory_table = averages.table(sort_by=f"self_{device}_memory_usage", row_limit=10)
        stacks = prof.key_averages(group_by_stack_n=5).table(sort_by=f"self_{device}_time_total", row_limit=5)
        where = f"Chrome trace (open in chrome://tracing or Perfetto): {trace}"
        if on_trace_ready is not None:
            where += f"\nTensorBoard trace: tensorboard --logdir {self.out / 'tb'}"
        return (f"time by operator\n{time_table}\nmemory allocated by operator\n{memory_table}\n"
                f"time by call stack (5 frames)\n{stacks}\n{where}")


def _batch_size(batch) -> int:
    if isinstance(batch, Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return 0


CHECKOUT = Path(__file__).resolve().parents[2]  # where the recorded command is meant to be run from


def _hardware_line(device: torch.device) -> str:
    """What this process trains on, e.g. "CPU AVX2 (no native bf16, no VNNI), 2 threads"; the GPUs only for a
    CUDA run (probing them would create a CUDA context in a CPU run)."""
    from zoo.accel.hardware import capabilities
    return f"{capabilities(cuda=device.type == 'cuda').describe()}, {torch.get_num_threads()} threads"


def command_line() -> str:
    """The command as a reader of the weights' card can rerun it from the checkout: absolute paths (a run folder
    in /home/..., data beside the checkout) are recorded relative to the checkout."""
    launcher = "torchrun --nproc_per_node=" + os.environ["LOCAL_WORLD_SIZE"] + " " \
        if "LOCAL_WORLD_SIZE" in os.environ else "python "
    return launcher + " ".join(shlex.quote(_relative(a)) for a in sys.argv)


def _relative(arg: str) -> str:
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    return flag + eq + os.path.relpath(value, CHECKOUT)


# Mistakes a user can fix. RuntimeError is left out on purpose: torch raises it for internal failures,
# whose traceback the user (or we) need; a missing optional package (MissingPackage) is one line.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, MissingPackage)


def run(cfg: TrainConfig, build_task: Callable[[TrainConfig], Task]) -> dict[str, Any]:
    """Set up, build the family's task, then evaluate, profile or train; returns the final metrics.

    A library call: logging is the caller's to configure (a train script's main calls `setup_logging`),
    and the signal handlers the training loop installs are gone again when it returns or raises."""
    if cfg.deterministic:
        use_deterministic_kernels()
    ctx = init_distributed(cfg.dist, cfg.device)
    try:
        if not (cfg.resume or cfg.eval_only or cfg.profile):  # a new run: never into another run's folder
            claim_run_folder(cfg.out, overwrite=cfg.overwrite, is_main=ctx.is_main)
        if ctx.is_main and not (cfg.eval_only or cfg.profile):
            removed = remove_stale_temporaries(cfg.out)
            if removed:
                log.info("removed what killed writers left in %s: %s", cfg.out, ", ".join(removed))
        ctx.barrier()
        seed_everything(cfg.seed)  # same initial weights on every rank
        task = build_task(cfg)
        trainer = Trainer(cfg, task, ctx)
        seed_everything(cfg.seed + ctx.rank)  # different dropout streams per rank (augmentation: per sample)
        if cfg.resume:
            path = find_checkpoint(cfg.resume, cfg.out)
            if path is not None:
                trainer.load_checkpoint(path)
            elif ctx.is_main:
                log.info("no checkpoint in %s yet; starting fresh", cfg.out)
        if cfg.eval_only:
            metrics = trainer.final_metrics(trainer.evaluate())
            if ctx.is_main:
                log.info("evaluated in %s (--amp %s)", trainer.amp_name.replace("off", "fp32"), cfg.amp)
                print(json.dumps({"eval": metrics, "amp": trainer.amp_name}, default=str))
            return metrics
        if cfg.profile:
            if trainer.train_loader is None:
                raise ValueError("--profile needs training data (--data)")
            report = trainer.profile()
            if ctx.is_main:
                print(report)
            return {}
        if trainer.train_loader is None:
            raise ValueError("no training data: pass --data")
        metrics = trainer.fit()
        if trainer.best is not None:  # ship the best evaluation's weights, measured again as stored
            trainer.restore_best()
            metrics = trainer.evaluate() if cfg.save_dtype == "fp32" else metrics
        if cfg.save_dtype != "fp32":
            # measure what is shipped: round the weights to the storage precision, then evaluate again
            trainer.round_weights()
            metrics = trainer.evaluate() if trainer.task.eval_data is not None else metrics
        metrics = trainer.final_metrics(metrics)
        trainer.save_final(metrics)
        if ctx.is_main and metrics:
            print(json.dumps({"final": metrics}, default=str))
        return metrics
    finally:
        ctx.close()


def setup_logging(rank: int | None = None) -> None:
    """Logging for a train script's command line: INFO messages on stderr from rank 0, only warnings and
    errors from the other ranks (one voice). `rank` defaults to torchrun's RANK."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")


def main_guard(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a train script's main; a user error becomes one clear line and exit code 2."""
    try:
        main(argv)
        return 0
    except USER_ERRORS as e:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train"
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
