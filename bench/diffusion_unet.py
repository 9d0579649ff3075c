"""diffusion_unet against diffusers' UNet2DModel of the same size, side by side in one process (issue: diffusion_unet).

    python bench/diffusion_unet.py              # batch 16, 32x32 RGB, unconditional, both ~3.0 GFLOP per image
    python bench/diffusion_unet.py --ddpm       # also DDPM-1000 sampling (about 2 min per mode)

Part 1 times one denoiser call per mode; part 2 times whole sampling jobs (16 images): DDIM-50,
DPM-Solver++(2M)-20 and optionally DDPM-1000. Every ratio is to diffusers' eager fp32, the peer
figure the issue's goal is stated against. Weights are random: speed does not depend on them.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from zoo.accel.amp import with_autocast  # noqa: E402
from zoo.bench import count_flops, time_call  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.models.diffusion_unet import DiffusionConfig, DiffusionUNet  # noqa: E402


def zoo_model(size: int) -> DiffusionUNet:
    # the peer's widths and attention level (16x16); three blocks per level give the peer's FLOPs per call
    # (3.0 GFLOP at 32x32; 6.75M params against 6.47M), since zoo's up path takes one skip per level
    # where diffusers' takes one per block
    config = DiffusionConfig(image_size=size, in_chans=3, widths=(64, 128, 128), blocks_per_level=3,
                             attention_levels=(1,), num_classes=0, dropout=0.0)
    return DiffusionUNet(config).eval()


def diffusers_model(size: int):
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=size, in_channels=3, out_channels=3, block_out_channels=(64, 128, 128),
                       layers_per_block=2, down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D")).eval()


def prepare(model, mode: str):
    """Apply a mode in place: channels_last, bf16 autocast, compile (the order zoo.accel.optimize uses)."""
    if "channels_last" in mode:
        model = model.to(memory_format=torch.channels_last)
    if "bf16" in mode:
        model = with_autocast(model, "cpu", "bf16", force=True)
    if "compile" in mode:
        model = zoo_compile(model)
    return model


def diffusers_ddim(unet, n: int, size: int, steps: int, seed: int = 0):
    from diffusers import DDIMScheduler
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", clip_sample=True)
    scheduler.set_timesteps(steps)
    x = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))
    for t in scheduler.timesteps:
        x = scheduler.step(unet(x, t).sample.float(), t, x).prev_sample
    return x


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--ddpm", action="store_true", help="also time DDPM-1000 (zoo's best mode only)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    b, s = args.batch, args.size
    x = torch.randn(b, 3, s, s, generator=torch.Generator().manual_seed(0))
    t = torch.randint(0, 1000, (b,), generator=torch.Generator().manual_seed(1))

    zoo_params = sum(p.numel() for p in zoo_model(s).parameters())
    peer_params = sum(p.numel() for p in diffusers_model(s).parameters())
    gflop = count_flops(zoo_model(s), (x, t)) / 1e9
    print(f"batch {b}, {s}x{s} RGB, {torch.get_num_threads()} threads; zoo DiffusionUNet {zoo_params / 1e6:.2f}M "
          f"params, {gflop:.2f} GFLOP/call; diffusers UNet2DModel {peer_params / 1e6:.2f}M params")

    print("\n1. one denoiser call (ratio to diffusers eager fp32)")
    print(f"{'model':<10} {'mode':<28} {'ms/call':>9} {'img/s':>8} {'ratio':>7}")
    baseline = None
    modes = ["eager fp32", "bf16", "compile", "compile+bf16"]
    for label, build, call, extra in (
            ("diffusers", diffusers_model, lambda m: m(x, t).sample, []),
            ("zoo", zoo_model, lambda m: m(x, t), ["channels_last", "compile+bf16+channels_last"])):
        for mode in modes + extra:
            model = prepare(build(s), mode)
            with torch.inference_mode():
                seconds = time_call(lambda: call(model), warmup=3 if "compile" in mode else 1, reps=args.reps)
            baseline = baseline or seconds
            print(f"{label:<10} {mode:<28} {seconds * 1e3:9.1f} {b / seconds:8.1f} {baseline / seconds:6.2f}x",
                  flush=True)

    print(f"\n2. sampling {b} images, seconds per job (ratio to diffusers eager fp32 DDIM-50)")
    print(f"{'model':<10} {'mode':<28} {'job':<18} {'seconds':>8} {'ratio':>7}")
    jobs = [("ddim", 50), ("dpm++", 20)] + ([("ddpm", 1000)] if args.ddpm else [])
    with torch.inference_mode():
        peer = diffusers_model(s)
        diffusers_ddim(peer, b, s, 2)  # warm-up
        t0 = time.perf_counter()
        diffusers_ddim(peer, b, s, 50)
        peer_s = time.perf_counter() - t0
        print(f"{'diffusers':<10} {'eager fp32':<28} {'DDIM-50':<18} {peer_s:8.2f} {1.0:6.2f}x", flush=True)
        for mode in ("eager fp32", "compile+bf16+channels_last"):
            model = prepare(zoo_model(s), mode)
            model.sample(b, steps=2, sampler="ddim", seed=0)  # warm-up (compiles)
            for sampler, steps in jobs:
                if sampler == "ddpm" and mode == "eager fp32":
                    continue  # 1000 eager calls take minutes and say nothing the per-call ratio does not
                t0 = time.perf_counter()
                model.sample(b, steps=steps, sampler=sampler, seed=0)
                seconds = time.perf_counter() - t0
                job = f"{sampler.upper()}-{steps}"
                print(f"{'zoo':<10} {mode:<28} {job:<18} {seconds:8.2f} {peer_s / seconds:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
