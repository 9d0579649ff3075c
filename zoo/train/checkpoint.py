"""Training checkpoints: atomic folders holding everything an exact resume needs.

    out/ckpt-00000100/
        model + optimiser + EMA    through torch.distributed.checkpoint (sharded under FSDP, so a
                                   run can resume on a different number of processes)
        trainer.pt                 scheduler, scaler, step, epoch, batch position, config
        rng-<rank>.pt              every RNG state of each process

A checkpoint is written under a temporary name and renamed when complete, so a process killed
mid-write leaves the previous checkpoints loadable and no half checkpoint that looks whole.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zoo._io import atomic_path

PREFIX = "ckpt-"
_NAME = re.compile(rf"^{PREFIX}(\d{{8}})$")


def rng_state() -> dict[str, Any]:
    # numpy's key array goes in as a tensor so the file loads with torch.load(weights_only=True)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos,
                                                     has_gauss, cached), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(out: str | Path) -> list[Path]:
    out = Path(out)
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if _NAME.match(p.name) and (p / "trainer.pt").is_file())


def find_checkpoint(spec: str, out: str | Path) -> Path | None:
    """--resume auto: the newest complete checkpoint in `out` (None if there is none); else the given folder."""
    if spec == "auto":
        found = list_checkpoints(out)
        return found[-1] if found else None
    path = Path(spec)
    if path.is_dir() and not (path / "trainer.pt").is_file():
        found = list_checkpoints(path)  # a run folder: take its newest
        if found:
            return found[-1]
    if not (path / "trainer.pt").is_file():
        raise FileNotFoundError(f"--resume {spec}: not a checkpoint folder (no trainer.pt) and no {PREFIX}* inside")
    return path


# What a run leaves in --out (the loop's own files; a task's extras such as samples.png are rewritten anyway)
RUN_FILES = ("model.safetensors", "metrics.jsonl", "metrics.csv", "curves.png", "replicas.json", "trace.json", "tb")


def run_contents(out: str | Path) -> list[Path]:
    """The files and folders of an earlier run in `out`: checkpoints (whole or half-written), --keep-best's
    best-*.safetensors and RUN_FILES."""
    out = Path(out)
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir()
                  if p.name in RUN_FILES or p.name.startswith((PREFIX, f".tmp-{PREFIX}", "best-", ".best-")))


def claim_run_folder(out: str | Path, *, overwrite: bool, is_main: bool) -> None:
    """Before a new run (not --resume) writes anything: refuse an --out that holds another run, unless
    --overwrite, which deletes that run's files (on the main process; the caller then waits at a barrier)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a run folder; give a folder path")
    found = run_contents(out)
    if not found:
        return
    if not overwrite:
        names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(f"--out {out} already holds a run ({names}): add --resume to continue it, "
                         "--overwrite to delete it and start over, or give another --out")
    if is_main:
        for p in found:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        logging.getLogger("zoo.train").info("--overwrite: deleted the earlier run's %s in %s",
                                            ", ".join(p.name for p in found), out)


def remove_stale_temporaries(out: str | Path) -> list[str]:
    """Before a run (new or resumed) writes into `out`: delete what killed writers left, half-written checkpoint
    folders (.tmp-ckpt-*, each as large as a checkpoint) and atomic writes' temporary files (.NAME.*.tmp)
    of the run's own files. Returns the names removed."""
    out = Path(out)
    if not out.is_dir():
        return []
    own = RUN_FILES + ("best-",)
    stale = [p for p in out.iterdir()
             if p.name.startswith(f".tmp-{PREFIX}")
             or (p.name.endswith(".tmp") and p.name.startswith(tuple(f".{name}" for name in own)))]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return [p.name for p in stale]


def save_checkpoint(out: str | Path, step: int, app_state: dict[str, Any], trainer_state: dict[str, Any],
                    ctx, keep: int) -> Path:
    """Collective under DDP/FSDP: every rank calls it. Returns the final folder."""
    import torch.distributed.checkpoint as dcp

    out = Path(out)
    final = out / f"{PREFIX}{step:08d}"
    tmp = out / f".tmp-{PREFIX}{step:08d}"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ctx.barrier()
    with warnings.catch_warnings():  # one process without a process group is a supported case, not a problem
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(app_state, checkpoint_id=str(tmp))
    with atomic_path(tmp / f"rng-{ctx.rank}.pt") as p:
        torch.save(rng_state(), p)
    ctx.barrier()
    if ctx.is_main:
        with atomic_path(tmp / "trainer.pt") as p:  # written last: its presence marks a complete checkpoint
            torch.save(trainer_state, p)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    ctx.barrier()
    return final


def load_checkpoint(path: Path, app_state: dict[str, Any], ctx, partial: tuple[str, ...] = ()) -> dict[str, Any]:
    """Fill `app_state` in place from the checkpoint; returns the trainer state and restores this rank's RNG.
    `partial`: entries of `app_state` (dicts) whose keys the checkpoint may lack; those keys are dropped from them."""
    import torch.distributed.checkpoint as dcp

    saved = check_fits(path, app_state)
    for entry in partial:
        if entry in app_state:
            app_state[entry] = {k: v for k, v in app_state[entry].items() if f"{entry}.{k}" in saved}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(app_state, checkpoint_id=str(path))
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    rng_file = path / f"rng-{ctx.rank}.pt"
    if rng_file.is_file() and trainer_state.get("world_size") == ctx.world_size:
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    return trainer_state


def check_fits(path: Path, app_state: dict[str, Any]) -> dict[str, Any]:
    """ValueError naming the differing keys or shapes when the checkpoint's model is not this run's (another
    family, or other architecture flags such as --dim or --n-layers), instead of DCP's error from deep inside.
    Returns the checkpoint's flattened keys ("model.x.weight", "ema.updates", ...) with their metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is the user's to replace
        raise ValueError(f"--resume {path}: its model and optimiser state cannot be read ({type(e).__name__}: "
                         f"{e}); resume from another checkpoint or start over with --overwrite") from None
    ours = {f"model.{k}": tuple(v.shape) for k, v in app_state["model"].items() if isinstance(v, torch.Tensor)}
    theirs = {k: tuple(m.size) for k, m in saved.items()
              if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    shapes = [k for k in sorted(set(ours) & set(theirs)) if ours[k] != theirs[k]]
    if not (missing or unexpected or shapes):
        return saved
    what = []
    if shapes:
        k = shapes[0]
        what.append(f"{len(shapes)} shape(s) differ, e.g. {k[6:]} is {list(theirs[k])} there, {list(ours[k])} here")
    if missing:
        what.append(f"{len(missing)} of this model's keys are not in it (e.g. {missing[0][6:]})")
    if unexpected:
        what.append(f"it has {len(unexpected)} keys this model lacks (e.g. {unexpected[0][6:]})")
    raise ValueError(f"--resume {path}: the checkpoint is of another model: {'; '.join(what)}; resume with the "
                     "family and architecture flags (--dim, --n-layers, --widths, ...) of the run that wrote it, "
                     "or start a new run")
