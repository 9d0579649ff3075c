"""Every family on a CUDA GPU: same outputs as on the CPU, fp16 autocast training with loss scaling,
torch.compile, bf16 weights, activation checkpointing, and the train script under NCCL (DDP, FSDP2).

Skipped where no GPU is present (CI has none); run on a GPU machine with `pytest tests/test_cuda.py`.
"""
import copy

import pytest
import torch

import zoo
from zoo.accel.amp import autocast, grad_scaler
from zoo.bench import example_loss
from zoo.blocks.attention import attention

from .test_train import TINY, corpus, run, torchrun, train_losses  # noqa: F401 (corpus is a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FAMILIES = {
    "effnetv2_cls": (dict(variant="b0", num_classes=10, drop_rate=0.0, drop_path_rate=0.0), dict(size=64)),
    "bert_cls": (dict(variant="minilm-l6", layers=2, hidden=64, heads=4, intermediate=128, vocab_size=1200,
                      num_classes=3, hidden_dropout=0.0, attention_dropout=0.0,
                      classifier_dropout=0.0), dict(length=24)),
    "transformer_lm": (dict(vocab_size=50, context=32, dim=64, n_layers=2, n_heads=4, mlp_hidden=96, dropout=0.0),
                       {}),
    "unet3d_seg": (dict(preset="small", norm="group"), dict(size=16)),
    "diffusion_unet": (dict(image_size=8, widths=(16, 32), attention_levels=(1,), heads=2, num_classes=3,
                            timesteps=50, dropout=0.0), {}),
}


