"""zoo.accel on small models: compile, autocast, GradScaler, quantize, checkpointing, export, optimize."""
import copy
import warnings

import pytest
import torch
from torch import nn

import zoo
import zoo.accel as accel
from zoo.accel.quantize import Int8Model, default_path

from .test_hardware import AMX, AVX2, AVX512, Capabilities, play

torch.manual_seed(0)


def tiny_lm(**overrides):
    config = dict(vocab_size=16, context=16, dim=32, n_layers=2, n_heads=4, mlp_hidden=32, dropout=0.0)
    return zoo.load("transformer_lm", **{**config, **overrides})


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                                      nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class Uncompilable(nn.Module):
    """Has a graph break, so fullgraph compilation must fail."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.lin(x)


def test_compile_matches_eager_and_keeps_identity():
    model = tiny_lm()
    x = torch.randint(0, 16, (2, 10))
    eager = model(x)
    compiled = accel.compile(model)
    assert compiled is model and accel.is_compiled(model)
    torch.testing.assert_close(compiled(x), eager, atol=1e-5, rtol=1e-5)
    assert not any("_orig_mod" in k for k in model.state_dict())


def test_compile_freeze_folds_batchnorm_for_inference_and_matches_eager():
    from torch._dynamo.utils import counters
    model = ConvNet().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        eager = model(x)
        counters.clear()
        frozen = accel.compile(model, freeze=True)
        torch.testing.assert_close(frozen(x), eager, atol=1e-4, rtol=1e-4)
    assert counters["inductor"]["binary_folding"] > 0, "BatchNorm was not folded: the freezing pass did not run"
    with torch.no_grad():
        model.head.weight.mul_(2.0)  # e.g. an optimizer step after the frozen graph was built
        with pytest.raises(RuntimeError, match="changed after it was compiled with freeze=True"):
            frozen(x)


def test_compile_failure_falls_back_with_one_warning():
    model = accel.compile(Uncompilable(), fullgraph=True)
    x = torch.randn(2, 4)
    with pytest.warns(RuntimeWarning, match="torch.compile failed.*running eager"):
        out = model(x)
    torch.testing.assert_close(out, model.lin(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # warned once, not every call


def test_compile_strict_raises():
    model = accel.compile(Uncompilable(), fullgraph=True, strict=True)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        model(torch.randn(2, 4))
    with pytest.warns(RuntimeWarning, match="unavailable"):
        accel.compile(Uncompilable(), backend="no_such_backend")


def test_compile_bad_mode():
    with pytest.raises(ValueError, match="unknown compile mode"):
        accel.compile(Uncompilable(), mode="fastest")


def test_autocast_runs_bf16_on_cpu_and_norms_stay_fp32():
    # force=True: bf16 also where this CPU only emulates it (tests/test_hardware.py pins the fallback)
    model = tiny_lm()
    seen = {}
    model.blocks[0].attn.qkv.register_forward_hook(lambda m, i, o: seen.update(qkv=o.dtype))
    with accel.autocast("cpu", force=True):
        model(torch.randint(0, 16, (2, 8)))
        x = torch.randn(4, 32) * 300
        # the norm's statistics are computed in fp32: same as the fp32 result rounded once
        assert torch.equal(model.norm(x.bfloat16()), model.norm(x.bfloat16().float()).bfloat16())
    assert seen["qkv"] == torch.bfloat16
    assert accel.resolve_dtype("cpu", force=True) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown precision"):
        accel.resolve_dtype("cpu", "int4")


def test_grad_scaler_choice():
    assert accel.grad_scaler("cpu", "bf16").is_enabled() is False
    assert accel.grad_scaler("cpu", "fp32").get_scale() == 1.0
    assert accel.grad_scaler("cpu", "fp16", force=True).is_enabled()


def test_with_autocast_in_place_returns_fp32():
    model = tiny_lm()
    keys = list(model.state_dict())
    accel.with_autocast(model, "cpu", "bf16", force=True)
    assert "forward" in vars(model)
    out = model(torch.randint(0, 16, (1, 4)))
    assert out.dtype == torch.float32 and list(model.state_dict()) == keys
    accel.with_autocast(model, "cpu", "fp32")
    assert "forward" not in vars(model)


def test_cast_runs_bf16_weights_end_to_end_and_converts_back():
    model = ConvNet().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = model(x)
        accel.cast(model, "bf16", force=True)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert model.features[1].running_var.dtype == torch.bfloat16
        out = model(x)  # fp32 input cast on the way in
        assert out.dtype == torch.float32 and _rel_err(out, ref) < 0.05
        lm = accel.cast(tiny_lm().eval(), "bf16", force=True)
        assert lm(torch.randint(0, 16, (1, 4))).dtype == torch.float32  # integer token ids left alone
        accel.cast(model, "fp32")
        assert "forward" not in vars(model) and model.head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown precision 'int8'"):
        accel.cast(model, "int8")


def _rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_int8_dynamic_and_weight_only_on_linear_model():
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).eval()
    x = torch.randn(8, 256)
    for method in ("int8_dynamic", "int8_weight_only"):
        q = accel.quantize(model, method)
        with torch.no_grad():
            assert _rel_err(q(x), model(x)) < 0.05
        assert accel.model_size_bytes(model) / accel.model_size_bytes(q) >= 3.5
    assert isinstance(model[0], nn.Linear) and model[0].weight.dtype == torch.float32, "input model untouched"


def test_int8_dynamic_pt2e_traces_for_x86_kernels_with_dynamic_batch():
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).eval()
    q = accel.quantize(model, "int8_dynamic", backend="pt2e", example_inputs=(torch.randn(8, 256),))
    assert q.quantization == "int8_dynamic" and accel.model_size_bytes(model) / accel.model_size_bytes(q) >= 3.5
    # the explicit form as before, on any CPU: the graph module, uncompiled (exportable)
    assert isinstance(q, torch.fx.GraphModule) and not accel.is_compiled(q)
    x = torch.randn(3, 256)  # another batch size than the example's
    with torch.no_grad():
        assert _rel_err(q(x), model(x)) < 0.05
    with pytest.raises(ValueError, match="pass example_inputs"):
        accel.quantize(model, "int8_dynamic", backend="pt2e")
    with pytest.raises(ValueError, match="use backend='torchao' for int8_weight_only"):
        accel.quantize(model, "int8_weight_only", backend="pt2e", example_inputs=(x,))
    with pytest.raises(ValueError, match="unknown quantization backend"):
        accel.quantize(model, "int8_dynamic", backend="fbgemm")


def test_int8_dynamic_pt2e_stores_embeddings_in_int8():
    model = nn.Sequential(nn.Embedding(4000, 64), nn.Linear(64, 64)).eval()
    ids = torch.randint(0, 4000, (2, 12))
    q = accel.quantize(model, "int8_dynamic", backend="pt2e", example_inputs=(ids,), embeddings=True)
    tables = [t for t in q.state_dict().values() if t.shape == (4000, 64)]
    assert [t.dtype for t in tables] == [torch.int8], "the fp32 table is gone, an int8 one is stored"
    assert accel.model_size_bytes(model) / accel.model_size_bytes(q) >= 3.5
    with torch.no_grad():
        assert _rel_err(q(ids), model(ids)) < 0.05


# ------------------------------------------------------------------ int8_dynamic's default, by CPU class

AVX_VNNI = Capabilities("AVX2", cpu_bf16=False, cpu_fp16=False, vnni=True)  # AVX2 with AVX-VNNI: Alder Lake, Zen 5
AVX512_NO_VNNI = Capabilities("AVX-512", cpu_bf16=False, cpu_fp16=False, vnni=False)  # Skylake-SP
NEON = Capabilities("NEON", cpu_bf16=False, cpu_fp16=False, vnni=False)


def tiny_bert():
    return zoo.load("bert_cls", variant="minilm-l6", layers=1, hidden=32, heads=2, intermediate=64, vocab_size=2000,
                    max_positions=24).eval()


@pytest.mark.parametrize("caps, path", [(AVX2, "pt2e"), (AVX512_NO_VNNI, "pt2e"), (AVX_VNNI, "pt2e"),
                                        (AVX512, "pt2e"), (AMX, "pt2e"), (NEON, "torchao")],
                         ids=["avx2-no-vnni", "avx512-no-vnni", "avx-vnni", "avx512-vnni", "amx", "neon"])
def test_default_int8_dynamic_path_follows_the_cpu(monkeypatch, caps, path):
    play(monkeypatch, caps)
    mlp = nn.Sequential(nn.Linear(8, 8))
    assert default_path(tiny_bert())[0] == path  # traced on its own export graph (example_inputs)
    assert default_path(mlp, (torch.randn(2, 8),))[0] == path
    assert default_path(mlp)[0] == "torchao", "nothing to trace: torchao on the module, as before"
    assert default_path(tiny_lm())[0] == "torchao", "its export graph is a prefill, not its forward (generate stays)"


def test_default_int8_dynamic_returns_what_it_chose(monkeypatch):
    model = nn.Sequential(nn.Embedding(4000, 64), nn.Linear(64, 64)).eval()
    ids = torch.randint(0, 4000, (2, 12))
    play(monkeypatch, AVX2)
    q = accel.quantize(model, "int8_dynamic", example_inputs=(ids,))
    assert isinstance(q, Int8Model) and accel.is_compiled(q.graph), "PT2E compiled with frozen weights"
    assert [t.dtype for t in q.state_dict().values() if t.shape == (4000, 64)] == [torch.int8], "int8 embeddings"
    play(monkeypatch, NEON)
    q = accel.quantize(model, "int8_dynamic", example_inputs=(ids,))
    assert type(q) is nn.Sequential and q.quantization == "int8_dynamic" and type(q[1].weight) is not nn.Parameter


def test_int8_static_on_conv_model():
    torch.manual_seed(0)
    model = ConvNet().eval()
    batches = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    q = accel.quantize(model, "int8_static", calibration=batches)
    with torch.no_grad():
        assert _rel_err(q(batches[0]), model(batches[0])) < 0.05
        x = torch.randn(7, 3, 16, 16)  # the batch dimension stays dynamic
        assert _rel_err(q(x), model(x)) < 0.05
        # frozen compilation is what lowers the quantize/dequantize pairs to oneDNN int8 convolutions
        assert _rel_err(accel.compile(copy.deepcopy(q), freeze=True)(x), model(x)) < 0.05
    assert accel.model_size_bytes(model) / accel.model_size_bytes(q) >= 3.5


def test_int8_static_warns_of_a_calibration_batch_that_sets_the_range():
    torch.manual_seed(0)
    model = ConvNet().eval()
    typical = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accel.quantize(model, "int8_static", calibration=typical)
    assert not [w for w in caught if "calibration" in str(w.message)], "similar batches: no warning"
    atypical = typical[:2] + [typical[2] * 100] + typical[3:]
    expected = r"batch 2 of 4 drives the input 'x' to [\d.]+, 1\d\dx .*\(and 2 more layers\)"
    with pytest.warns(UserWarning, match=expected) as caught:
        q = accel.quantize(model, "int8_static", calibration=atypical)
    message = next(str(w.message) for w in caught if "int8_static calibration" in str(w.message))
    assert "leave such batches out of calibration=" in message, "the warning names the fix"
    with torch.no_grad():  # what the warning is about: the typical batch loses its precision
        assert _rel_err(q(typical[0]), model(typical[0])) > 0.05


def test_quantize_errors_name_the_problem():
    with pytest.raises(ValueError, match="no convolutions; use int8_dynamic"):
        accel.quantize(nn.Sequential(nn.Linear(4, 4)), "int8_static", calibration=[torch.randn(1, 4)])
    with pytest.raises(ValueError, match="needs calibration"):
        accel.quantize(ConvNet(), "int8_static")
    with pytest.raises(ValueError, match="has none; for a convolutional model use int8_static"):
        accel.quantize(nn.Sequential(nn.Conv2d(3, 3, 1)), "int8_dynamic")
    with pytest.raises(ValueError, match="unknown quantization method"):
        accel.quantize(ConvNet(), "int4")


@pytest.mark.parametrize("policy", ["blocks", "every_k", "selective", "callable"])
def test_checkpointing_gives_identical_gradients(policy):
    model = tiny_lm().train()
    x = torch.randint(0, 16, (2, 12))

    def grads():
        model.zero_grad()
        model.example_loss(x).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    keys = list(model.state_dict())
    chosen = (lambda m: type(m).__name__ == "SwiGLU") if policy == "callable" else policy
    accel.checkpointing(model, chosen)
    assert accel.checkpointing.__module__ and accel.checkpointing is not None
    from zoo.accel.checkpointing import checkpointed_modules
    assert checkpointed_modules(model)
    for a, b in zip(plain, grads()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert list(model.state_dict()) == keys, "state-dict keys are an API"
    accel.checkpointing(model, "none")
    assert not checkpointed_modules(model)


def test_checkpointing_errors():
    with pytest.raises(ValueError, match="unknown checkpointing policy"):
        accel.checkpointing(tiny_lm(), "sometimes")
    with pytest.raises(ValueError, match="does not list its blocks"):
        accel.checkpointing(ConvNet(), "blocks")
    with pytest.raises(ValueError, match="selected no module"):
        accel.checkpointing(ConvNet(), lambda m: False)


def test_onnx_export_matches_onnxruntime_with_dynamic_axes(tmp_path):
    pytest.importorskip("onnxruntime")
    model = tiny_lm().eval()
    path = accel.export_onnx(model, (torch.randint(0, 16, (2, 12)),), tmp_path / "lm.onnx", dynamic_dims={0: (1,)})
    assert accel.check_onnx(path, model, (torch.randint(0, 16, (3, 7)),)) < 1e-4


def test_onnx_export_conv_model(tmp_path):
    pytest.importorskip("onnxruntime")
    model = ConvNet().eval()
    path = accel.export_onnx(model, (torch.randn(2, 3, 16, 16),), tmp_path / "conv.onnx")
    assert accel.check_onnx(path, model, (torch.randn(5, 3, 16, 16),)) < 1e-4


def test_torch_export_program():
    model = tiny_lm().eval()
    program = accel.export_program(model, (torch.randint(0, 16, (2, 12)),), dynamic_dims={0: (1,)})
    x = torch.randint(0, 16, (3, 9))
    torch.testing.assert_close(program.module()(x), model(x), atol=1e-5, rtol=1e-5)


def test_optimize_never_slower_than_eager_and_within_tolerance():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    x = torch.randn(16, 64)
    best, report = accel.optimize(model, (x,), tolerance=0.05, compile=False, int8=False, reps=3)
    assert "chosen:" in report and "eager fp32" in report
    with torch.no_grad():
        assert _rel_err(best(x).float(), model(x)) <= 0.05


def test_optimize_skips_emulated_bf16_and_chooses_by_interleaved_median(monkeypatch):
    import re

    from .test_hardware import AMX, AVX2, play
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    x = torch.randn(16, 64)
    play(monkeypatch, AVX2)
    _, report = accel.optimize(model, (x,), compile=False, int8=False, reps=3)
    assert re.search(r"bf16 autocast +skipped: bf16 matmuls on this AVX2 CPU run ~100x slower", report), report
    chosen = re.search(r"chosen: (.+) \((\d+\.\d+)x eager fp32\)", report)
    assert chosen[1] == "eager fp32" or float(chosen[2]) >= 1.0, "never slower than eager"
    play(monkeypatch, AMX)
    _, report = accel.optimize(model, (x,), compile=False, int8=False, reps=3)
    assert "skipped" not in report and re.search(r"bf16 autocast +[\d.]+ ms", report), report
    _, report = accel.optimize(model, (x,), compile=False, int8=False, reps=1, budget_s=0)
    assert "skipped: the 0 s budget was spent" in report and "chosen: eager fp32" in report  # always timed
