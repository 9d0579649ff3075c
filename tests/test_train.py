"""zoo.train on a tiny model and tiny synthetic data, through a real train script."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zoo
from zoo.models.base import ZooModel
from zoo.train import Task, TrainConfig, Trainer
from zoo.train.distributed import DistContext

from .test_hardware import AMX, play

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "train_scripts" / "transformer_lm.py")
TINY = ["--context", "16", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--mlp-hidden", "32",
        "--batch-size", "8", "--log-every", "1", "--warmup", "2", "--lr", "3e-3", "--workers", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    g = torch.Generator().manual_seed(0)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "fair", "day", "night"]
    text = " ".join(words[i] for i in torch.randint(0, len(words), (900,), generator=g).tolist())
    path.write_text(text + "\n")
    return str(path)


def env():
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    e.pop("WORLD_SIZE", None)
    return e


def run(args, *, check=True, timeout=300):
    result = subprocess.run([sys.executable, SCRIPT, *args], env=env(), capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stderr[-3000:]}")
    return result


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def communicate(procs, timeout):
    """Wait for launched process groups; on timeout kill them whole, so no worker outlives the test."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        raise


def torchrun(nproc, args, *, script=SCRIPT, check=True, timeout=300):
    # --standalone: the agent binds its store to a port the OS gives it, not one free_port() saw free a moment
    # ago (under pytest -n another test's gloo sockets can take that one in between)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    (out, err), = communicate([proc], timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def weights(out):
    return load_file(str(Path(out) / "model.safetensors"))


def train_losses(out):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


def assert_same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0 if atol == 0 else 1e-4, msg=k)


def test_resume_is_exact(corpus, tmp_path):
    # --deterministic changes nothing on the CPU; here it checks that the flag is wired through
    common = [*TINY, "--data", corpus, "--steps", "12", "--eval-every", "6", "--dropout", "0.1", "--deterministic"]
    run([*common, "--out", str(tmp_path / "full")])
    # the same run stopped after 6 steps: its checkpoint at step 6, then resumed in a new process
    run([*common, "--out", str(tmp_path / "half"), "--steps", "12", "--save-every", "6"])
    half = tmp_path / "half"
    for ckpt in sorted(half.glob("ckpt-*"))[1:]:
        import shutil
        shutil.rmtree(ckpt)
    (half / "model.safetensors").unlink()
    result = run([*common, "--out", str(half), "--resume"])
    assert "resumed from" in result.stderr + result.stdout
    assert_same_weights(weights(tmp_path / "full"), weights(half))
    assert train_losses(tmp_path / "full") == train_losses(half)


def test_extending_a_finished_run_follows_the_new_schedule(corpus, tmp_path):
    common = [*TINY, "--data", corpus, "--eval-every", "3", "--dropout", "0"]
    run([*common, "--steps", "6", "--out", str(tmp_path / "straight")])
    run([*common, "--steps", "3", "--out", str(tmp_path / "extended")])
    result = run([*common, "--steps", "6", "--out", str(tmp_path / "extended"), "--resume"])
    assert "schedule now runs to step 6" in result.stderr + result.stdout
    # the optimizer state saved at step 3 holds the 3-step schedule's final rate; step 4 must use the new one
    assert train_losses(tmp_path / "extended") == train_losses(tmp_path / "straight")
    assert_same_weights(weights(tmp_path / "extended"), weights(tmp_path / "straight"))


