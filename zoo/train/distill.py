"""Knowledge distillation (--teacher SPEC): the student learns the teacher's temperature-softened outputs.

    loss = (1 - alpha) * task loss  +  alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))

(Hinton et al., 2015; the T^2 keeps the soft term's gradients the size of the hard term's as T changes.)
The task's own loss runs unchanged: the student is called through a wrapper that also runs the teacher
on the very same inputs (after the task's augmentation, e.g. mixup) and keeps both outputs. The teacher
is in eval mode, without gradients, inside the same autocast as the student, so in the student's precision.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Distillation", "soft_target_loss"]

log = logging.getLogger(__name__)


def soft_target_loss(student: Tensor, teacher: Tensor, temperature: float, class_dim: int) -> Tensor:
    """T^2 * KL(teacher || student) over `class_dim`, averaged over every other position (examples, tokens)."""
    s = student.float().movedim(class_dim, -1).flatten(0, -2) / temperature
    t = teacher.float().movedim(class_dim, -1).flatten(0, -2) / temperature
    kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
    return kl * temperature ** 2


class _WithTeacher(nn.Module):
    """Stands in for the student in the task's loss: returns the student's output, records (student, teacher)."""

    def __init__(self, student: nn.Module, teacher: nn.Module):
        super().__init__()
        self.student, self.teacher = student, teacher
        self.outputs: list[tuple[Tensor, Tensor]] = []

    def forward(self, *args, **kwargs):
        out = self.student(*args, **kwargs)
        with torch.no_grad():
            target = self.teacher(*args, **kwargs)
        self.outputs.append((out, target))
        return out


class Distillation:
    def __init__(self, task_name: str, task_loss: Callable[[nn.Module, Any], Tensor], class_dim: int | None,
                 student: nn.Module, spec: str, alpha: float, temperature: float, device: torch.device,
                 labels: Sequence[str] | None = None):
        import zoo
        if class_dim is None:
            raise ValueError(f"--teacher: the {task_name} train script has no class logits to distill "
                             "(distillation works for bert_cls, effnetv2_cls and transformer_lm)")
        self.task_loss, self.class_dim, self.alpha, self.temperature = task_loss, class_dim, alpha, temperature
        self.teacher = zoo.load(task_name, pretrained=spec).to(device).eval().requires_grad_(False)
        mine, theirs = (getattr(getattr(m, "config", None), "tokenizer", None) for m in (student, self.teacher))
        if mine != theirs:
            raise ValueError(f"--teacher {spec} reads its input with tokenizer {theirs!r}, the student with "
                             f"{mine!r}: a teacher must see the same token ids; give one of the same tokenizer")
        self.spec = spec
        _check_classes(spec, list(labels) if labels else None, self.teacher)

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        both = _WithTeacher(model, self.teacher)
        hard = self.task_loss(both, batch)
        if len(both.outputs) != 1:
            raise RuntimeError(f"distillation expects the task's loss to call the model once, not "
                               f"{len(both.outputs)} times")
        (student, teacher), = both.outputs
        if student.shape != teacher.shape:
            raise ValueError(f"--teacher {self.spec} gives outputs of shape {tuple(teacher.shape)}, the student "
                             f"{tuple(student.shape)}: the teacher must be of the same task (the same classes)")
        soft = soft_target_loss(student, teacher, self.temperature, self.class_dim)
        return (1 - self.alpha) * hard + self.alpha * soft


def _check_classes(spec: str, labels: list[str] | None, teacher: nn.Module) -> None:
    """Soft targets are matched to the student's outputs by position: refuse the teacher's classes in another
    order (every target would go to the wrong class), warn of classes named differently (e.g. 0/1 against
    negative/positive: the same order, most likely, but only the caller knows)."""
    meta = getattr(teacher, "pretrained_meta", None)
    theirs = list(meta.labels) if meta is not None and meta.labels else None
    if labels is None or theirs is None or labels == theirs:
        return
    if sorted(labels) == sorted(theirs):
        raise ValueError(f"--teacher {spec} predicts the classes {theirs}, the student's data has them in the "
                         f"order {labels}: the soft targets would go to the wrong classes; relabel the data in "
                         "the teacher's order (bert_cls: --label-names with the teacher's names in its order)")
    log.warning("--teacher %s names its classes %s, the student's data %s: distilling them by position",
                spec, theirs, labels)
