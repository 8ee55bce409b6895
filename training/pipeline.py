"""Every stage in one command, for a machine lent for minutes (one GPU: collect -> autoencoder -> decoder
fine-tune -> denoiser -> evaluate -> export), writing the checkpoint and the report to OUT.

    python -m training.pipeline --out runs/gpu --frames 300000 --ae-minutes 1.5 --dec-minutes 0.5 \\
        --dm-minutes 5 --batch 256 --workers 12

Each stage is the ordinary stage module called with the flags below, so it resumes like them: rerun the
same command after an interruption and finished stages are skipped (collect tops up, trainers see their
budget spent). The same command runs on a CPU with tiny budgets (the tests do exactly that).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from neuraldoom.config import AutoencoderConfig, DenoiserConfig, parse_args
from training import collect, evaluate, export, train_autoencoder, train_diffusion


@dataclass(frozen=True)
class Args:
    out: str  # everything lands here: data/, ae/, dec/, dm/, eval/, checkpoint/
    frames: int = 300000  # frames of sticky-random play to collect
    workers: int = 3  # parallel games
    ae_minutes: float = 1.5
    dec_minutes: float = 0.5  # decoder-only fine-tune on whole frames (encoder frozen)
    dm_minutes: float = 5.0
    ae_batch: int = 64
    batch: int = 256  # denoiser batch
    lr: float = 3e-4  # denoiser learning rate
    max_frames: int = 0  # frames encoded for the denoiser (0 = all)
    target: str = DenoiserConfig.target
    reads: int = DenoiserConfig.reads
    block_out_channels: tuple[int, ...] = (32, 64, 128)
    latent_channels: int = AutoencoderConfig.latent_channels
    grad_weight: float = 0.5
    rollouts: int = 8
    rollout_steps: int = 128
    threads: int = 1
    extra_collect: str = ""  # more training.collect flags, space-separated
    extra_ae: str = ""  # more train_autoencoder flags, space-separated
    extra_dm: str = ""  # more train_diffusion flags, space-separated


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    out = Path(a.out)
    data, ae, dec, dm = out / "data", out / "ae", out / "dec", out / "dm"
    t0 = time.time()
    stages = [
        ("collect", collect.main, ["--steps", str(a.frames), "--out", str(data), "--workers", str(a.workers),
                                     *a.extra_collect.split()]),
        ("autoencoder", train_autoencoder.main,
         ["--data", str(data), "--out", str(ae), "--minutes", str(a.ae_minutes), "--batch", str(a.ae_batch),
          "--latent-channels", str(a.latent_channels), "--grad-weight", str(a.grad_weight),
          "--threads", str(a.threads), *a.extra_ae.split()]),
        ("decoder", train_autoencoder.main,
         ["--data", str(data), "--out", str(dec), "--init-from", str(ae / "autoencoder"), "--decoder-only",
          "--minutes", str(a.dec_minutes), "--batch", str(max(a.ae_batch // 4, 1)), "--lr", "3e-4",
          "--grad-weight", str(a.grad_weight), "--threads", str(a.threads), *a.extra_ae.split()]),
        ("denoiser", train_diffusion.main,
         ["--data", str(data), "--autoencoder", str(ae / "autoencoder"), "--out", str(dm), "--minutes",
          str(a.dm_minutes), "--batch", str(a.batch), "--lr", str(a.lr), "--max-frames", str(a.max_frames),
          "--target", a.target, "--reads", str(a.reads), "--block-out-channels",
          *map(str, a.block_out_channels), "--threads", str(a.threads), *a.extra_dm.split()]),
        ("export", export.main, ["--checkpoint", str(dm / "checkpoint"), "--autoencoder", str(dec / "autoencoder"),
                                 "--out", str(out / "checkpoint")]),
        ("evaluate", evaluate.main, ["--checkpoint", str(out / "checkpoint"), "--data", str(data),
                                     "--out", str(out / "eval"), "--rollouts", str(a.rollouts),
                                     "--rollout-steps", str(a.rollout_steps), "--threads", str(a.threads)]),
    ]
    for name, fn, flags in stages:
        t = time.time()
        print(f"pipeline: {name} {' '.join(flags)}", flush=True)
        rc = fn(flags)
        if rc:
            print(f"pipeline: {name} failed (exit {rc})", file=sys.stderr)
            return rc
        print(f"pipeline: {name} done in {time.time() - t:.0f}s ({time.time() - t0:.0f}s in all)", flush=True)
    print(f"pipeline: checkpoint in {out / 'checkpoint'}, report in {out / 'eval' / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
