"""The families on one CUDA GPU, side by side with the peer library in the same process.

Inference (ms per batch, CUDA-synchronised medians; ratios to zoo's eager fp32): eager fp32 (PyTorch's
defaults: TF32 convolutions, fp32 matmuls), bf16 and fp16 autocast, bf16 weights (`zoo.accel.cast`),
compiled bf16 weights with frozen parameters; the peer's eager fp32 and bf16 autocast. Training step
(forward, loss, backward, fused AdamW): fp32, bf16 autocast, fp16 autocast with loss scaling, and peak
GPU memory. For unet3d_seg: peak memory of a training step per activation-checkpointing policy.

    python bench/gpu.py                       # all families
    python bench/gpu.py bert_cls --no-compile
"""
from __future__ import annotations

import argparse
import copy

import torch

import zoo
from zoo.accel.amp import cast, grad_scaler, with_autocast
from zoo.accel.variants import channels_last, has_conv, time_call
from zoo.bench import example_loss, peer_model
from zoo.accel.compile import compile as zoo_compile

# (registry config, example_inputs options, batch): sizes where a GPU is busy, not launch-bound
SETUPS = {
    "bert_cls": (dict(variant="minilm-l6", num_classes=2), dict(length=128), 256),
    "effnetv2_cls": (dict(variant="s"), dict(size=224), 128),
    "transformer_lm": ({}, {}, 64),
    "unet3d_seg": ({}, dict(size=64), 2),
    "diffusion_unet": ({}, {}, 256),
}


def _reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_mb() -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_available() else float("nan")


def inference_modes(device: str, compile_: bool):
    yield "eager fp32", lambda m, x: (m, x)
    yield "bf16 autocast", lambda m, x: (with_autocast(m, device, "bf16", force=True), x)
    yield "fp16 autocast", lambda m, x: (with_autocast(m, device, "fp16", force=True), x)
    yield "bf16 weights (cast)", lambda m, x: (cast(m, "bf16", force=True), x)
    if compile_:
        def compiled(m, x):
            if has_conv(m):
                m, x = channels_last(m, x)
            return zoo_compile(cast(m, "bf16", force=True), freeze=True), x
        yield "compile+bf16 weights (frozen)", compiled


def train_step(model, inputs, amp: str, device: str):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    scaler = grad_scaler(device, amp)

    def step():
        with torch.autocast(device, dtype=torch.float16 if amp == "fp16" else torch.bfloat16, enabled=amp != "fp32"):
            loss = example_loss(model, inputs)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return step


def row(label, mode, seconds, batch, baseline):
    return f"{label:<14} {mode:<32} {seconds * 1e3:9.2f} {batch / seconds:10.1f} {baseline / seconds:6.2f}x"


def bench_family(name: str, device: str, compile_: bool, batch: int | None = None) -> None:
    config, example, default_batch = SETUPS[name]
    batch = batch or default_batch
    torch.manual_seed(0)
    model = zoo.load(name, **config).to(device).eval()
    inputs = tuple(t.to(device) for t in model.example_inputs(batch, **example))
    peer = peer_model(name, model)
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
    print(f"\n## {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, inputs {shapes}")
    print(f"{'model':<14} {'inference mode':<32} {'ms/batch':>9} {'items/s':>10} {'ratio':>7}")
    baseline = None
    for mode, build in inference_modes(device, compile_):
        try:
            runnable, x = build(copy.deepcopy(model), inputs)
            with torch.inference_mode():
                seconds = time_call(lambda: runnable(*x), warmup=3, reps=10)
        except Exception as e:  # a mode that does not apply is a row saying so
            print(f"{'zoo':<14} {mode:<32} n/a: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            continue
        baseline = baseline or seconds
        print(row("zoo", mode, seconds, batch, baseline))
    if peer is not None:
        label, peer = peer[0], peer[1].to(device).eval()
        autocast_peer = with_autocast(copy.deepcopy(peer), device, "bf16", force=True)
        for mode, runnable in [("eager fp32", peer), ("bf16 autocast", autocast_peer)]:
            with torch.inference_mode():
                print(row(label, mode, time_call(lambda: runnable(*inputs), warmup=3, reps=10), batch, baseline))
    print(f"{'model':<14} {'training step':<32} {'ms/step':>9} {'items/s':>10} {'ratio':>7} {'peak MB':>8}")
    candidates = [("zoo", model)] + ([(label, peer)] if peer is not None else [])
    baseline = None
    conv = any(t.dim() in (4, 5) for t in inputs)
    # conv nets train with --channels-last in their train script: measure that too (tensor-core layouts)
    modes = [("fp32", False), ("bf16", False), ("fp16", False)] + ([("bf16", True)] if conv else [])
    for label, m in candidates:
        for amp, last in modes:
            trainable, x = copy.deepcopy(m).train(), inputs
            if last:
                trainable, x = channels_last(trainable, inputs)
            _reset_peak()
            seconds = time_call(train_step(trainable, x, amp, device), warmup=2, reps=5)
            peak = _peak_mb()
            baseline = baseline or seconds
            mode = f"{amp}{' autocast' if amp != 'fp32' else ''}{' + channels_last' if last else ''}"
            print(row(label, mode, seconds, batch, baseline) + f" {peak:8.0f}")
            del trainable
    if name == "unet3d_seg":
        checkpointing_memory(config, inputs, device)


def checkpointing_memory(config, inputs, device):
    print(f"{'checkpointing':<20} {'ms/step':>9} {'peak MB':>8} (bf16 autocast)")
    for policy in ("none", "selective", "blocks", "every_k"):
        torch.manual_seed(0)
        model = zoo.load("unet3d_seg", **config, checkpointing=policy).to(device).train()
        _reset_peak()
        seconds = time_call(train_step(model, inputs, "bf16", device), warmup=1, reps=3)
        print(f"{policy:<20} {seconds * 1e3:9.1f} {_peak_mb():8.0f}")
        del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(SETUPS))
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--batch", type=int, default=None, help="override every family's batch (smoke runs)")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU; bench/ has the CPU scripts")
    print(f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}; torch {torch.__version__}")
    for name in args.names:
        bench_family(name, args.device, compile_=not args.no_compile and name in ("bert_cls", "effnetv2_cls",
                                                                                  "transformer_lm"),
                     batch=args.batch)


if __name__ == "__main__":
    main()
