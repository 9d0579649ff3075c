"""Trainer features beyond the loop itself: schedules, --keep-best / --early-stop, the logged gradient norm,
--compile-mode and --profile."""
import argparse
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from zoo.train import Task, TrainConfig, Trainer
from zoo.train.config import add_train_args, config_from_args
from zoo.train.best import parse_metric
from zoo.train.distributed import DistContext
from zoo.train.schedules import lr_schedule

from .conftest import needs_native_bf16
from .test_train import TINY, corpus, run, tiny_task  # noqa: F401  (corpus is a fixture)

CPU = DistContext("none", torch.device("cpu"))


# ---------------------------------------------------------------- schedules


def test_schedules_warm_up_then_follow_their_shape():
    warmup, total, floor = 10, 110, 0.1
    cosine, linear, constant, wsd = (lr_schedule(n, warmup, total, floor, decay_fraction=0.2)
                                     for n in ("cosine", "linear", "constant", "wsd"))
    for f in (cosine, linear, constant, wsd):
        assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)  # linear warm-up to the peak
        assert f(10) == pytest.approx(1.0)
    assert cosine(60) == pytest.approx(floor + (1 - floor) * 0.5)  # half way: half way down the cosine
    assert linear(60) == pytest.approx(1 - (1 - floor) * 0.5)
    assert cosine(110) == pytest.approx(floor) and linear(110) == pytest.approx(floor)
    assert constant(60) == constant(110) == 1.0
    # wsd: stable until the last 20% (22 steps of 110), then a straight line to the floor
    assert wsd(87) == 1.0 and wsd(88) == 1.0
    assert wsd(99) == pytest.approx(1 - (1 - floor) * 11 / 22)
    assert wsd(110) == pytest.approx(floor)
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        lr_schedule("step", 1, 10, 0.1)


def test_trainer_follows_the_chosen_schedule(tmp_path):
    cfg = TrainConfig(steps=20, warmup=2, schedule="wsd", decay_fraction=0.5, min_lr_ratio=0.0, lr=0.1,
                      out=str(tmp_path), workers=0, batch_size=8)
    trainer = Trainer(cfg, tiny_task(), CPU)
    rates = []
    for _ in range(20):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()  # no gradients: nothing changes, but the scheduler sees a step taken
        trainer.scheduler.step()
    assert rates[:2] == pytest.approx([0.05, 0.1]) and rates[2:10] == pytest.approx([0.1] * 8)
    assert rates[10:] == pytest.approx([0.1 * (1 - i / 10) for i in range(10)])


@pytest.mark.parametrize("flags,message", [
    (dict(early_stop=3), "--early-stop needs --keep-best"),
    (dict(keep_best="val_loss", early_stop=0), "--early-stop is a number of evaluations >= 1"),
    (dict(keep_best="accuracy:up"), "the direction after ':' is min or max"),
    (dict(decay_fraction=1.5), "--decay-fraction is a fraction"),
    (dict(min_lr_ratio=2.0), "--min-lr-ratio is a fraction"),
    (dict(schedule="step"), "--schedule must be one of cosine, linear, constant, wsd"),
])
def test_bad_schedule_and_keep_best_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(steps=1, **flags)


def test_metric_direction_follows_its_name():
    assert parse_metric("val_loss") == ("val_loss", "min")
    assert parse_metric("val_ppl") == ("val_ppl", "min")
    assert parse_metric("accuracy") == ("accuracy", "max")
    assert parse_metric("dice") == ("dice", "max")
    assert parse_metric("judge_error:max") == ("judge_error", "max")


def test_compile_mode_implies_compile():
    assert TrainConfig(steps=1, compile_mode="max-autotune").compile is True
    assert TrainConfig(steps=1).compile is False


# ---------------------------------------------------------------- --optimizer


