"""Peak memory and time of one unet3d_seg training step per checkpointing policy (issue: unet3d_seg).

    python bench/unet3d_memory.py                 # deep preset, 1x1x96^3
    python bench/unet3d_memory.py --size 64 --preset base

Every configuration runs in a fresh process; peak memory is the kernel's peak RSS after a reset
(BASELINES.md), so it is measured, not estimated. MONAI's UNet is a peer row when monai is installed.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zoo.accel.bench import train_step_peak_mb  # noqa: E402

POLICIES = ["none", "blocks", "every_k", "selective"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deep")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--amp", default="off", choices=["off", "bf16"])
    args = parser.parse_args()
    rows = {}
    for policy in POLICIES:
        rows[policy] = train_step_peak_mb("unet3d_seg", 1, policy, args.amp, config={"preset": args.preset},
                                          example={"size": args.size})
    base = rows["none"]
    print(f"unet3d_seg preset={args.preset}, 1x1x{args.size}^3, amp={args.amp}, one training step, fresh process each")
    print(f"{'policy':<12} {'peak MiB':>9} {'saved':>7} {'step s':>8} {'time':>7}")
    for policy, r in rows.items():
        print(f"{policy:<12} {r['peak_mb']:9.1f} {1 - r['peak_mb'] / base['peak_mb']:6.1%} {r['step_s']:8.2f} "
              f"{r['step_s'] / base['step_s'] - 1:+6.1%}")


if __name__ == "__main__":
    main()