@pytest.fixture(autouse=True)
def exact_fp32():
    """TF32 would make fp32 CUDA results differ from the CPU's by ~1e-3; compare true fp32."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def family(name, device="cpu", batch=2):
    config, example = FAMILIES[name]
    torch.manual_seed(0)
    model = zoo.load(name, **config)
    return model.to(device), to(model.example_inputs(batch, **example), device)


def to(inputs, device):
    return tuple(t.to(device) for t in inputs)


def first(out):
    return out[0] if isinstance(out, (list, tuple)) else out


def loss_of(model, inputs):
    torch.manual_seed(1)  # the diffusion loss draws t and noise: the same draws for each call
    return example_loss(model, inputs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_forward_and_gradients_match_the_cpu(name):
    model, inputs = family(name)
    model.eval()  # the diffusion loss draws from the global RNG, which differs by device: compare forward only
    gpu = copy.deepcopy(model).cuda()
    with torch.no_grad():
        torch.testing.assert_close(first(gpu(*to(inputs, "cuda"))).cpu(), first(model(*inputs)), atol=1e-4, rtol=1e-4)
    if name == "diffusion_unet":
        return
    model.train(), gpu.train()
    loss_of(model, inputs).backward()
    loss_of(gpu, to(inputs, "cuda")).backward()
    for (key, p), q in zip(model.named_parameters(), gpu.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-4, rtol=1e-3, msg=key)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp16_autocast_steps_with_loss_scaling(name):
    model, inputs = family(name, "cuda")
    model.train()
    reference = loss_of(model, inputs).item()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = grad_scaler("cuda", "fp16")
    assert scaler.is_enabled()
    # The scaler starts at 2**16; where that overflows fp16 in backward, it skips the step and halves the
    # scale, so a real step comes within a few tries, with finite gradients.
    for _ in range(12):
        with autocast("cuda", "fp16"):
            loss = loss_of(model, inputs)
        assert abs(loss.item() - reference) <= 2e-2 * max(1.0, abs(reference))
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if finite:
            break
        assert scaler.get_scale() < scale and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert finite, "no step with finite gradients in 12 tries"
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_compile_on_cuda_matches_eager(name):
    model, inputs = family(name, "cuda")
    model.eval()
    with torch.no_grad():
        eager = first(model(*inputs))
        compiled = zoo.accel.compile(copy.deepcopy(model), freeze=True, strict=True)
        torch.testing.assert_close(first(compiled(*inputs)), eager, atol=1e-3, rtol=1e-3)


def test_compiled_training_step_on_cuda_matches_eager():
    model, inputs = family("transformer_lm", "cuda")
    model.train()
    compiled = zoo.accel.compile(copy.deepcopy(model), strict=True)
    loss_of(model, inputs).backward()
    loss_of(compiled, inputs).backward()
    for p, q in zip(model.parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", ["bert_cls", "effnetv2_cls"])
def test_bf16_weights_on_cuda(name):
    model, inputs = family(name, "cuda")
    model.eval()
    with torch.no_grad():
        reference = first(model(*inputs))
        out = first(zoo.accel.cast(copy.deepcopy(model), "bf16")(*inputs))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [dict(padding=True), dict(causal=True, window=8)])
def test_attention_on_cuda_matches_fp32_on_the_cpu(dtype, options):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 40, 32, generator=g) for _ in range(3))
    keep = torch.ones(3, 40, dtype=torch.bool)
    keep[1, 25:] = keep[2, 7:] = False
    kwargs = dict(causal=options.get("causal", False), window=options.get("window"))
    reference = attention(q, k, v, key_padding_mask=keep if options.get("padding") else None, **kwargs)
    qc, kc, vc = (t.cuda().to(dtype).requires_grad_() for t in (q, k, v))
    out = attention(qc, kc, vc, key_padding_mask=keep.cuda() if options.get("padding") else None, **kwargs)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), reference, atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (qc, kc, vc))


def test_activation_checkpointing_on_cuda_gives_the_same_gradients():
    model, inputs = family("unet3d_seg", "cuda")
    model.train()

    def grads():
        model.zero_grad()
        loss_of(model, inputs).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    zoo.accel.checkpointing(model, "blocks")
    for a, b in zip(plain, grads()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_sampling_and_generation_on_cuda():
    model, _ = family("diffusion_unet")
    model = model.cuda()
    a = model.sample(3, classes=[0, 1, 2], steps=4, seed=3)
    assert a.shape == (3, 1, 8, 8) and a.device.type == "cpu" and torch.equal(a, model.sample(3, classes=[0, 1, 2],
                                                                                              steps=4, seed=3))
    lm, _ = family("transformer_lm")
    prompt = torch.tensor([[1, 2, 3]])
    on_cpu = lm.generate(prompt, max_new_tokens=40, temperature=0)
    on_gpu = lm.cuda().generate(prompt.cuda(), max_new_tokens=40, temperature=0)
    assert torch.equal(on_gpu.cpu(), on_cpu)


def test_train_script_fp16_on_cuda_resumes_exactly(corpus, tmp_path):  # noqa: F811
    common = [*TINY, "--data", corpus, "--eval-every", "3", "--dropout", "0", "--device", "cuda", "--amp", "fp16",
              "--save-every", "3", "--deterministic"]
    run([*common, "--steps", "6", "--out", str(tmp_path / "straight")])
    run([*common, "--steps", "6", "--out", str(tmp_path / "again")])
    run([*common, "--steps", "3", "--out", str(tmp_path / "resumed")])
    run([*common, "--steps", "6", "--out", str(tmp_path / "resumed"), "--resume"])
    straight, again, resumed = (train_losses(tmp_path / name) for name in ("straight", "again", "resumed"))
    assert len(straight) == len(resumed) == 6 and straight[-1] < straight[0]
    # with --deterministic two runs repeat bit for bit on an H200; the resumed run extends a finished 3-step
    # run, which once took its first step at the old schedule's final rate (1% off at step 5)
    assert again == straight, f"two identical runs differ: {straight} vs {again}"
    assert resumed == straight, f"resumed {resumed} vs straight {straight}"


@pytest.mark.parametrize("dist", ["ddp", "fsdp"])
def test_train_script_under_nccl(corpus, tmp_path, dist):  # noqa: F811
    out = tmp_path / dist
    common = [*TINY, "--data", corpus, "--eval-every", "4", "--dropout", "0", "--device", "cuda", "--amp", "bf16"]
    torchrun(1, [*common, "--steps", "4", "--dist", dist, "--out", str(out)])
    losses = train_losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0]
    model = zoo.load("transformer_lm", pretrained=out / "model.safetensors")
    assert model.config.dim == 32


@pytest.mark.parametrize("flags", [["--fsdp-param-dtype", "bf16", "--fsdp-reduce-dtype", "fp32"],
                                   ["--fsdp-param-dtype", "fp16", "--fsdp-reduce-dtype", "fp32"],
                                   ["--fsdp-offload"]])
def test_fsdp_mixed_precision_and_offload_under_nccl(corpus, tmp_path, flags):  # noqa: F811
    out = tmp_path / "fsdp"
    common = [*TINY, "--data", corpus, "--eval-every", "6", "--dropout", "0", "--device", "cuda"]
    torchrun(1, [*common, "--steps", "6", "--dist", "fsdp", *flags, "--out", str(out)])
    losses = train_losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0]
    saved = zoo.load("transformer_lm", pretrained=out / "model.safetensors")
    # the masters stay fp32 under a low-precision compute dtype; the saved weights are those masters
    assert all(p.dtype == torch.float32 for p in saved.parameters())
