"""Every stage in one command, for a machine lent for minutes (one GPU: collect -> autoencoder -> decoder
fine-tune -> denoiser -> export -> 1-step student -> evaluate), writing the checkpoint and the report to OUT.

    python -m training.pipeline --out runs/gpu --frames 300000 --ae-minutes 1.5 --dec-minutes 0.5 \\
        --dm-minutes 5 --batch 256 --workers 12
    python -m training.pipeline --out runs/gpu --init-from checkpoints/e1m1 --frames 300000 --workers 12 \\
        --dm-minutes 5 --batch 64 --lr 4.2e-4 --student-minutes 1 --extra-dm "--drift 0.6"
    python -m training.pipeline --out runs/gpu --init-from checkpoints/e1m1 --fresh --frames 300000 --workers 12 \\
        --dm-minutes 8 --batch 64 --lr 4.2e-4 --extra-dm "--drift 0.6 --turn-warp --warp-fill last"

--init-from continues a trained checkpoint instead of starting over (what the CPU runs found the shipped
denoiser short of is samples: docs/EXPERIMENTS.md): its game is collected, its autoencoder is kept (no
autoencoder stages), its denoiser trained on, and the checkpoint it started from is evaluated on the same
held-out play beside the result, with `training.compare`'s paired differences printed and kept in
OUT/compare.txt. With --fresh the denoiser starts over instead, on the checkpoint's autoencoder (train_diffusion's
own architecture and flags: a recipe that must be trained from its first step, such as the turn warp), and ships
with the checkpoint's sampler settings and status-bar denoiser (export --play-like). Collect's seed 0 replays the
episodes of an earlier seed-0 collection worker by worker, each in its own split, so a held-out episode here was
never trained on by a checkpoint made from those.

Each stage is the ordinary stage module called with the flags below, so it resumes like them: rerun the
same command after an interruption and finished stages are skipped (collect tops up, trainers see their
budget spent). The same command runs on a CPU with tiny budgets (the tests do exactly that).
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neuraldoom.checkpoint import Checkpoint, CheckpointError
from neuraldoom.config import AutoencoderConfig, DenoiserConfig, SamplerConfig, parse_args
from training import collect, compare, distill, evaluate, export, train_autoencoder, train_diffusion


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
    free_steps: int = 0  # the evaluation's free play (training.evaluate --free-steps); 0 = none
    threads: int = 1
    init_from: str = ""  # continue this checkpoint (module doc): no autoencoder stages, its architecture
    fresh: bool = False  # with --init-from: a new denoiser on its autoencoder instead of its denoiser continued
    student_minutes: float = 0.0  # distil the new teacher's 1-step student (play's --steps 1) this long; 0 = none
    extra_collect: str = ""  # more training.collect flags, space-separated
    extra_ae: str = ""  # more train_autoencoder flags, space-separated
    extra_dm: str = ""  # more train_diffusion flags, space-separated
    extra_eval: str = ""  # more training.evaluate flags, space-separated


Stage = tuple[str, Callable[[list[str]], int], list[str]]


def stages(a: Args) -> list[Stage]:
    """What runs, in order: (name, the stage's main, its flags)."""
    out = Path(a.out)
    data, ae, dec, dm, ck = out / "data", out / "ae", out / "dec", out / "dm", out / "checkpoint"
    budget = ["--minutes", str(a.dm_minutes), "--batch", str(a.batch), "--lr", str(a.lr), "--max-frames",
              str(a.max_frames), "--threads", str(a.threads), *a.extra_dm.split()]
    evaluation = ["--data", str(data), "--rollouts", str(a.rollouts), "--rollout-steps", str(a.rollout_steps),
                  "--free-steps", str(a.free_steps), "--teacher", "--threads", str(a.threads), *a.extra_eval.split()]
    if a.init_from:
        g = Checkpoint(a.init_from).game
        game = ["--wad", g.wad, "--map", g.map, "--width", str(g.width), "--height", str(g.height),
                "--frame-skip", str(g.frame_skip), *(["--scenario", g.scenario] if g.scenario else [])]
        start = ["--autoencoder", str(Path(a.init_from) / "autoencoder")] if a.fresh else ["--init-from", a.init_from]
        like = ["--play-like", a.init_from] if a.fresh else []
        made = [("denoiser", train_diffusion.main, ["--data", str(data), *start, "--out", str(dm), *budget]),
                ("export", export.main, ["--checkpoint", str(dm / "checkpoint"), *like, "--out", str(ck)])]
    elif a.fresh:
        raise CheckpointError("--fresh starts a new denoiser on a checkpoint's autoencoder: give --init-from too")
    else:
        game = []
        made = [
            ("autoencoder", train_autoencoder.main,
             ["--data", str(data), "--out", str(ae), "--minutes", str(a.ae_minutes), "--batch", str(a.ae_batch),
              "--latent-channels", str(a.latent_channels), "--grad-weight", str(a.grad_weight),
              "--threads", str(a.threads), *a.extra_ae.split()]),
            ("decoder", train_autoencoder.main,
             ["--data", str(data), "--out", str(dec), "--init-from", str(ae / "autoencoder"), "--decoder-only",
              "--minutes", str(a.dec_minutes), "--batch", str(max(a.ae_batch // 4, 1)), "--lr", "3e-4",
              "--grad-weight", str(a.grad_weight), "--threads", str(a.threads), *a.extra_ae.split()]),
            ("denoiser", train_diffusion.main,
             ["--data", str(data), "--autoencoder", str(ae / "autoencoder"), "--out", str(dm), "--target", a.target,
              "--reads", str(a.reads), "--block-out-channels", *map(str, a.block_out_channels), *budget]),
            ("export", export.main, ["--checkpoint", str(dm / "checkpoint"), "--autoencoder", str(dec / "autoencoder"),
                                     "--out", str(ck)])]
    run = [("collect", collect.main, ["--steps", str(a.frames), "--out", str(data), "--workers", str(a.workers),
                                      *game, *a.extra_collect.split()]), *made]
    if a.student_minutes > 0:
        run += [("student", distill.main, ["--checkpoint", str(ck), "--data", str(data), "--out", str(out / "student"),
                                          "--steps", "1", "--teacher-steps", str(SamplerConfig.steps),
                                          "--latents", str(dm / "latents"), "--max-frames", str(a.max_frames),
                                          "--minutes", str(a.student_minutes), "--threads", str(a.threads)]),
                ("export student", export.main, ["--checkpoint", str(ck), "--students",
                                                 str(out / "student" / "checkpoint"), "--out", str(ck)])]
    run.append(("evaluate", evaluate.main, ["--checkpoint", str(ck), "--out", str(out / "eval"), *evaluation]))
    if a.init_from:
        run += [("evaluate start", evaluate.main, ["--checkpoint", a.init_from, "--out", str(out / "eval-start"),
                                                   *evaluation]),
                ("compare", _compare_to(out / "compare.txt"), [str(out / "eval-start"), str(out / "eval")])]
    return run


def _compare_to(path: Path) -> Callable[[list[str]], int]:
    """training.compare, its table printed and kept in PATH."""
    def run(argv: list[str]) -> int:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = compare.main(argv)
        print(buf.getvalue(), end="")
        path.write_text(buf.getvalue())
        return rc
    return run


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    try:
        run = stages(a)
    except CheckpointError as e:
        print(f"pipeline: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    for name, fn, flags in run:
        t = time.time()
        print(f"pipeline: {name} {' '.join(flags)}", flush=True)
        rc = fn(flags)
        if rc:
            print(f"pipeline: {name} failed (exit {rc})", file=sys.stderr)
            return rc
        print(f"pipeline: {name} done in {time.time() - t:.0f}s ({time.time() - t0:.0f}s in all)", flush=True)
    out = Path(a.out)
    print(f"pipeline: checkpoint in {out / 'checkpoint'}, report in {out / 'eval' / 'report.json'}"
          + (f", against the start in {out / 'compare.txt'}" if a.init_from else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
