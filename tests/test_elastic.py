"""Elastic training: a worker killed at a random moment, torchrun restarts the group, --resume continues from
the newest checkpoint, and the finished run's weights are bit-identical to an uninterrupted run's.

The recipe under test (README, "Training on several processes"):

    torchrun --nproc_per_node=2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint localhost:PORT \\
        train_scripts/<family>.py --dist ddp --resume --out runs/NAME ...

The test runs one trial; `python -m tests.test_elastic --trials 10` runs ten and prints each outcome.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from .test_train import SCRIPT, TINY, corpus, env, free_port, weights  # noqa: F401  (corpus: a fixture)

STEPS = 40
COMMON = [*TINY, "--steps", str(STEPS), "--eval-every", "10", "--save-every", "5", "--dropout", "0.1",
          "--batch-size", "4", "--dist", "ddp", "--seed", "3"]


def torchrun_command(out: Path, corpus: str, *, elastic: bool) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    if elastic:  # c10d rendezvous: the restarted workers meet again through the agent's store
        launcher += ["--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                     "--monitor-interval", "0.5"]
    else:
        launcher += ["--standalone"]
    return [*launcher, SCRIPT, *COMMON, "--data", corpus, "--out", str(out), *(["--resume"] if elastic else [])]


def workers(agent_pid: int) -> list[int]:
    """The training processes torchrun's agent started (its children running the script)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == agent_pid and SCRIPT.encode() in cmdline:
            found.append(int(entry))
    return sorted(found)


def training_started(out: Path) -> bool:
    """The first training-loss record is written: start-up (imports, data, process group) is over."""
    metrics = out / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def run_to_end(cmd: list[str], timeout: float, kill_after: float | None = None, rng: random.Random | None = None,
               out: Path | None = None) -> tuple[int, str, float | None]:
    """Run `cmd`; with `kill_after`, SIGKILL one random worker that many seconds after training started
    (the first metrics record in `out`). Returns (exit code, stderr, seconds into training of the kill or None)."""
    # LOGLEVEL=INFO: torchrun's agent then says when it restarts the worker group
    proc = subprocess.Popen(cmd, env={**env(), "LOGLEVEL": "INFO"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed_at = None
    try:
        if kill_after is not None:
            started = None
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                pids = workers(proc.pid)
                if pids and started is None and training_started(out):
                    started = time.monotonic()
                if started is not None and time.monotonic() - started >= kill_after and pids:
                    os.kill((rng or random).choice(pids), signal.SIGKILL)
                    killed_at = time.monotonic() - started
                    break
                time.sleep(0.05)
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, err, killed_at


def trial(root: Path, corpus: str, reference: dict[str, torch.Tensor], seed: int,
          duration: float) -> tuple[bool, str]:
    """One elastic run with a worker killed at a random moment in the first `duration` seconds; True when it
    finished with weights bit-identical to `reference`."""
    rng = random.Random(seed)
    out = root / f"trial-{seed}"
    code, err, killed_at = run_to_end(torchrun_command(out, corpus, elastic=True), timeout=600,
                                      kill_after=rng.uniform(0.0, duration), rng=rng, out=out)
    if killed_at is None:
        return False, "the run finished before the kill: no trial (give a longer run or an earlier kill)"
    if code != 0:
        return False, f"killed at {killed_at:.1f}s: exit {code}\n{err[-3000:]}"
    got = weights(out)
    same = got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in reference)
    restarts = err.count("will restart worker group")
    resumed = sorted(int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", err))
    return same and restarts >= 1, (f"killed at {killed_at:.1f}s, {restarts} restart(s), resumed at step(s) "
                                    f"{resumed or 'none (no checkpoint yet: started over)'}, weights "
                                    f"{'bit-identical' if same else 'DIFFER'}")


def reference_run(root: Path, corpus: str) -> tuple[dict[str, torch.Tensor], float]:
    """The uninterrupted run's weights and how long its training took (from the first metrics record)."""
    out = root / "reference"
    proc = subprocess.Popen(torchrun_command(out, corpus, elastic=False), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    while proc.poll() is None and not training_started(out):
        time.sleep(0.05)
    started = time.monotonic()
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return weights(out), time.monotonic() - started


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(corpus, tmp_path):  # noqa: F811
    reference, seconds = reference_run(tmp_path, corpus)
    ok, report = trial(tmp_path, corpus, reference, seed=1, duration=seconds * 0.8)
    assert ok, report


def main() -> None:
    parser = argparse.ArgumentParser(description="elastic-restart trials (see the module docstring)")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--root", default="runs/elastic-trials")
    args = parser.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    g = torch.Generator().manual_seed(0)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "fair", "day", "night"]
    corpus.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (900,), generator=g).tolist()) + "\n")
    reference, seconds = reference_run(root, str(corpus))
    print(f"reference run: {seconds:.1f} s of training; each trial kills one of 2 workers at a random moment in "
          f"its first {seconds * 0.8:.1f} s of training", flush=True)
    passed = 0
    for seed in range(1, args.trials + 1):
        ok, report = trial(root, str(corpus), reference, seed, seconds * 0.8)
        passed += ok
        print(f"trial {seed}: {'ok' if ok else 'FAILED'}: {report}", flush=True)
    print(f"{passed}/{args.trials} trials ended bit-identical to the uninterrupted run")
    sys.exit(0 if passed == args.trials else 1)


if __name__ == "__main__":
    main()