def test_checkpoints_keep_last_k_and_sigterm_saves(corpus, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, SCRIPT, *TINY, "--data", corpus, "--steps", "100000",
                             "--eval-every", "50", "--save-every", "3", "--keep", "2", "--out", str(out)],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # generous: a busy CI machine may be slow to start torch
        while len(list(out.glob("ckpt-*"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    ckpts = sorted(out.glob("ckpt-*"))
    assert len(ckpts) == 2, ckpts
    assert not list(out.glob(".tmp-*"))


KILL_IN_CHECKPOINT = """
import os, signal, sys
sys.argv = [{script!r}] + {args!r}
import zoo.train.checkpoint as ck
calls = []
original = ck.rng_state
def dying_rng_state():
    calls.append(1)
    if len(calls) == 2:  # second checkpoint: model shards written, trainer.pt not yet
        os.kill(os.getpid(), signal.SIGKILL)
    return original()
ck.rng_state = dying_rng_state
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""


def test_sigkill_while_writing_checkpoint_leaves_previous_loadable(corpus, tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--data", corpus, "--steps", "20", "--eval-every", "100", "--save-every", "4", "--out", str(out)]
    result = subprocess.run([sys.executable, "-c", KILL_IN_CHECKPOINT.format(script=SCRIPT, args=args)],
                            env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL
    assert [p.name for p in out.glob("ckpt-*")] == ["ckpt-00000004"]
    assert list(out.glob(".tmp-ckpt-*")), "the interrupted checkpoint stays a temporary folder"
    result = run([*args, "--resume"])
    assert "resumed from" in result.stderr + result.stdout and "ckpt-00000004" in result.stderr + result.stdout
    assert (out / "model.safetensors").is_file()


def test_ddp_two_processes_match_one_process_with_same_global_batch(corpus, tmp_path):
    common = [*TINY, "--data", corpus, "--steps", "6", "--eval-every", "3", "--dropout", "0"]
    run([*common, "--batch-size", "8", "--out", str(tmp_path / "one")])
    torchrun(2, [*common, "--batch-size", "4", "--dist", "ddp", "--out", str(tmp_path / "two")])
    # Same loss curve; weights are not compared exactly: Adam divides by sqrt(v), so a 1e-9 difference in
    # the order of a gradient all-reduce can flip a near-zero update by up to lr.
    torch.testing.assert_close(train_losses(tmp_path / "two"), train_losses(tmp_path / "one"), atol=1e-5, rtol=1e-5)
    assert len(train_losses(tmp_path / "one")) == 6


def test_fsdp_trains_and_resumes_on_one_process(corpus, tmp_path):
    out = tmp_path / "fsdp"
    common = [*TINY, "--data", corpus, "--eval-every", "4", "--dropout", "0"]
    torchrun(2, [*common, "--steps", "4", "--batch-size", "4", "--dist", "fsdp", "--out", str(out)])
    first = train_losses(out)
    assert first[-1] < first[0]
    # resume the 2-process FSDP checkpoint with one process (no --dist) for 4 more steps
    result = run([*common, "--steps", "8", "--batch-size", "8", "--out", str(out), "--resume"])
    assert "saved by 2 processes" in result.stderr + result.stdout
    assert len(train_losses(out)) == 8
    model = zoo.load("transformer_lm", pretrained=out / "model.safetensors")
    assert model.config.dim == 32


def test_two_nodes_on_localhost(corpus, tmp_path):
    port = free_port()
    args = [*TINY, "--data", corpus, "--steps", "3", "--eval-every", "3", "--batch-size", "4", "--dist", "ddp",
            "--out", str(tmp_path / "nodes")]
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             f"--node_rank={rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=zootest",
             SCRIPT, *args] for rank in (0, 1)]
    procs = [subprocess.Popen(c, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c in cmds]
    results = communicate(procs, 300)
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert len(train_losses(tmp_path / "nodes")) == 3


@pytest.mark.parametrize("args,message", [
    (["--data", "/nonexistent/corpus.txt", "--steps", "1"], "does not exist"),
    (["--steps", "1"], "--data is required"),
    (["--dist", "ddp", "--steps", "1"], "needs torchrun"),
    (["--pretrained", "no-such-tag", "--steps", "1"], "not a weights tag"),
    (["--steps", "1", "--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_bad_arguments_give_one_clear_line(corpus, args, message):
    if "--data" not in args and "--data" not in message:
        args = [*args, "--data", corpus]
    result = run(args, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert message in lines[-1] and "Traceback" not in result.stderr, result.stderr


def test_eval_only_reproduces_saved_metric(corpus, tmp_path):
    out = tmp_path / "run"
    # fp16 storage: the saved metric must describe the rounded weights, not the fp32 ones
    run([*TINY, "--data", corpus, "--steps", "4", "--eval-every", "4", "--out", str(out), "--save-dtype", "fp16"])
    saved = zoo.load("transformer_lm", pretrained=out / "model.safetensors").pretrained_meta
    assert saved.dtype == "float16"
    assert saved.command.startswith("python ") and "--steps 4" in saved.command
    result = run(["--data", corpus, "--eval-only", "--pretrained", str(out / "model.safetensors"), "--batch-size", "8"])
    evaluated = json.loads(result.stdout.strip().splitlines()[-1])["eval"]
    assert evaluated["val_loss"] == saved.metrics["val_loss"]
    assert (out / "metrics.csv").read_text().startswith("split,step,epoch")


# ---------------------------------------------------------------- in-process: mixed precision


class Linear2(ZooModel):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    @property
    def checkpoint_blocks(self):
        return [self.net]

    def example_inputs(self, batch=2):
        return (torch.randn(batch, 4, generator=torch.Generator().manual_seed(0)),)

    def forward(self, x):
        return self.net(x)


def tiny_task(eval_examples=64, loss=None, model=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    data = torch.utils.data.TensorDataset(x, y)

    def mse(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]).float(), batch[1])

    return Task(name="tiny", model=model or Linear2(), train_data=data,
                eval_data=torch.utils.data.TensorDataset(x[:eval_examples], y[:eval_examples]), loss=loss or mse,
                eval_step=lambda m, b: {"se": ((m(b[0]).float() - b[1]) ** 2).sum(), "n": torch.tensor(len(b[0]))},
                summarize=lambda s: {"mse": float(s["se"] / s["n"])})


def test_fp16_scaler_skips_step_with_inf_gradient(tmp_path, monkeypatch):
    play(monkeypatch, AMX)  # a CPU with native fp16: elsewhere --amp fp16 falls back to fp32, without a scaler
    cfg = TrainConfig(steps=4, amp="fp16", out=str(tmp_path), warmup=1, workers=0)
    trainer = Trainer(cfg, tiny_task(), DistContext("none", torch.device("cpu")))
    assert trainer.scaler.is_enabled()
    before = [p.detach().clone() for p in trainer.plain.parameters()]
    loss = trainer.task.loss(trainer.model, next(iter(trainer.train_loader)))
    trainer.scaler.scale(loss).backward()
    trainer.plain.net[0].weight.grad[0, 0] = float("inf")
    scale = trainer.scaler.get_scale()
    assert trainer._optimizer_step() is None
    assert trainer.skipped_steps == 1 and trainer.scaler.get_scale() < scale
    for b, p in zip(before, trainer.plain.parameters()):
        assert torch.equal(b, p), "weights must not change on a skipped step"


def test_bf16_autocast_trains_on_cpu(tmp_path, monkeypatch):
    play(monkeypatch, AMX)  # a CPU with native bf16: elsewhere --amp bf16 falls back to fp32
    cfg = TrainConfig(steps=40, amp="bf16", out=str(tmp_path), warmup=2, lr=1e-2, workers=0, batch_size=16,
                      eval_every=40, ema=0.9)
    trainer = Trainer(cfg, tiny_task(), DistContext("none", torch.device("cpu")))
    assert isinstance(trainer.scaler, torch.amp.GradScaler) and not trainer.scaler.is_enabled()
    first = trainer.evaluate()["mse"]
    final = trainer.fit()["mse"]
    assert final < first / 2
    assert (tmp_path / "metrics.jsonl").is_file()
    # the final state dict holds the EMA weights, not the training weights
    state = trainer.final_state_dict()
    for name, shadow, param in zip(trainer.ema.names, trainer.ema.shadow, trainer.plain.parameters()):
        assert torch.equal(state[name], shadow) and not torch.equal(state[name], param.detach())


# ---------------------------------------------------------------- the config and its flags


def test_flags_are_generated_from_the_config_fields():
    import argparse
    import dataclasses

    from zoo.train import add_train_args, config_from_args
    parser = add_train_args(argparse.ArgumentParser(), lr=5e-5, out="runs/x")  # a family's own defaults
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}
    assert {a.dest for a in parser._actions} - {"help"} == fields
    args = ["--steps", "3", "--clip", "0", "--resume", "--amp", "bf16", "--eval-only"]
    cfg = config_from_args(parser.parse_args(args))
    assert (cfg.lr, cfg.out, cfg.clip, cfg.resume, cfg.amp, cfg.eval_only) == (5e-5, "runs/x", None, "auto", "bf16", True)
    assert config_from_args(parser.parse_args(["--steps", "3", "--resume", "runs/old"])).resume == "runs/old"
    assert "max global gradient norm (0 disables)" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "3", "--save-dtype", "int8"])  # choices come from the field too
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    with pytest.raises(TypeError, match="not TrainConfig fields"):
        add_train_args(argparse.ArgumentParser(), learning_rate=1.0)


# ---------------------------------------------------------------- zoo.train is a library


def _matplotlib():
    try:
        import matplotlib
        return matplotlib
    except ImportError:  # optional (the train extra): metrics then draw no curves.png
        return None


def _process_state():
    import logging
    root = logging.getLogger()
    mpl = _matplotlib()
    return (root.level, list(root.handlers), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM),
            mpl and dict.__getitem__(mpl.rcParams, "backend"))  # the raw value: reading it would resolve it


def test_run_leaves_logging_signals_and_matplotlib_as_it_found_them(tmp_path, tiny):
    from tests.conftest import TinyConfig, TinyNet
    from zoo.train import run as train_run

    def tiny_regression(loss=None):  # run() saves the final weights: a registered family
        return tiny_task(loss=loss, model=TinyNet(TinyConfig(num_classes=1)))

    before = _process_state()
    cfg = TrainConfig(steps=3, warmup=1, batch_size=8, workers=0, log_every=1, eval_every=3, out=str(tmp_path / "ok"))
    train_run(cfg, lambda c: tiny_regression())
    assert _process_state() == before
    if _matplotlib() is not None:
        assert (tmp_path / "ok" / "curves.png").is_file()  # drawn without pyplot or a backend change

    calls = []

    def failing_loss(m, batch):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a loss that fails at the second step")
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    cfg = TrainConfig(steps=3, warmup=1, batch_size=8, workers=0, out=str(tmp_path / "fails"))
    with pytest.raises(ValueError, match="second step"):
        train_run(cfg, lambda c: tiny_regression(loss=failing_loss))
    assert _process_state() == before


def test_warnings_fire_once_per_run(tmp_path, caplog):
    import logging

    def nan_loss(m, batch):
        return m(batch[0]).sum() * float("nan")

    cfg = TrainConfig(steps=5, warmup=1, batch_size=8, workers=0, eval_every=5, out=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="zoo.train"):
        Trainer(cfg, tiny_task(loss=nan_loss), DistContext("none", torch.device("cpu"))).fit()
    messages = [r.getMessage() for r in caplog.records if r.name == "zoo.train"]
    assert sum("loss is nan" in m for m in messages) == 1, messages
    assert sum("step skipped" in m for m in messages) == 1, messages
    assert any("5 micro-batch(es) had a non-finite loss and 5 optimiser step(s) were skipped" in m
               for m in messages), messages


def test_train_time_is_summed_across_resumes(tmp_path):
    ctx = DistContext("none", torch.device("cpu"))
    common = dict(warmup=1, batch_size=8, workers=0, eval_every=4, out=str(tmp_path))
    first = Trainer(TrainConfig(steps=4, **common), tiny_task(), ctx)
    first.fit()
    saved = torch.load(tmp_path / "ckpt-00000004" / "trainer.pt", weights_only=True)["train_time_s"]
    assert 0 < saved <= first.train_time
    second = Trainer(TrainConfig(steps=8, resume="auto", **common), tiny_task(), ctx)
    second.load_checkpoint(tmp_path / "ckpt-00000004")
    assert second.train_time == saved
    second.fit()
    resumed = torch.load(tmp_path / "ckpt-00000008" / "trainer.pt", weights_only=True)["train_time_s"]
    assert saved < resumed <= second.train_time


def test_hardware_of_every_machine_a_resumed_run_used_is_recorded(tmp_path):
    from zoo.accel.hardware import capabilities
    here = f"{capabilities().describe()}, {torch.get_num_threads()} threads"
    ctx = DistContext("none", torch.device("cpu"))
    common = dict(warmup=1, batch_size=8, workers=0, eval_every=4, out=str(tmp_path))
    Trainer(TrainConfig(steps=4, **common), tiny_task(), ctx).fit()
    state_file = tmp_path / "ckpt-00000004" / "trainer.pt"
    state = torch.load(state_file, weights_only=True)
    assert state["hardware"] == [here]
    again = Trainer(TrainConfig(steps=8, resume="auto", **common), tiny_task(), ctx)
    again.load_checkpoint(tmp_path / "ckpt-00000004")
    assert again.hardware == [here]  # the same machine is named once
    state["hardware"] = ["CPU AMX (native bf16, VNNI), 2 threads"]  # as if the first part ran elsewhere
    torch.save(state, state_file)
    moved = Trainer(TrainConfig(steps=8, resume="auto", **common), tiny_task(), ctx)
    moved.load_checkpoint(tmp_path / "ckpt-00000004")
    moved.fit()
    assert moved.hardware == ["CPU AMX (native bf16, VNNI), 2 threads", here]
    assert torch.load(tmp_path / "ckpt-00000008" / "trainer.pt", weights_only=True)["hardware"] == moved.hardware


# ---------------------------------------------------------------- evaluation shards


@pytest.mark.parametrize("examples,counted", [(1, [False]), (9, [True, False])])
def test_short_evaluation_shard_runs_as_many_batches_as_rank_0(tmp_path, examples, counted):
    from zoo.train.loaders import eval_batches
    # rank 1 of 2 (collectives off): with 1 example its shard is empty, with 9 it holds 4 to rank 0's 5
    cfg = TrainConfig(steps=1, batch_size=4, workers=0, out=str(tmp_path))
    trainer = Trainer(cfg, tiny_task(eval_examples=examples), DistContext("none", torch.device("cpu"), 1, 2))
    assert [c for _, c in eval_batches(trainer.task, cfg, trainer.ctx, workers=0)] == counted
    seen = []
    trainer.task.summarize = lambda sums: seen.append(sums) or {}
    trainer.evaluate()
    assert seen[0].keys() == {"se", "n"} and int(seen[0]["n"]) == examples // 2  # fillers count nothing


TINY_DIST_SCRIPT = """
import sys

import torch
import torch.nn.functional as F

from tests.conftest import TINY, TinyConfig, TinyNet
from zoo.models.base import unwrap
from zoo.registry import register_model
from zoo.train import Task, TrainConfig, run, setup_logging

register_model(TINY, config=TinyConfig)(TinyNet)
dist, out, bypass = sys.argv[1], sys.argv[2], "--bypass" in sys.argv


def build(cfg):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)

    def loss(m, batch):  # --bypass: the loss on the unwrapped model, as diffusion_unet's script did
        return F.cross_entropy((unwrap(m) if bypass else m)(batch[0]), batch[1])

    def eval_step(m, batch):
        return {"correct": (m(batch[0]).argmax(-1) == batch[1]).sum(), "n": torch.tensor(len(batch[1]))}

    return Task(name=TINY, model=TinyNet(), train_data=torch.utils.data.TensorDataset(x, y),
                eval_data=torch.utils.data.TensorDataset(x[:1], y[:1]),  # fewer examples than processes
                loss=loss, eval_step=eval_step, summarize=lambda s: {"n": int(s["n"])})


setup_logging()
run(TrainConfig(steps=3, warmup=1, batch_size=4, workers=0, log_every=1, dist=dist, out=out), build)
"""


def replicas(out):
    return json.loads((Path(out) / "replicas.json").read_text())


@pytest.mark.parametrize("dist", ["ddp", "fsdp"])
def test_two_processes_one_evaluation_example(tmp_path, dist):
    script = tmp_path / "tiny_dist.py"
    script.write_text(TINY_DIST_SCRIPT)
    result = torchrun(2, [dist, str(tmp_path / "run")], script=script)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"final": {"n": 1}}
    if dist == "ddp":
        r = replicas(tmp_path / "run")
        assert r["world_size"] == 2 and r["fingerprints"][0] == r["fingerprints"][1]


def test_replica_check_catches_a_loss_outside_ddp_forward(tmp_path):
    script = tmp_path / "tiny_dist.py"
    script.write_text(TINY_DIST_SCRIPT)
    result = torchrun(2, ["ddp", str(tmp_path / "run"), "--bypass"], script=script, check=False)
    assert result.returncode != 0
    assert "the DDP replicas differ" in result.stderr
    r = replicas(tmp_path / "run")
    assert r["fingerprints"][0] != r["fingerprints"][1]


def test_recorded_command_has_paths_relative_to_the_checkout(monkeypatch):
    from zoo.train.trainer import CHECKOUT, command_line
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", [str(CHECKOUT / "train_scripts" / "x.py"), "--out", "/elsewhere/runs/a",
                                      f"--data={CHECKOUT.parent}/shared/d.txt", "--lr", "1e-3"])
    assert command_line() == "python train_scripts/x.py --out " + os.path.relpath("/elsewhere/runs/a", CHECKOUT) \
        + " --data=../shared/d.txt --lr 1e-3"
