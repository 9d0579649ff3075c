"""The families on one CUDA GPU, side by side with the peer library in the same process.

Inference (ms per batch, CUDA-synchronised medians): eager fp32 (PyTorch's defaults: TF32 convolutions,
fp32 matmuls), bf16 and fp16 autocast, bf16 weights (`zoo.accel.cast`), compiled bf16 weights with frozen
parameters; the peer's eager fp32 and bf16 autocast. Training step (forward, loss, backward, fused AdamW):
fp32, bf16 autocast, fp16 autocast with loss scaling, and the step's peak GPU memory (growth over what was
allocated before its model was built). For unet3d_seg: a training step per activation-checkpointing policy.
Each table's rows are timed interleaved round by round, medians over rounds; ratios to zoo's eager fp32 and
to the peer's, within each round. The header names the GPU and this run's fp32/bf16/fp16 matmul peaks
(before and after the rows); rows in a dtype the GPU only emulates are skipped unless --force-emulated.

    python bench/gpu.py --save                # all families, bench/results/NAME.gpu-<gpu>.txt
    python bench/gpu.py bert_cls --no-compile
    python bench/gpu.py bert_cls --device cpu --no-compile --batch 2 --reps 2   # a smoke run without a GPU
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools

import torch

import zoo
from zoo.accel.amp import cast, grad_scaler, with_autocast
from zoo.accel.variants import channels_last, has_conv
from zoo.bench import (PEAK_DTYPES, BenchRun, add_run_arguments, build_row, example_loss, format_table, peer_model,
                       time_rows)
from zoo.accel.compile import compile as zoo_compile

# (registry config, example_inputs options, batch): sizes where a GPU is busy, not launch-bound
SETUPS = {
    "bert_cls": (dict(variant="minilm-l6", num_classes=2), dict(length=128), 256),
    "effnetv2_cls": (dict(variant="s"), dict(size=224), 128),
    "transformer_lm": ({}, {}, 64),
    "unet3d_seg": ({}, dict(size=64), 2),
    "diffusion_unet": ({}, {}, 256),
}


def _allocated_mb() -> float:
    return torch.cuda.memory_allocated() / 2 ** 20 if torch.cuda.is_available() else float("nan")


def _peak_mb() -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_available() else float("nan")


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def inference_modes(device: str, compile_: bool):
    """(mode, build(model, inputs) -> (runnable, inputs), the low precision it runs in)"""
    yield "eager fp32", lambda m, x: (m, x), None
    yield "bf16 autocast", lambda m, x: (with_autocast(m, device, "bf16", force=True), x), torch.bfloat16
    yield "fp16 autocast", lambda m, x: (with_autocast(m, device, "fp16", force=True), x), torch.float16
    yield "bf16 weights (cast)", lambda m, x: (cast(m, "bf16", force=True), x), torch.bfloat16
    if compile_:
        def compiled(m, x):
            if has_conv(m):
                m, x = channels_last(m, x)
            return zoo_compile(cast(m, "bf16", force=True), freeze=True), x
        yield "compile+bf16 weights (frozen)", compiled, torch.bfloat16


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


def measured_step(build, columns: dict):
    """A training step whose warm-up (two steps) records the peak memory growth over what was allocated
    before its model was built: the rows of a table are all alive while they are timed."""
    base = _allocated_mb()
    _reset_peak()
    step = build()
    step()
    step()
    columns["peak MB"] = _peak_mb() - base
    return step


def bench_family(name: str, args) -> None:
    device = args.device
    config, example, default_batch = SETUPS[name]
    batch = args.batch or default_batch
    compile_ = not args.no_compile and name in ("bert_cls", "effnetv2_cls", "transformer_lm")
    torch.manual_seed(0)
    model = zoo.load(name, **config).to(device).eval()
    inputs = tuple(t.to(device) for t in model.example_inputs(batch, **example))
    peer = peer_model(name, model)
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
    run = BenchRun(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, inputs {shapes}",
                   peaks=("fp32", "bf16", "fp16"), device=device)

    def row(label, mode, build, dtype, warmup=3, context=torch.inference_mode):
        return build_row(label, mode, build, batch=batch, dtype=dtype, device=device, warmup=warmup,
                         context=context, force_emulated=args.force_emulated)

    def step_row(label, mode, build, dtype):
        """A training step as a row, warmed up (and its peak memory measured) by `measured_step`."""
        columns = {}
        step = functools.partial(measured_step, build, columns)
        return {**row(label, mode, step, dtype, warmup=0, context=contextlib.nullcontext), **columns}

    def inference(m, build):
        runnable, x = build(copy.deepcopy(m), inputs)
        return functools.partial(runnable, *x)

    label = None
    built = [row("zoo", mode, functools.partial(inference, model, build), dtype)
             for mode, build, dtype in inference_modes(device, compile_)]
    if peer is not None:
        label, peer = peer[0], peer[1].to(device).eval()
        built += [row(label, mode, functools.partial(inference, peer, build), dtype)
                  for mode, build, dtype in list(inference_modes(device, False))[:2]]
    inference_rows = time_rows(built, rounds=args.reps, calls=5, peer=label)

    conv = any(t.dim() in (4, 5) for t in inputs)
    # conv nets train with --channels-last in their train script: measure that too (tensor-core layouts)
    modes = [("fp32", False), ("bf16", False), ("fp16", False)] + ([("bf16", True)] if conv else [])

    def trainable(m, amp, last):
        net, x = copy.deepcopy(m).train(), inputs
        if last:
            net, x = channels_last(net, inputs)
        return train_step(net, x, amp, device)

    built = []
    for model_label, m in [("zoo", model)] + ([(label, peer)] if peer is not None else []):
        for amp, last in modes:
            mode = f"{amp}{' autocast' if amp != 'fp32' else ''}{' + channels_last' if last else ''}"
            built.append(step_row(model_label, mode, functools.partial(trainable, m, amp, last),
                                  PEAK_DTYPES[amp] if amp != "fp32" else None))
    if name == "unet3d_seg":
        built += checkpointing_rows(config, inputs, device, step_row)
    training_rows = time_rows(built, rounds=args.reps, calls=2, peer=label)
    run.finish()
    run.say(f"{args.reps} rounds, interleaved (inference 5 calls, training 2 steps per row and round); ratio: to "
            f"zoo eager fp32" + (f", vs {label}: to {label} eager fp32" if label else "") + "; medians")
    run.say(format_table(inference_rows, peer=label))
    run.say(format_table(training_rows, peer=label, columns={"peak MB": ".0f"}, unit="step"))
    if args.save:
        run.save(name)


def checkpointing_rows(config, inputs, device, step_row):
    """unet3d_seg training steps (bf16 autocast) per activation-checkpointing policy."""
    def model_step(policy):
        torch.manual_seed(0)
        model = zoo.load("unet3d_seg", **config, checkpointing=policy).to(device).train()
        return train_step(model, inputs, "bf16", device)

    return [step_row("zoo", f"checkpointing={policy}, bf16 autocast", functools.partial(model_step, policy),
                     torch.bfloat16) for policy in ("none", "selective", "blocks", "every_k")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=list(SETUPS))
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--batch", type=int, default=None, help="override every family's batch (smoke runs)")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU; bench/ has the CPU scripts")
    for name in args.names:
        bench_family(name, args)


if __name__ == "__main__":
    main()
