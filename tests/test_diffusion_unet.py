"""diffusion_unet: shapes, conditioning and guidance, determinism, EMA training, the CLI grid."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo import predict

TINY = dict(image_size=8, widths=(16, 32), attention_levels=(1,), heads=2, num_classes=3, timesteps=50, dropout=0.0)


def test_forward_shapes_and_gradients():
    model = zoo.load("diffusion_unet", **TINY).train()
    x, t, y = model.example_inputs(4)
    assert model(x, t, y).shape == x.shape
    loss = model.training_loss(x.clamp(-1, 1), y)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_class_conditioning_changes_the_prediction():
    model = zoo.load("diffusion_unet", **TINY)
    for p in model.parameters():  # residual branches and the output conv start at zero: make them live
        torch.nn.init.normal_(p, std=0.1)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([10, 10])
    a, b = model(x, t, torch.tensor([0, 0])), model(x, t, torch.tensor([1, 1]))
    assert not torch.allclose(a, b)
    assert torch.equal(model(x, t, None), model(x, t, torch.tensor([3, 3]))), "None is the 'no class' token"


def test_bf16_weights_run_and_sample():
    """zoo.accel.cast: the fp32 sinusoidal timestep embedding meets the bf16 time MLP in its dtype."""
    import copy
    model = zoo.load("diffusion_unet", **TINY).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, t, y = model.example_inputs(4)
    bf16 = zoo.accel.cast(copy.deepcopy(model), "bf16", force=True)  # bf16 also where it is emulated
    with torch.no_grad():
        out, reference = bf16(x, t, y), model(x, t, y)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, atol=0.05 * reference.abs().max().item(), rtol=0.05)
    assert bf16.sample(2, classes=[0, 1], steps=3).shape == (2, 1, 8, 8)


@pytest.mark.parametrize("sampler", ["ddim", "ddpm", "dpm++"])
def test_sample_range_shape_and_seed(sampler):
    model = zoo.load("diffusion_unet", **TINY)
    a = model.sample(4, classes=[0, 1, 2, 0], steps=5, sampler=sampler, seed=3)
    b = model.sample(4, classes=[0, 1, 2, 0], steps=5, sampler=sampler, seed=3)
    assert a.shape == (4, 1, 8, 8) and a.min() >= 0 and a.max() <= 1
    assert torch.equal(a, b)


def test_sample_errors():
    model = zoo.load("diffusion_unet", **TINY)
    with pytest.raises(ValueError, match="classes must be in 0..2"):
        model.sample(2, classes=[0, 7], steps=2)
    with pytest.raises(ValueError, match="2 classes given for n=3"):
        model.sample(3, classes=[0, 1], steps=2)
    with pytest.raises(ValueError, match="unknown sampler"):
        model.sample(1, steps=2, sampler="euler")
    with pytest.raises(ValueError, match="divisible by 2"):
        zoo.load("diffusion_unet", image_size=10, widths=(16, 32, 32))


def test_new_num_classes_reinitialises_the_class_embedding(tmp_path):
    model = zoo.load("diffusion_unet", **TINY)
    zoo.save(model, tmp_path / "d.safetensors")
    with pytest.warns(UserWarning, match="class_embed.weight"):
        tuned = zoo.load("diffusion_unet", pretrained=tmp_path / "d.safetensors", num_classes=5)
    assert tuned.class_embed.num_embeddings == 6
    assert torch.equal(tuned.stem.weight, model.stem.weight)


def test_cli_writes_a_grid(tmp_path):
    model = zoo.load("diffusion_unet", **TINY)
    result, text = predict.run("diffusion_unet", model, [],
                               {"classes": "0,1", "n": "4", "out": str(tmp_path / "grid.png"), "steps": "3"})
    assert (tmp_path / "grid.png").is_file() and result["classes"] == [0, 1, 0, 1]


def test_training_script_saves_ema_weights_and_samples(tmp_path):
    root = Path(__file__).resolve().parents[1]
    script = str(root / "train_scripts" / "diffusion_unet.py")
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    args = ["--data", "digits", "--image-size", "8", "--widths", "16,32", "--steps", "6", "--eval-every", "6",
            "--batch-size", "16", "--judge-samples", "20", "--ema", "0.9", "--out", str(tmp_path / "run")]
    result = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    final = json.loads(result.stdout.strip().splitlines()[-1])["final"]
    assert {"val_loss", "recognition", "frechet", "judge_accuracy"} <= set(final)
    assert final["judge_accuracy"] > 0.9, "the judge itself must be good for the recognition rate to mean anything"
    assert (tmp_path / "run" / "samples.png").is_file()
    saved = zoo.load("diffusion_unet", pretrained=tmp_path / "run" / "model.safetensors")
    assert saved.pretrained_meta.metrics["recognition"] == final["recognition"]
