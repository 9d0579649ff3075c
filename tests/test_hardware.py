"""zoo.accel.capabilities and the precision rules built on it, with the probe mocked: they hold on any machine.

`play(monkeypatch, caps)` makes zoo.accel believe it runs on `caps` (and forgets the warnings given so far);
other test files use it to pin a precision rule, e.g. `play(monkeypatch, AMX)` where bf16 must run.
"""
import logging

import pytest
import torch
from torch import nn

import zoo.accel as accel
from zoo.accel import amp, hardware
from zoo.accel.hardware import Capabilities, CudaCapabilities
from zoo.weights import read_weights_file

AVX2 = Capabilities(cpu_class="AVX2", cpu_bf16=False, cpu_fp16=False, vnni=False)
AVX512 = Capabilities(cpu_class="AVX-512", cpu_bf16=False, cpu_fp16=False, vnni=True)
AMX = Capabilities(cpu_class="AMX", cpu_bf16=True, cpu_fp16=True, vnni=True)


def play(monkeypatch, caps: Capabilities) -> None:
    monkeypatch.setattr(hardware, "capabilities", lambda cuda=True: caps)
    monkeypatch.setattr(amp, "_warned", set())


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "zoo.accel.amp" and r.levelno == logging.WARNING]


def matmul_dtype(**autocast_args):
    with accel.autocast("cpu", **autocast_args):
        return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype


# ---------------------------------------------------------------------------------------------- the probe

def test_capabilities_report_this_machine():
    caps = accel.capabilities(cuda=False)
    assert caps is accel.capabilities(cuda=False), "probed once per process"
    assert caps.cuda == ()
    assert caps.cpu_bf16 == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    if torch.cpu._is_amx_tile_supported():
        assert caps.cpu_class == "AMX"
    elif torch.cpu._is_avx2_supported() and not torch.cpu._is_avx512_supported():
        assert caps.cpu_class == "AVX2"
    assert caps.describe().startswith(f"CPU {caps.cpu_class} (")
    assert caps.native("cpu", torch.float32)
    assert hardware.native_cpu_dtype(torch.bfloat16) == caps.cpu_bf16
    assert hardware.cpu_class().startswith(caps.cpu_class)


def test_cpuinfo_flags_are_read_on_linux_only(monkeypatch):
    monkeypatch.setattr(hardware.platform, "system", lambda: "Darwin")
    assert hardware._cpuinfo_flags() == frozenset()


def test_cuda_capabilities_name_bf16_fp16_tf32():
    turing = CudaCapabilities("T4", (7, 5), bf16=False, fp16=True, tf32=False)
    caps = Capabilities("AVX2", False, False, False, cuda=(turing,))
    assert not caps.native("cuda:0", torch.bfloat16) and caps.native("cuda:0", torch.float16)
    assert "GPU T4 sm75 (fp16)" in caps.describe()


# ---------------------------------------------------------------------------------------------- the rules

def test_no_native_bf16_runs_fp32_with_one_warning(monkeypatch, caplog):
    play(monkeypatch, AVX2)
    assert [matmul_dtype() for _ in range(3)] == [torch.float32] * 3  # autocast("cpu"): bf16 by default
    assert accel.resolve_dtype("cpu", torch.bfloat16) == torch.float32
    (message,) = warnings_of(caplog)
    assert "AVX2" in message and "~100x slower than fp32" in message and "force=True" in message


def test_force_keeps_the_slow_path(monkeypatch, caplog):
    play(monkeypatch, AVX2)
    assert matmul_dtype(force=True) == torch.bfloat16
    assert accel.resolve_dtype("cpu", "bf16!") == torch.bfloat16  # the train scripts' --amp bf16!
    assert accel.resolve_dtype("cpu", "fp16!") == torch.float16
    assert all("forced" in m for m in warnings_of(caplog))


def test_native_bf16_is_allowed_without_a_warning(monkeypatch, caplog):
    play(monkeypatch, AMX)
    assert matmul_dtype() == torch.bfloat16
    assert accel.resolve_dtype("cpu", "fp16") == torch.float16  # AMX-FP16
    assert warnings_of(caplog) == []


