"""Replay a recording's actions through the real game, the neural engine, or both (`neuraldoom replay`).

Row t of a recording holds frame t and the action taken after it. Per episode:
- real:   `reset(seed of the episode)`, then the recorded actions; real frame t is compared with recorded
          frame t (a real recording replays byte for byte; a neural one shows "what would really have
          happened").
- neural: the context is filled from the first `warmup` frames of the reference (padded to the context
          length), then the recorded actions are rolled out. The reference is the recording, or the real
          replay when the recording itself was neural.
- both:   real replay vs neural replay of the same actions.
Every row gives one PSNR/SSIM value, so a recording of N frames gives N values (frames given as context,
not generated, are marked so and left out of the means). `resync_every` refills the neural context from
the reference every N generated steps: what a periodic re-sync does to the error.
With `out`: OUT/replay.mp4 (reference | replay), OUT/psnr.png, OUT/replay.json.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from . import metrics as M
from .actions import NOOP, Action
from .config import TICS_PER_SECOND, GameConfig, game_mismatch
from .files import atomic_path, write_text
from .recording import Recording, RecordingError, unwritable, write_mp4

ENGINES = ("real", "neural", "both")
UNDER_DB = 20.0
CLIP_DB = 60.0  # the plot's ceiling
GAP = 4  # black columns between the two halves of the video


def _warn(msg: str) -> None:
    print(f"neuraldoom: warning: {msg}", file=sys.stderr)


def check_compatible(rec: Recording, ckpt_game: GameConfig) -> None:
    """One clear line when a recording was made in another game than the checkpoint learned."""
    why = game_mismatch(rec.game, ckpt_game)
    if why:
        raise RecordingError(f"{rec.path} {why}")


def has_seeds(rec: Recording) -> bool:
    return bool(len(rec)) and all(int(rec.steps["seed"][s]) >= 0 for s, _ in rec.episodes())


def replay_steps(rec: Recording, engine: str, neural: Any = None, real: Any = None, warmup: int = 1,
                 resync_every: int = 0) -> Iterator[tuple[int, np.ndarray, np.ndarray, bool, bool]]:
    """Yield (row, reference frame, replayed frame, generated, resynced) for every row of `rec`.

    engine "real": reference = recording, replayed = `real` (a RealGame). Otherwise replayed = `neural`
    and reference = the real replay when `real` is given, else the recording.
    """
    noop = NOOP.code
    acts = rec.actions
    for s, e in rec.episodes():
        seed = int(rec.steps["seed"][s])
        hist: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=neural.n if neural is not None else 1)
        for t in range(s, e):
            k = t - s
            led = noop if k == 0 else acts[t - 1]  # the action that led to frame t
            recorded = np.array(rec.frames[t])  # a copy: memmaps are read-only
            if real is not None:
                ref = (real.reset(seed) if k == 0 else real.step(Action.from_code(led))).copy()
                if engine == "real":
                    yield t, recorded, ref, True, False
                    continue
            else:
                ref = recorded
            resynced = False
            if k < warmup:
                out = ref  # given as context, not generated
            else:
                g = k - warmup
                if resync_every and g > 0 and g % resync_every == 0:
                    neural.set_context(*map(np.stack, zip(*hist, strict=True)))
                    resynced = True
                out = neural.step(Action.from_code(led))
            hist.append((ref, led))
            if k == warmup - 1:
                neural.set_context(*map(np.stack, zip(*hist, strict=True)))
            yield t, ref, out, k >= warmup, resynced


def run_replay(path: str | Path, engine: str = "both", checkpoint: str | Path | None = None,
               out: str | Path | None = None, compile: bool = False, warmup: int = 1, resync_every: int = 0,
               seed: int = 0, measure_ssim: bool = True,
               warn: Callable[[str], None] = _warn) -> dict[str, Any]:
    """Replay the recording at `path`; return the report (and write OUT/* when `out` is given)."""
    if engine not in ENGINES:
        raise RecordingError(f"unknown engine {engine!r}; use {', '.join(ENGINES)}")
    if warmup < 1:
        raise RecordingError(f"--warmup must be >= 1 (the neural engine needs a frame to start from), got {warmup}")
    if resync_every < 0:
        raise RecordingError(f"--resync-every must be >= 0, got {resync_every}")
    outdir = Path(out) if out is not None else None
    why = unwritable(outdir) if outdir is not None else None
    if why:  # before any engine starts
        raise RecordingError(f"cannot write the replay to {outdir}: {why}")
    rec = Recording(path)
    if len(rec) == 0:
        raise RecordingError(f"{rec.path} holds no frames to replay")
    rec_engine = rec.meta.get("engine", "real")
    seeded = has_seeds(rec)
    if not seeded and engine == "real":
        raise RecordingError(f"{rec.path} has no game seed: the real game cannot replay it "
                             "(--engine neural replays it against the recorded frames)")
    if not seeded and engine != "neural":
        warn(f"{rec.path} has no game seed: the real game cannot replay it; replaying through the neural "
             "engine only, against the recorded frames")
        engine = "neural"
    neural = None
    if engine != "real":
        if checkpoint is None:
            raise RecordingError("replaying through the neural engine needs a checkpoint")
        from .checkpoint import Checkpoint
        from .engine import NeuralEngine

        ckpt = Checkpoint(checkpoint)
        check_compatible(rec, ckpt.game)
        neural = NeuralEngine(ckpt, compile=compile, seed=seed)
        neural.reset(seed)
    # the real game replays "both", "real", and a neural recording's actions (its reference)
    use_real = seeded and (engine != "neural" or rec_engine != "real")
    real = None
    if use_real:
        from .game import RealGame

        game = rec.game if rec_engine == "real" else replace(rec.game, episode_timeout=0)  # never enforced
        real = RealGame(game)
    if engine == "real":
        left, right = f"recording ({rec_engine})", "real replay"
    else:
        left, right = ("real replay" if real is not None else f"recording ({rec_engine})"), "neural replay"

    n = len(rec)
    psnr, ssim, mse = np.zeros(n), np.full(n, np.nan), np.zeros(n)
    generated = np.zeros(n, bool)
    resyncs: list[int] = []

    def frames() -> Iterator[np.ndarray]:
        for t, ref, rep, gen, resynced in replay_steps(rec, engine, neural, real, warmup, resync_every):
            mse[t] = M.mse(rep, ref)
            psnr[t] = M.psnr_from_mse(mse[t])
            if measure_ssim:
                ssim[t] = M.ssim(rep, ref)
            generated[t] = gen
            if resynced:
                resyncs.append(t)
            yield np.concatenate([ref, np.zeros((ref.shape[0], GAP, 3), np.uint8), rep], 1)

    try:
        if outdir is not None:
            try:
                outdir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RecordingError(f"cannot write the replay to {outdir}: {e.strerror}") from None
            write_mp4(outdir / "replay.mp4", frames(), TICS_PER_SECOND / rec.game.frame_skip, scale=2)
        else:
            for _ in frames():
                pass
    finally:
        for eng in (real, neural):
            if eng is not None:
                eng.close()

    under = np.flatnonzero(generated & (psnr < UNDER_DB))
    report: dict[str, Any] = {
        "recording": str(rec.path),
        "recording_engine": rec_engine,
        "checkpoint": str(checkpoint) if neural is not None else None,
        "engine": engine,
        "left": left,
        "right": right,
        "frames": n,
        "episode_starts": [s for s, _ in rec.episodes()],
        "seeds": [int(rec.steps["seed"][s]) for s, _ in rec.episodes()],
        "warmup": warmup if engine != "real" else 0,
        "resync_every": resync_every if engine != "real" else 0,
        "resync_steps": resyncs,
        "generated_steps": int(generated.sum()),
        # set PSNR over the generated steps (10 log10(255^2 / mean MSE)), never a mean of per-step PSNRs
        "mean_psnr": M.psnr_from_mse(float(mse[generated].mean())) if generated.any() else None,
        "mean_ssim": float(np.nanmean(ssim[generated])) if generated.any() and measure_ssim else None,
        "first_step_under_20db": int(under[0]) if len(under) else None,
        "identical_frames": int((mse == 0).sum()),
        "psnr": [round(float(v), 4) for v in psnr],  # one per row; identical frames: the cap, ~148 dB
        "ssim": [None if np.isnan(v) else round(float(v), 5) for v in ssim],
        "generated": generated.tolist(),
    }
    if outdir is not None:
        try:
            write_text(outdir / "replay.json", json.dumps(report, indent=1))
            _plot(outdir / "psnr.png", report)
        except OSError as e:
            raise RecordingError(f"cannot write the replay to {outdir}: {e.strerror}") from None
        report["files"] = [str(outdir / f) for f in ("replay.mp4", "psnr.png", "replay.json")]
    return report


def summary_line(rep: dict[str, Any]) -> str:
    mean = f"{rep['mean_psnr']:.2f} dB" if rep["mean_psnr"] is not None else "n/a"
    ssim = f", SSIM {rep['mean_ssim']:.3f}" if rep.get("mean_ssim") is not None else ""
    under = rep["first_step_under_20db"]
    line = (f"neuraldoom: replayed {rep['frames']} frames ({rep['engine']}): {rep['right']} vs {rep['left']} "
            f"PSNR {mean}{ssim} over {rep['generated_steps']} steps; first step under {UNDER_DB:g} dB: "
            f"{'none' if under is None else under}")
    if rep["engine"] == "real":
        line += f"; {rep['identical_frames']}/{rep['frames']} frames identical"
    if rep.get("files"):
        line += f"; wrote {', '.join(rep['files'])}"
    return line


def _plot(path: Path, rep: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    psnr = np.minimum(np.array(rep["psnr"]), CLIP_DB)  # identical frames (~148 dB) would squash the scale
    steps = np.arange(len(psnr))
    gen = np.array(rep["generated"], bool)
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(steps, np.where(gen, psnr, np.nan), lw=1, label=f"{rep['right']} vs {rep['left']}")
    if (~gen).any():
        ax.plot(steps, np.where(~gen, psnr, np.nan), ".", ms=3, color="gray", label="given as context")
    ax.axhline(UNDER_DB, color="red", ls="--", lw=0.8, label=f"{UNDER_DB:g} dB")
    for s in rep["episode_starts"][1:]:
        ax.axvline(s, color="black", lw=0.8)
    for s in rep["resync_steps"]:
        ax.axvline(s, color="green", lw=0.5, ls=":")
    mean = f", set PSNR {rep['mean_psnr']:.2f} dB" if rep["mean_psnr"] is not None else ""
    resync = f", re-sync every {rep['resync_every']}" if rep["resync_every"] else ""
    ax.set(xlabel="step (recording row)", ylabel=f"PSNR (dB, identical frames drawn at {CLIP_DB:g})",
           title=f"{Path(rep['recording']).name}: {rep['engine']}{resync}{mean}")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)


__all__ = ["run_replay", "replay_steps", "check_compatible", "has_seeds", "summary_line", "ENGINES"]
