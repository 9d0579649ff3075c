"""diffusion_unet against diffusers' UNet2DModel of the same size, side by side in one process (issue: diffusion_unet).

    python bench/diffusion_unet.py --save       # batch 16, 32x32 RGB, unconditional, both ~3.0 GFLOP per image
    python bench/diffusion_unet.py --ddpm       # also DDPM-1000 sampling (about 2 min per job and round)
    python bench/diffusion_unet.py --quick --no-compile --reps 2   # a smoke run: batch 2, 16x16, short jobs

Part 1 times one denoiser call per mode; part 2 times whole sampling jobs (of `--batch` images): DDIM-50,
DPM-Solver++(2M)-20 and optionally DDPM-1000. Each part's rows are timed interleaved round by round;
ratios to zoo's eager fp32 and to diffusers' eager fp32 (the peer figure the issue's goal is stated
against), medians over rounds. diffusers rows need `pip install diffusers`. bf16 rows run only where the
CPU has bf16 kernels (--force-emulated times them anyway). Weights are random: speed does not depend on them.
"""
import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from zoo.accel.amp import with_autocast  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.bench import BenchRun, add_run_arguments, build_row, count_flops, format_table, time_rows  # noqa: E402
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
    parser.add_argument("--ddpm", action="store_true", help="also time DDPM-1000 (zoo's compiled modes only)")
    parser.add_argument("--quick", action="store_true", help="batch 2, 16x16, DDIM-5 and DPM++-4 (a smoke run)")
    parser.add_argument("--no-compile", action="store_true")
    add_run_arguments(parser)
    args = parser.parse_args()
    b, s = (2, 16) if args.quick else (args.batch, args.size)
    jobs = [("ddim", 5), ("dpm++", 4)] if args.quick else [("ddim", 50), ("dpm++", 20)]
    torch.manual_seed(0)
    x = torch.randn(b, 3, s, s, generator=torch.Generator().manual_seed(0))
    t = torch.randint(0, 1000, (b,), generator=torch.Generator().manual_seed(1))
    try:
        import diffusers  # noqa: F401
        peer = "diffusers"
    except ImportError:
        peer = None
    zoo_params = sum(p.numel() for p in zoo_model(s).parameters())
    gflop = count_flops(zoo_model(s), (x, t)) / 1e9
    title = (f"batch {b}, {s}x{s} RGB; zoo DiffusionUNet {zoo_params / 1e6:.2f}M params, {gflop:.2f} GFLOP/call; "
             + (f"diffusers UNet2DModel {sum(p.numel() for p in diffusers_model(s).parameters()) / 1e6:.2f}M params"
                if peer else "no diffusers rows (pip install diffusers)"))
    run = BenchRun(title)

    def row(label, mode, build, warmup):
        return build_row(label, mode, build, batch=b, dtype=torch.bfloat16 if "bf16" in mode else None,
                         warmup=warmup, force_emulated=args.force_emulated)

    def call(build, mode, peer_output):
        model = prepare(build(s), mode)
        return (lambda: model(x, t).sample) if peer_output else functools.partial(model, x, t)

    modes = ["eager fp32", "bf16"] + ([] if args.no_compile else ["compile", "compile+bf16"])
    extra = ["channels_last"] + ([] if args.no_compile else ["compile+bf16+channels_last"])
    def warmup(mode):
        return 3 if "compile" in mode else 1

    built = [row("zoo", mode, functools.partial(call, zoo_model, mode, False), warmup(mode)) for mode in modes + extra]
    if peer:
        built += [row("diffusers", mode, functools.partial(call, diffusers_model, mode, True), warmup(mode))
                  for mode in modes]
    denoiser = time_rows(built, rounds=args.reps, calls=1, peer=peer)

    # part 2: whole jobs; the fastest fp32 mode besides eager, and the bf16 one where the CPU has bf16
    def job(mode, sampler, steps):
        model = prepare(zoo_model(s), mode)
        model.sample(b, steps=2, sampler=sampler, seed=0)  # the warm-up (compiles) in two steps, not a whole job
        return functools.partial(model.sample, b, steps=steps, sampler=sampler, seed=0)

    def peer_job(steps):
        unet = diffusers_model(s)
        diffusers_ddim(unet, b, s, 2)
        return functools.partial(diffusers_ddim, unet, b, s, steps)

    # the fastest fp32 mode besides eager, and the bf16 one; DDPM-1000 eager would take minutes and say
    # nothing the per-call ratio does not
    best = [] if args.no_compile else ["compile+channels_last", "compile+bf16+channels_last"]
    built = [row("zoo", f"{mode} {sampler.upper()}-{steps}", functools.partial(job, mode, sampler, steps), 0)
             for mode in ["eager fp32", *best]
             for sampler, steps in jobs + ([("ddpm", 1000)] if args.ddpm and mode != "eager fp32" else [])]
    if peer:
        built.append(row("diffusers", f"eager fp32 DDIM-{jobs[0][1]}", functools.partial(peer_job, jobs[0][1]), 0))
    sampling = time_rows(built, rounds=args.reps, calls=1, peer=peer)
    run.finish()
    run.say(f"{args.reps} rounds per part, one call (job) of each row per round; ratio: to zoo eager fp32"
            + (", vs diffusers: to diffusers eager fp32" if peer else "") + ", medians over rounds")
    run.say("\n1. one denoiser call")
    run.say(format_table(denoiser, peer=peer, unit="call", items="img"))
    run.say(f"\n2. sampling {b} images, one job per call (ratio: to zoo eager fp32 {jobs[0][0].upper()}-{jobs[0][1]})")
    run.say(format_table(sampling, peer=peer, unit="job", items="img"))
    if args.save:
        run.save("diffusion_unet")


if __name__ == "__main__":
    main()