def test_avx512_without_bf16_falls_back_too(monkeypatch, caplog):
    play(monkeypatch, AVX512)
    assert matmul_dtype() == torch.float32
    (message,) = warnings_of(caplog)
    assert "AVX-512" in message and "emulated" in message


def test_cast_and_with_autocast_follow_the_rule(monkeypatch, caplog):
    play(monkeypatch, AVX2)
    model = nn.Linear(4, 4)
    accel.cast(model, "bf16")
    assert model.weight.dtype == torch.float32 and "forward" not in vars(model)
    accel.with_autocast(model, "cpu", "bf16")
    assert "forward" not in vars(model)
    assert len(warnings_of(caplog)) == 1, "one warning per process, whichever call asked"
    accel.cast(model, "bf16", force=True)
    assert model.weight.dtype == torch.bfloat16 and model(torch.ones(1, 4)).dtype == torch.float32


def test_fp16_without_native_kernels_needs_no_scaler(monkeypatch):
    play(monkeypatch, AVX2)
    assert not accel.grad_scaler("cpu", "fp16").is_enabled()  # it runs fp32
    assert accel.grad_scaler("cpu", "fp16", force=True).is_enabled()


def test_cuda_bf16_without_tensor_cores_falls_back(monkeypatch, caplog):
    turing = CudaCapabilities("T4", (7, 5), bf16=False, fp16=True, tf32=False)
    play(monkeypatch, Capabilities("AVX2", False, False, False, cuda=(turing,)))
    assert accel.resolve_dtype("cuda:0", "bf16") == torch.float32
    assert accel.resolve_dtype("cuda:0", "fp16") == torch.float16
    (message,) = warnings_of(caplog)
    assert "T4" in message


# ---------------------------------------------------------------------------------------------- training

def _tiny_task(cfg):
    from .conftest import TinyConfig, TinyNet  # registered by the `tiny` fixture
    from .test_train import tiny_task
    return tiny_task(model=TinyNet(TinyConfig(num_classes=1)))  # run() saves the final weights: a registered family


def test_fastest_dtype_is_the_lowest_native_precision(monkeypatch):
    for caps, expected in ((AVX2, torch.float32), (AVX512, torch.float32), (AMX, torch.bfloat16)):
        play(monkeypatch, caps)
        assert accel.fastest_dtype("cpu") == expected, caps.cpu_class
    for gpu, expected in ((CudaCapabilities("T4", (7, 5), bf16=False, fp16=True, tf32=False), torch.float16),
                          (CudaCapabilities("A100", (8, 0), bf16=True, fp16=True, tf32=True), torch.bfloat16)):
        play(monkeypatch, Capabilities("AVX2", False, False, False, cuda=(gpu,)))
        assert accel.fastest_dtype("cuda:0") == expected, gpu.name


@pytest.mark.parametrize("flag, caps, expected, warnings", [("bf16", AVX2, "off", 1), ("auto", AVX2, "off", 0),
                                                            ("bf16", AMX, "bf16", 0), ("auto", AMX, "bf16", 0)])
def test_train_and_eval_only_amp_follow_the_rule_and_say_what_ran(monkeypatch, caplog, capsys, tmp_path, tiny,
                                                                  flag, caps, expected, warnings):
    import json

    from zoo.train import TrainConfig, run
    play(monkeypatch, caps)
    caplog.set_level(logging.INFO)
    cfg = TrainConfig(steps=3, amp=flag, out=str(tmp_path), warmup=1, workers=0, batch_size=8, eval_every=1)
    run(cfg, _tiny_task)
    assert len(warnings_of(caplog)) == warnings, "one warning per run (not per step); --amp auto never warns"
    meta = read_weights_file(tmp_path / "model.safetensors").meta
    assert meta.extra["eval_amp"] == expected  # the precision really used, in --amp's words
    assert meta.extra["hardware"] == [f"{caps.describe()}, {torch.get_num_threads()} threads"]  # train_time_s's
    capsys.readouterr()
    run(TrainConfig(eval_only=True, amp=flag, out=str(tmp_path / "eval"), workers=0, batch_size=8), _tiny_task)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["amp"] == expected
    assert f"evaluated in {expected.replace('off', 'fp32')} (--amp {flag})" in caplog.text