def test_sgd_steps_like_torch_nesterov_sgd_with_decay_on_weights_only(tmp_path):
    # one batch of all 64 examples per step and a constant rate: the trainer's steps are plain full-batch
    # Nesterov SGD steps, which torch's reference (for-loop) implementation repeats on a copy of the model
    torch.manual_seed(0)
    task = tiny_task()
    reference = copy.deepcopy(task.model)
    cfg = TrainConfig(steps=5, optimizer="sgd", momentum=0.8, weight_decay=0.01, lr=0.05, warmup=0,
                      schedule="constant", clip=0, batch_size=64, workers=0, out=str(tmp_path))
    trainer = Trainer(cfg, task, CPU)
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    assert trainer.optimizer.defaults["nesterov"] and trainer.optimizer.defaults["momentum"] == 0.8
    trainer.fit()
    weights = [p for p in reference.parameters() if p.dim() > 1]
    biases = [p for p in reference.parameters() if p.dim() <= 1]
    sgd = torch.optim.SGD([{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}],
                          lr=0.05, momentum=0.8, nesterov=True, foreach=False)
    x, y = task.train_data.tensors
    for _ in range(5):
        sgd.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        sgd.step()
    for a, b in zip(params(trainer.plain), params(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # summation order of the shuffled batch


def test_sgd_resumes_exactly_and_refuses_to_resume_as_adamw(tmp_path):
    scores = {2: 0.1, 4: 0.2, 6: 0.3}
    flags = dict(steps=6, save_every=3, optimizer="sgd", lr=0.02)
    full = trainer_for(tmp_path / "full", scores, **flags)
    full.fit()
    resumed = trainer_for(tmp_path / "resumed", scores, resume="auto", **flags)
    resumed.load_checkpoint(tmp_path / "full" / "ckpt-00000003")  # its momentum buffers come back too
    resumed.fit()
    for a, b in zip(params(resumed.plain), params(full.plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    adamw = trainer_for(tmp_path / "adamw", scores, steps=6, lr=0.02)
    with pytest.raises(ValueError, match="saved by a run with --optimizer sgd: resume it with --optimizer sgd"):
        adamw.load_checkpoint(tmp_path / "full" / "ckpt-00000003")


def test_weight_decay_follows_the_optimizer_unless_given():
    parser = add_train_args(argparse.ArgumentParser(), weight_decay=0.01)  # a script's AdamW decay
    decay = {tuple(argv): config_from_args(parser.parse_args(["--steps", "1", *argv])).weight_decay
             for argv in ([], ["--optimizer", "sgd"], ["--optimizer", "sgd", "--weight-decay", "1e-3"],
                          ["--weight-decay", "0"])}
    assert decay == {(): 0.01, ("--optimizer", "sgd"): 5e-4, ("--optimizer", "sgd", "--weight-decay", "1e-3"): 1e-3,
                     ("--weight-decay", "0"): 0.0}
    extra = config_from_args(parser.parse_args(["--steps", "1"])).extra
    assert "_adamw_weight_decay" not in extra  # how the parser passes the script's decay on, not a script flag
    assert (TrainConfig(steps=1).weight_decay, TrainConfig(steps=1, optimizer="sgd").weight_decay) == (0.05, 5e-4)
    assert (TrainConfig(steps=1).momentum, TrainConfig(steps=1, optimizer="sgd").momentum) == (None, 0.9)


@pytest.mark.parametrize("flags,message", [
    (dict(momentum=0.95), "--momentum applies to --optimizer sgd \\(now --optimizer adamw"),
    (dict(optimizer="sgd", momentum=1.0), "--momentum is a fraction in \\[0, 1\\)"),
    (dict(optimizer="sgd", weight_decay=-1e-4), "--weight-decay must be >= 0"),
    (dict(optimizer="lamb"), "--optimizer must be one of adamw, sgd"),
])
def test_bad_optimizer_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(steps=1, **flags)


# ---------------------------------------------------------------- --keep-best / --early-stop


def scripted_task(scores: dict[int, float]):
    """tiny_task whose evaluation reports `scores[step]` as "score" (lower is worse unless named so)."""
    task = tiny_task()
    holder = {}
    task.summarize = lambda sums: {"score": float(scores[holder["trainer"].step])}  # "crash": ValueError
    return task, holder


def trainer_for(tmp_path, scores, **flags):
    torch.manual_seed(0)  # the same initial weights for every trainer of a test
    task, holder = scripted_task(scores)
    options = dict(warmup=1, schedule="constant", batch_size=8, workers=0, eval_every=2, out=str(tmp_path),
                   keep=10, lr=0.05)
    trainer = Trainer(TrainConfig(**{**options, **flags}), task, CPU)
    holder["trainer"] = trainer
    return trainer


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_keep_best_ships_the_best_evaluation_and_early_stop_stops(tmp_path):
    # the score rises to its best at step 4, then falls: with patience 2 the run stops at step 8 of 20
    scores = {2: 0.5, 4: 0.9, 6: 0.8, 8: 0.7, 10: 0.95}
    trainer = trainer_for(tmp_path / "run", scores, steps=20, keep_best="score", early_stop=2)
    trainer.fit()
    assert trainer.step == 8 and trainer.stopped_early_at == 8
    assert (trainer.best.step, trainer.best.value) == (4, 0.9)
    # the newest checkpoint (step 8) names the best file of step 4; the others are gone
    assert sorted(p.name for p in (tmp_path / "run").glob("best-*")) == ["best-00000004.safetensors"]
    trainer.restore_best()
    # the same run trained for exactly 4 steps (constant schedule: the same trajectory) holds those weights
    reference = trainer_for(tmp_path / "ref", scores, steps=4)
    reference.fit()
    for a, b in zip(params(trainer.plain), params(reference.plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_keep_best_resumes_exactly(tmp_path):
    scores = {2: 0.3, 4: 0.6, 6: 0.5, 8: 0.9, 10: 0.4, 12: 0.2}
    flags = dict(steps=12, keep_best="score", save_every=6)
    full = trainer_for(tmp_path / "full", scores, **flags)
    full.fit()
    full.restore_best()
    # the same run dies in its step-10 evaluation: its newest checkpoint is step 6's (best: step 4),
    # and the best file of step 8 was written after it
    crashing = trainer_for(tmp_path / "half", {**scores, 10: "crash"}, **flags)
    with pytest.raises(ValueError):
        crashing.fit()
    half = tmp_path / "half"
    assert sorted(p.name for p in half.glob("best-*")) == ["best-00000004.safetensors", "best-00000008.safetensors"]
    resumed = trainer_for(half, scores, resume="auto", **flags)
    resumed.load_checkpoint(half / "ckpt-00000006")
    assert (resumed.best.step, resumed.best.value) == (4, 0.6)
    assert not (half / "best-00000008.safetensors").exists(), "a best file newer than the checkpoint is stale"
    resumed.fit()
    resumed.restore_best()
    assert resumed.best.step == full.best.step == 8
    for a, b in zip(params(resumed.plain), params(full.plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_keep_best_with_ema_ships_the_ema_weights_of_the_best_step(tmp_path):
    scores = {2: 0.9, 4: 0.1}
    trainer = trainer_for(tmp_path, scores, steps=4, keep_best="score", ema=0.9)
    trainer.fit()
    with safe_open(str(tmp_path / "best-00000002.safetensors"), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys()}
    trainer.restore_best()
    with trainer.ema.swapped():  # evaluation and the saved file use the EMA weights: they must be step 2's
        for name, p in trainer.plain.named_parameters():
            torch.testing.assert_close(p.detach(), kept[name], rtol=0, atol=0)


class ConvBN(torch.nn.Module):
    """A net with BatchNorm running statistics, whose averages the EMA must keep with the weights'."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 1))

    def forward(self, x):
        return self.net(x)


def bn_task():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 6, 6, generator=g) * 3 + 1  # statistics far from BatchNorm's initial 0 and 1
    y = x.mean((1, 2, 3))[:, None]
    data = torch.utils.data.TensorDataset(x, y)
    return Task(name="convbn", model=ConvBN(), train_data=data, eval_data=data,
                loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                eval_step=lambda m, b: {"se": ((m(b[0]) - b[1]) ** 2).sum(), "n": torch.tensor(len(b[0]))},
                summarize=lambda s: {"mse": float(s["se"] / s["n"])})


def test_ema_averages_batchnorm_statistics_like_torch_averaged_model(tmp_path):
    from torch.optim.swa_utils import AveragedModel
    decay = 0.8
    trainer = Trainer(TrainConfig(steps=6, warmup=1, lr=0.05, out=str(tmp_path), workers=0, batch_size=8,
                                  ema=decay), bn_task(), CPU)
    # torch's own EMA over parameters and buffers, with the EMA's warm-up: the k-th update's decay is
    # min(decay, (1 + k) / (10 + k)); its first call copies the starting weights, as the EMA does
    reference = AveragedModel(trainer.plain, use_buffers=True, avg_fn=lambda avg, new, k: avg + (new - avg) * (
        1 - min(decay, (1 + int(k)) / (10 + int(k)))))  # (not torch.lerp: BatchNorm counts its batches in int64)
    reference.update_parameters(trainer.plain)
    batches = iter(trainer.train_loader)
    for _ in range(6):
        trainer.task.loss(trainer.model, next(batches)).backward()
        assert trainer._optimizer_step() is not None  # the EMA updates inside
        reference.update_parameters(trainer.plain)
    assert {"net.1.running_mean", "net.1.running_var"} <= set(trainer.ema.names)
    expected = {k: v for k, v in reference.module.state_dict().items() if v.is_floating_point()}
    live = trainer.plain.state_dict()["net.1.running_mean"].clone()
    with trainer.ema.swapped():
        got = trainer.plain.state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
        assert not torch.equal(got["net.1.running_mean"], live), "the live statistics must not be evaluated"
        x = bn_task().eval_data.tensors[0][:8]
        torch.testing.assert_close(trainer.plain.eval()(x), reference.module.eval()(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(trainer.plain.state_dict()["net.1.running_mean"], live), "swapped back out"
    state = trainer.final_state_dict()  # the shipped file: averaged weights with averaged statistics
    torch.testing.assert_close(state["net.1.running_var"], expected["net.1.running_var"], rtol=1e-6, atol=1e-7)


def test_ema_resumes_from_a_checkpoint_that_kept_only_parameters(tmp_path, monkeypatch):
    from zoo.train.ema import EMA
    cfg = dict(steps=8, warmup=1, lr=0.05, out=str(tmp_path), workers=0, batch_size=16, ema=0.8, eval_every=4,
               keep=3)
    full = Trainer(TrainConfig(**cfg), bn_task(), CPU)
    with monkeypatch.context() as m:  # the checkpoints zoo wrote before the EMA kept BatchNorm statistics
        m.setattr(EMA, "state_dict", lambda self: {"updates": torch.tensor(self.updates), **{
            n: s for n, s in zip(self.names, self.shadow) if n not in self.buffer_names}})
        full.fit()
    resumed = Trainer(TrainConfig(**cfg, resume="auto"), bn_task(), CPU)
    resumed.load_checkpoint(tmp_path / "ckpt-00000004")
    assert resumed.step == 4 and resumed.ema.updates == 4
    for name in resumed.ema.buffer_names:  # their averages restart from the loaded statistics
        i = resumed.ema.names.index(name)
        assert torch.equal(resumed.ema.shadow[i], resumed.ema.tensors[i]), name
    resumed.fit()
    for name, shadow, done in zip(resumed.ema.names, resumed.ema.shadow, full.ema.shadow):
        if name not in resumed.ema.buffer_names:  # the saved averages went on exactly
            assert torch.equal(shadow, done), name


def test_resuming_with_ema_a_run_that_had_none_is_one_clear_error(tmp_path):
    cfg = dict(steps=4, warmup=1, out=str(tmp_path), workers=0, batch_size=16, eval_every=4)
    Trainer(TrainConfig(**cfg), bn_task(), CPU).fit()
    resumed = Trainer(TrainConfig(**cfg, ema=0.9, resume="auto"), bn_task(), CPU)
    with pytest.raises(ValueError, match="has no EMA weights but --ema was given; resume without --ema"):
        resumed.load_checkpoint(tmp_path / "ckpt-00000004")


def test_keep_best_refuses_a_metric_the_evaluation_lacks(tmp_path):
    trainer = trainer_for(tmp_path, {2: 0.5}, steps=2, keep_best="accuracy")
    with pytest.raises(ValueError, match="no such metric; it reports score"):
        trainer.fit()


def test_keep_best_through_a_train_script(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "lm"
    result = run([*TINY, "--data", corpus, "--steps", "12", "--eval-every", "4", "--keep-best", "val_loss",
                  "--schedule", "linear", "--save-dtype", "fp16", "--out", str(out)])
    assert "--keep-best: the final weights are step" in result.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["zoo"])
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]
    best = min(evals, key=lambda r: r["val_loss"])
    assert meta["extra"]["best_step"] == best["step"] and meta["extra"]["best_metric"] == "val_loss"
    # the final metric is the best weights', measured again after rounding to fp16
    assert meta["metrics"]["val_loss"] == pytest.approx(best["val_loss"], abs=2e-3)
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    assert all(r["grad_norm"] > 0 and r["grad_norm_max"] >= r["grad_norm"] for r in train)


def test_early_stop_without_keep_best_is_one_clear_line(corpus):  # noqa: F811
    result = run([*TINY, "--data", corpus, "--steps", "4", "--early-stop", "2"], check=False)
    assert result.returncode == 2
    assert "--early-stop needs --keep-best" in result.stderr and "Traceback" not in result.stderr


def test_profile_reports_time_memory_and_stacks(corpus, tmp_path):  # noqa: F811
    result = run([*TINY, "--data", corpus, "--steps", "4", "--profile", "--out", str(tmp_path)])
    assert "memory allocated by operator" in result.stdout and "time by call stack" in result.stdout
    assert (tmp_path / "trace.json").is_file()


# ---------------------------------------------------------------- --teacher (distillation)


def test_soft_target_loss_is_temperature_scaled_kl():
    from zoo.train.distill import soft_target_loss
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(4, 7, 5, generator=g, requires_grad=True), torch.randn(4, 7, 5, generator=g)
    T = 3.0
    p = torch.softmax(teacher / T, -1)
    expected = (p * (p.log() - torch.log_softmax(student / T, -1))).sum(-1).mean() * T * T
    torch.testing.assert_close(soft_target_loss(student, teacher, T, class_dim=-1), expected)
    # the class dimension may sit elsewhere, e.g. (B, C, D) for segmentation
    torch.testing.assert_close(soft_target_loss(student.transpose(1, 2), teacher.transpose(1, 2), T, class_dim=1),
                               expected)
    assert soft_target_loss(teacher, teacher, T, -1).abs() < 1e-6


def test_teacher_is_refused_where_the_task_has_no_logits(tmp_path):
    with pytest.raises(ValueError, match="no class logits to distill"):
        Trainer(TrainConfig(steps=1, teacher="default", out=str(tmp_path), workers=0), tiny_task(), CPU)


def lm_task(vocab: int = 12, seed: int = 0):
    """A tiny transformer_lm on a noisy repeating sequence (something to learn), its logits over the last dim."""
    import zoo
    from zoo.data.text import BlockDataset
    torch.manual_seed(seed)
    model = zoo.load("transformer_lm", vocab_size=vocab, context=16, dim=32, n_layers=2, n_heads=2, mlp_hidden=32,
                     dropout=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(800) % vocab
    ids = torch.where(torch.rand(800, generator=g) < 0.2, torch.randint(0, vocab, (800,), generator=g), ids)

    def loss(m, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(m(x).float().flatten(0, 1), y.flatten())
    return Task(name="transformer_lm", model=model, train_data=BlockDataset(ids, 16), eval_data=None, loss=loss,
                eval_step=lambda m, b: {}, summarize=lambda s: {}, class_dim=-1)


def trained_lm(out, seed=0, vocab=12, **flags):
    cfg = TrainConfig(steps=30, warmup=2, lr=1e-2, batch_size=8, workers=0, eval_every=100, out=str(out), **flags)
    trainer = Trainer(cfg, lm_task(vocab, seed), CPU)
    trainer.fit()
    return trainer


def test_distillation_pulls_the_student_towards_the_teacher(tmp_path):
    import hashlib

    import zoo
    teacher = trained_lm(tmp_path / "teacher").plain.eval()
    teacher_file = tmp_path / "teacher.safetensors"
    zoo.save(teacher, teacher_file)
    plain = trained_lm(tmp_path / "plain", seed=1).plain.eval()
    distilling = trained_lm(tmp_path / "distilled", seed=1, teacher=str(teacher_file), distill_alpha=1.0,
                            distill_temperature=1.0)
    ids = torch.randint(0, 12, (4, 16), generator=torch.Generator().manual_seed(1))

    def kl_to_teacher(student):
        with torch.no_grad():
            return torch.nn.functional.kl_div(student(ids).log_softmax(-1), teacher(ids).log_softmax(-1),
                                              log_target=True, reduction="batchmean").item()
    # alpha 1: the student fits the teacher's distributions, not the data: far closer than a plain student
    assert kl_to_teacher(distilling.plain.eval()) < 0.5 * kl_to_teacher(plain)
    distilling.save_final({})
    with safe_open(str(tmp_path / "distilled" / "model.safetensors"), "pt") as f:
        recorded = json.loads(f.metadata()["zoo"])["extra"]["teacher"]
    assert recorded["sha256"] == hashlib.sha256(teacher_file.read_bytes()).hexdigest()
    assert (recorded["alpha"], recorded["temperature"]) == (1.0, 1.0)


def test_a_teacher_of_another_task_is_refused(tmp_path):
    import zoo
    teacher_file = tmp_path / "other.safetensors"
    zoo.save(lm_task(vocab=20).model, teacher_file)  # another vocabulary: logits of another shape
    with pytest.raises(ValueError, match="the teacher must be of the same task"):
        trained_lm(tmp_path / "s", teacher=str(teacher_file))


def test_a_teacher_with_the_classes_in_another_order_is_refused(tmp_path, caplog):
    import dataclasses

    import zoo
    names = [f"class {i}" for i in range(12)]
    teacher_file = tmp_path / "teacher.safetensors"
    zoo.save(lm_task().model, teacher_file, {"labels": names})

    def student(labels):
        task = dataclasses.replace(lm_task(seed=1), meta={"labels": labels})
        return Trainer(TrainConfig(steps=1, teacher=str(teacher_file), out=str(tmp_path / "s"), workers=0), task, CPU)
    with pytest.raises(ValueError, match=r"the order \['class 11', .*relabel the data in the teacher's order"):
        student(names[::-1])
    # other names for as many classes: distilled by position, with a warning that says so
    with caplog.at_level("WARNING", logger="zoo.train.distill"):
        student([str(i) for i in range(12)])
    assert "distilling them by position" in caplog.text
    caplog.clear()
    student(names)
    assert "by position" not in caplog.text


# ---------------------------------------------------------------- FSDP2 precision and offload


def test_fsdp_offload_trains_like_one_process(corpus, tmp_path):  # noqa: F811
    from .test_train import torchrun, train_losses
    common = [*TINY, "--data", corpus, "--steps", "4", "--eval-every", "4", "--dropout", "0"]
    run([*common, "--batch-size", "8", "--out", str(tmp_path / "one")])
    torchrun(2, [*common, "--batch-size", "4", "--dist", "fsdp", "--fsdp-offload", "--fsdp-reduce-dtype", "fp32",
                 "--out", str(tmp_path / "offload")])
    # the same global batch: the same loss curve (up to the order of the gradient reduction)
    torch.testing.assert_close(train_losses(tmp_path / "offload"), train_losses(tmp_path / "one"), atol=1e-5,
                               rtol=1e-5)


@needs_native_bf16
def test_fsdp_bf16_params_train_close_to_fp32_and_ship_fp32_weights(corpus, tmp_path):  # noqa: F811
    from .test_train import torchrun, train_losses, weights
    common = [*TINY, "--data", corpus, "--steps", "4", "--eval-every", "4", "--dropout", "0"]
    run([*common, "--batch-size", "8", "--out", str(tmp_path / "one")])
    torchrun(2, [*common, "--batch-size", "4", "--dist", "fsdp", "--fsdp-param-dtype", "bf16",
                 "--fsdp-reduce-dtype", "fp32", "--out", str(tmp_path / "bf16")])
    mixed, fp32 = torch.tensor(train_losses(tmp_path / "bf16")), torch.tensor(train_losses(tmp_path / "one"))
    # bf16 forward/backward (8 bits of mantissa): close to the fp32 curve, and not equal to it, so the
    # all-gathered parameters really were bf16 (not silently fp32 on this native-bf16 CPU)
    torch.testing.assert_close(mixed, fp32, atol=5e-2, rtol=2e-2)
    assert (mixed - fp32).abs().max() > 1e-5
    # the sharded master weights stay fp32, and so does what is saved
    assert {t.dtype for t in weights(tmp_path / "bf16").values()} == {torch.float32}


def test_fsdp_param_dtype_falls_back_to_fp32_where_it_is_not_native(monkeypatch, tmp_path):
    from .test_hardware import AMX, AVX2, play
    play(monkeypatch, AVX2)
    cfg = TrainConfig(steps=1, dist="fsdp", fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32", out=str(tmp_path))
    trainer = object.__new__(Trainer)  # only the option resolution, without a process group
    trainer.cfg, trainer.ctx, trainer.device = cfg, DistContext("fsdp", torch.device("cpu")), torch.device("cpu")
    assert trainer._fsdp_options() == {"param_dtype": None, "reduce_dtype": torch.float32, "offload": False}
    play(monkeypatch, AMX)
    assert trainer._fsdp_options()["param_dtype"] == torch.bfloat16


def test_fsdp_flags_need_dist_fsdp():
    with pytest.raises(ValueError, match="--fsdp-offload applies to --dist fsdp only"):
        TrainConfig(steps=1, fsdp_offload=True)


# ---------------------------------------------------------------- --layer-decay and --unfreeze


def test_unfreeze_spec_is_parsed_and_checked():
    from zoo.train.groups import Unfreezing
    u = Unfreezing.parse("head@0, top:2@300, all@1000")
    assert [u.deepest(s) for s in (0, 299, 300, 999, 1000)] == [0, 0, 2, 2, None]
    assert u.trains(0, 0) and not u.trains(1, 0) and u.trains(2, 300) and not u.trains(3, 300) and u.trains(9, 1000)
    for bad, message in [("top:2@5", "first stage starts at step 0"), ("head@0,all@0", "increasing steps"),
                         ("head@0,top@5", "is not head@STEP")]:
        with pytest.raises(ValueError, match=message):
            TrainConfig(steps=1, unfreeze=bad)


def small_effnet():
    import zoo
    torch.manual_seed(0)  # b0's six stages, narrow and one block deep: 50k parameters
    return zoo.load("effnetv2_cls", num_classes=3, drop_path_rate=0.0, widths=(8, 8, 16, 16, 24, 32, 32, 64),
                    depths=(1, 1, 1, 1, 1, 1))


def test_depth_groups_give_layer_decayed_rates_and_cover_every_parameter():
    from zoo.train.groups import depth_param_groups
    model = small_effnet()
    groups = depth_param_groups(model, lr=1.0, weight_decay=0.1, layer_decay=0.5)
    by_name = {g["name"]: g for g in groups}
    assert by_name["head"]["depth"] == 0 and by_name["head"]["lr"] == 1.0
    assert by_name["head conv"]["lr"] == 0.5 and by_name["stem"]["lr"] == 0.5 ** (len(model.stages) + 2)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    # no decay on BatchNorm weights and biases (vectors)
    assert all(p.dim() == 1 for g in groups if g["weight_decay"] == 0 for p in g["params"])


def image_task(model):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    return Task(name="effnetv2_cls", model=model, train_data=data, eval_data=None,
                loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                eval_step=lambda m, b: {}, summarize=lambda s: {}, class_dim=-1)


def trained_parts(tmp_path, steps, spec="head@0,top:1@2,all@4"):
    """Which of stem / last stage / head conv / head changed (weights or BatchNorm statistics) in `steps`."""
    model = small_effnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig(steps=steps, unfreeze=spec, warmup=1, lr=1e-2, batch_size=4, workers=0, eval_every=100,
                      out=str(tmp_path / f"s{steps}"))
    Trainer(cfg, image_task(model), CPU).fit()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k]) and "num_batches_tracked" not in k}
    last = f"stages.{len(model.stages) - 1}."
    return {part for part, prefix in [("stem", "stem."), ("last stage", last), ("head conv", "head_conv."),
                                      ("head", "head.")] if any(k.startswith(prefix) for k in changed)}


def test_progressive_unfreezing_trains_the_head_first_then_downwards(tmp_path):
    assert trained_parts(tmp_path, 2) == {"head"}  # BatchNorm statistics below the head stay too
    assert trained_parts(tmp_path, 4) == {"head", "head conv"}
    assert trained_parts(tmp_path, 6) == {"head", "head conv", "last stage", "stem"}


def test_progressive_resize_schedule_and_its_refusals():
    from zoo.data.images import ProgressiveResize
    resize = ProgressiveResize("16:0.4,24:0.7")
    sides = []
    for step in range(10):
        resize.set_step(step, 10)
        sides.append(resize(torch.zeros(2, 3, 32, 32)).shape[-1])
    assert sides == [16] * 4 + [24] * 3 + [32] * 3
    resize.set_step(0, 10)
    assert resize(torch.zeros(1, 3, 12, 12)).shape[-1] == 12, "a smaller image is never upsampled"
    for bad, message in [("16", "each part is SIZE:UNTIL"), ("16:1.5", "each part is SIZE:UNTIL"),
                         ("a:0.5", "each part is SIZE:UNTIL"), ("16:0.6,24:0.5", "must increase"), ("", "empty")]:
        with pytest.raises(ValueError, match=message):
            ProgressiveResize(bad)


def sides_seen(tmp_path, steps, spec, resume_from=None):
    """The input sides `small_effnet` saw in each training forward of a `steps`-step run (resumed from the
    checkpoint `resume_from` when given)."""
    from zoo.data.images import ProgressiveResize
    model = small_effnet()
    resize, seen = ProgressiveResize(spec), []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-1]) if m.training else None)
    task = image_task(model)
    loss = task.loss
    task.loss, task.before_step = (lambda m, b: loss(m, (resize(b[0]), b[1]))), resize.set_step
    cfg = TrainConfig(steps=steps, warmup=1, lr=1e-2, batch_size=4, workers=0, eval_every=100, save_every=2,
                      out=str(tmp_path), resume="auto" if resume_from else None)
    trainer = Trainer(cfg, task, CPU)
    if resume_from:
        trainer.load_checkpoint(resume_from)
    trainer.fit()
    return seen


def test_progressive_resize_follows_the_steps_and_a_resumed_run(tmp_path):
    assert sides_seen(tmp_path / "run", 4, "16:0.75") == [16, 16, 16, 32]
    # the resumed run's steps 2 and 3 get their own sides (16 until 3/4 of the steps), not a restarted schedule's
    assert sides_seen(tmp_path / "run", 4, "16:0.75", resume_from=tmp_path / "run" / "ckpt-00000002") == [16, 32]


def test_layer_decay_needs_a_family_with_depth_groups(tmp_path):
    with pytest.raises(ValueError, match="has no depth groups"):
        Trainer(TrainConfig(steps=1, layer_decay=0.8, out=str(tmp_path), workers=0), tiny_task(), CPU)


def test_a_torn_metrics_line_from_a_killed_run_is_dropped_on_resume(tmp_path, caplog):
    from zoo.train.metrics import MetricsLogger
    good = [{"split": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good) + '{"split": "tra')
    logger = MetricsLogger(tmp_path, resume_step=2)
    assert logger.records == good[:2]
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [json.dumps(r) for r in good[:2]]
    assert any("line 4 is cut short" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- stopping and cleaning up


def test_a_stop_signal_during_evaluation_checkpoints_at_once_and_resume_evaluates_first(tmp_path):
    import os
    import signal
    flags = dict(steps=4, eval_every=2, warmup=1, batch_size=8, workers=0, keep=5, log_every=1)

    def task_signalling_at(batch_number):
        task = tiny_task()
        inner, calls = task.eval_step, {"n": 0}

        def eval_step(m, b):
            calls["n"] += 1
            if calls["n"] == batch_number:  # the 2nd batch of the step-2 evaluation (8 batches each)
                os.kill(os.getpid(), signal.SIGTERM)
            return inner(m, b)
        task.eval_step = eval_step
        return task, calls

    torch.manual_seed(0)
    straight = Trainer(TrainConfig(out=str(tmp_path / "straight"), **flags), tiny_task(), CPU)
    straight.fit()
    torch.manual_seed(0)
    task, calls = task_signalling_at(2)
    stopped = Trainer(TrainConfig(out=str(tmp_path / "stopped"), **flags), task, CPU)
    with pytest.raises(SystemExit) as exit_info:
        stopped.fit()
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert calls["n"] == 2, "the evaluation must stop at the next batch, not run to its end"
    assert stopped.step == 2 and (tmp_path / "stopped" / "ckpt-00000002").is_dir()
    torch.manual_seed(0)
    resumed = Trainer(TrainConfig(out=str(tmp_path / "stopped"), resume="auto", **flags), tiny_task(), CPU)
    resumed.load_checkpoint(tmp_path / "stopped" / "ckpt-00000002")
    assert resumed.eval_pending
    resumed.fit()

    def records(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    strip = [{k: v for k, v in r.items() if k != "samples_per_s"} for r in records("straight")]
    assert [{k: v for k, v in r.items() if k != "samples_per_s"} for r in records("stopped")] == strip
    for a, b in zip(params(straight.plain), params(resumed.plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_what_killed_writers_left_is_removed_when_a_run_starts(corpus, tmp_path):  # noqa: F811
    from zoo.train.checkpoint import remove_stale_temporaries
    out = tmp_path / "lm"
    out.mkdir()
    (out / ".tmp-ckpt-00000005").mkdir()
    (out / ".tmp-ckpt-00000005" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (out / ".model.safetensors.k3j2.tmp").write_bytes(b"half")
    (out / "notes.tmp").write_text("the user's own file")
    result = run([*TINY, "--data", corpus, "--steps", "2", "--out", str(out), "--resume"])
    assert "removed what killed writers left" in result.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".tmp")) == \
        ["notes.tmp"]
    assert remove_stale_temporaries(out) == []


def test_too_few_examples_for_one_batch_says_which_batch_size_fits(tmp_path):
    with pytest.raises(ValueError, match="64 training examples make no full step .* give --batch-size 64 or less"):
        Trainer(TrainConfig(steps=1, batch_size=100, out=str(tmp_path), workers=0), tiny_task(), CPU)
