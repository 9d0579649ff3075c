"""Peak memory and time of one unet3d_seg training step per checkpointing policy (issue: unet3d_seg).

    python bench/unet3d_memory.py --save          # deep preset, 1x1x96^3
    python bench/unet3d_memory.py --size 64 --preset base
    python bench/unet3d_memory.py --preset small --size 16 --no-peer   # a smoke run

Every configuration runs in a fresh process; peak memory is the kernel's peak RSS after a reset
(BASELINES.md), so it is measured, not estimated. The step time is that process's one step, not an
interleaved median: a rough figure (+-20% between processes). MONAI's UNet and CheckpointUNet are peer
rows when monai is installed (its strides need a size divisible by 16). --amp bf16 runs only where the
CPU has bf16 kernels (--force-emulated runs it anyway: a bf16 Conv3d is 165x slower than fp32 on AVX2).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from zoo.bench import BenchRun, add_run_arguments, emulated, train_step_peak_mb  # noqa: E402
from zoo.models.unet3d import dice_ce_loss  # noqa: E402

POLICIES = ["none", "blocks", "every_k", "selective"]


class _DiceCELoss(nn.Module):
    """A peer network whose output is the zoo model's benchmark loss (Dice + CE against an all-background
    target), which the harness's example_loss takes as the mean output of a peer's forward."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        logits = self.net(x)
        return dice_ce_loss(logits, torch.zeros(logits.shape[0], *logits.shape[2:], dtype=torch.long))


def monai_unet(batch: int, size: int, checkpoint: bool = False):
    """MONAI's residual 3D UNet as the issue states it (5 levels, 2 residual units), plain or CheckpointUNet."""
    from monai.networks.nets.unet import CheckpointUNet, UNet
    net = (CheckpointUNet if checkpoint else UNet)(spatial_dims=3, in_channels=1, out_channels=3,
                                                   channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2),
                                                   num_res_units=2)
    x = torch.randn(batch, 1, size, size, size, generator=torch.Generator().manual_seed(0))
    return _DiceCELoss(net), (x,)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deep")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--amp", default="off", choices=["off", "bf16"])
    parser.add_argument("--no-peer", action="store_true")
    add_run_arguments(parser, reps=None)  # no rounds: each row is one step in a fresh process
    args = parser.parse_args()
    reason = None if args.force_emulated or args.amp == "off" else emulated(torch.bfloat16)
    if reason:
        parser.error(f"--amp bf16: {reason}; --force-emulated runs it anyway")
    run = BenchRun(f"unet3d_seg preset={args.preset}, 1x1x{args.size}^3, amp={args.amp}, one training step, "
                   "fresh process each; saved and time are against the same model's row without checkpointing",
                   peaks=("fp32", "bf16") if args.amp == "bf16" else ("fp32",))
    groups = {"zoo": {p: train_step_peak_mb("unet3d_seg", 1, p, args.amp, config={"preset": args.preset},
                                            example={"size": args.size}) for p in POLICIES}}
    if not args.no_peer:
        try:
            import monai  # noqa: F401
        except ImportError:
            run.say("(monai not installed: no peer rows; pip install monai)")
        else:
            probe = "bench.unet3d_memory:monai_unet"
            groups["monai UNet"] = {
                "none": train_step_peak_mb(probe, 1, "none", args.amp, example={"size": args.size}),
                "CheckpointUNet": train_step_peak_mb(probe, 1, "none", args.amp,
                                                     example={"size": args.size, "checkpoint": True})}
    run.finish()
    run.say(f"{'model':<12} {'policy':<16} {'peak MiB':>9} {'saved':>7} {'step s':>8} {'time':>7}")
    for model, rows in groups.items():
        base = rows["none"]
        for policy, r in rows.items():
            run.say(f"{model:<12} {policy:<16} {r['peak_mb']:9.1f} {1 - r['peak_mb'] / base['peak_mb']:6.1%} "
                    f"{r['step_s']:8.2f} {r['step_s'] / base['step_s'] - 1:+6.1%}")
    if args.save:
        run.save("unet3d_seg_memory")


if __name__ == "__main__":
    main()
