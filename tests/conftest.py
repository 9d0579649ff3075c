"""Shared fixtures: a tiny classifier registered for the duration of a test, so the machinery is
tested without waiting for (or paying for) the real families."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from zoo.models.base import ZooModel
from zoo.registry import register_model, unregister_model

# Under pytest-xdist (`pytest -n auto`, the README's command) the workers share the cores: each worker's own
# torch gets cores/workers threads. The scripts tests start (train scripts, torchrun, `zoo predict`) keep the
# default: at one thread the long --eval-only reproductions ran 3-6x longer (unet3d's Dice 307 s against 50 s)
# and held their worker for the whole tail of the run.
if os.environ.get("PYTEST_XDIST_WORKER"):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // workers))

TINY = "tiny_test_cls"

# Without native bf16 (AVX512-BF16 or AMX) the CPU emulates it: bf16 matmuls run ~100x and a bf16 Conv3d
# ~165x slower than fp32 (measured on an AVX2-only AMD EPYC). Tests about bf16 numerics on tiny tensors run
# bf16 anyway (milliseconds even when emulated); tests that merely need a fast run (training steps,
# convolutions, reproducing shipped metrics) ask for `fast_amp()` or skip with `needs_native_bf16`.
NATIVE_BF16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
NO_NATIVE_BF16 = "this CPU has no native bf16 (no AVX512-BF16, no AMX): bf16 is emulated, ~100x slower than fp32"
needs_native_bf16 = pytest.mark.skipif(not NATIVE_BF16, reason=NO_NATIVE_BF16)


NATIVE_FP16 = torch.cpu._is_amx_fp16_supported()


def long_test(spends: str):
    """Skip unless ZOO_LONG_TESTS=1 is set: a test beyond the suite's 15-minute budget (`spends`: on what)."""
    return pytest.mark.skipif(not os.environ.get("ZOO_LONG_TESTS"), reason=f"{spends}: set ZOO_LONG_TESTS=1")


def fast_amp(recorded: str = "bf16") -> str:
    """The `--amp` value to run a CPU test in: `recorded` where this CPU runs it natively, else "off" (fp32)."""
    native = {"bf16": NATIVE_BF16, "fp16": NATIVE_FP16}.get(recorded, True)
    return recorded if native else "off"


def assert_eval_only_reproduces(script: str, data_args: list[str], meta, tolerances: dict[str, float], *,
                                default_amp: str, env: dict[str, str] | None = None) -> None:
    """Run `script --eval-only --pretrained default` on the shipped weights and check each recorded metric:
    exactly in the precision the weights were evaluated in (extra.eval_amp, `default_amp` when absent), within
    its tolerance in fp32 where this CPU does not run that precision natively (emulated bf16 is ~100x slower).
    A bf16/fp16 evaluation is exact only on the CPU class the weights record (extra.hardware, the last line):
    AMX and AVX-512-BF16 kernels round differently, enough to flip a borderline prediction."""
    from zoo.accel.hardware import capabilities
    root = Path(__file__).resolve().parents[1]
    recorded = meta.extra.get("eval_amp", default_amp)
    amp = fast_amp(recorded)
    evaluated_on = (meta.extra.get("hardware") or ["unrecorded"])[-1]
    exact = amp == recorded and (amp == "off" or evaluated_on.startswith(capabilities().describe() + ", "))
    result = subprocess.run([sys.executable, str(root / "train_scripts" / script), "--eval-only", "--pretrained",
                             "default", *data_args, "--amp", amp], capture_output=True, text=True, timeout=900,
                            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", **(env or {})})
    assert result.returncode == 0, result.stderr[-2000:]
    evaluated = json.loads(result.stdout.strip().splitlines()[-1])["eval"]
    for key, tolerance in tolerances.items():
        expected = meta.metrics[key] if exact else pytest.approx(meta.metrics[key], abs=tolerance)
        assert evaluated[key] == expected, key


def fast_dtype() -> torch.dtype:
    """bf16 where this CPU has native bf16, else fp32."""
    return torch.bfloat16 if NATIVE_BF16 else torch.float32


@dataclass(frozen=True)
class TinyConfig:
    in_features: int = 4
    hidden: int = 8
    num_classes: int = 3


class TinyNet(ZooModel):
    """A two-layer classifier for machinery tests."""
    head_prefixes = ("head.",)

    def __init__(self, config: TinyConfig = TinyConfig()):
        super().__init__()
        self.config = config
        self.body = nn.Sequential(nn.Linear(config.in_features, config.hidden), nn.ReLU())
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.num_classes)

    @property
    def checkpoint_blocks(self):
        return [self.body]

    def example_inputs(self, batch: int = 2):
        return (torch.randn(batch, self.config.in_features, generator=torch.Generator().manual_seed(0)),)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))



def tiny_predict(model, inputs):
    """`zoo predict tiny_test_cls 1 2 3 4`: class probabilities of one row of numbers."""
    if not inputs:
        raise ValueError("give numbers")
    x = torch.tensor([[float(v) for v in inputs]])
    probs = model(x).softmax(-1)[0].tolist()
    return {"probs": probs}, " ".join(f"{p:.3f}" for p in probs)


@pytest.fixture
def tiny():
    """Register TinyNet as `tiny_test_cls` (with a `zoo predict` adapter and a demo) for one test."""
    from zoo import demo, predict
    register_model(TINY, config=TinyConfig)(TinyNet)
    predict.ADAPTERS[TINY], demo.DEMOS[TINY] = tiny_predict, (lambda model: "tiny demo ran")
    yield TINY
    # not monkeypatch: fixtures that depend on this one patch the registry entry, and theirs must be undone first
    unregister_model(TINY)
    predict.ADAPTERS.pop(TINY)
    demo.DEMOS.pop(TINY)


@pytest.fixture
def tiny_shipped(tiny, tmp_path, monkeypatch):
    """`tiny_test_cls` with shipped weights under tag `v1` in a temporary weights/ folder."""
    import json

    import zoo
    from zoo import registry, weights

    torch.manual_seed(0)
    model = zoo.load(tiny)
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    zoo.save(model, weights_dir / "tiny.v1.safetensors", {"labels": ["a", "b", "c"], "dataset": "random",
                                                          "metrics": {"acc": 0.5}})
    data = (weights_dir / "tiny.v1.safetensors").read_bytes()
    import hashlib
    manifest = {"tiny.v1.safetensors": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}
    (weights_dir / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(weights, "weights_dir", lambda: weights_dir)
    entry = registry._REGISTRY[tiny]
    monkeypatch.setitem(registry._REGISTRY, tiny, registry.ModelEntry(
        entry.name, entry.model_cls, entry.config_cls, {"v1": "tiny.v1.safetensors"}, "v1", entry.description))
    return model, weights_dir


class OfflineHub:
    """A local folder laid out as huggingface_hub's cache (blobs, snapshots/<commit>, refs/main), with the Hub
    client set offline onto it: hf:// URIs resolve without a network, through the real Hub code."""

    def __init__(self, cache):
        self.cache = cache

    def publish(self, repo_id: str, files, commit: str = "1" * 40) -> None:
        """`files`: a folder (its files, e.g. what save_pretrained wrote) or {name: bytes}."""
        import hashlib
        import os
        if not isinstance(files, dict):
            files = {f.name: f.read_bytes() for f in files.iterdir()}
        root = self.cache / f"models--{repo_id.replace('/', '--')}"
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text(commit)
        for name, data in files.items():
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = root / "snapshots" / commit / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: the environment is too late
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return OfflineHub(cache)
