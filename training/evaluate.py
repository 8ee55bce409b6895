"""Evaluate a checkpoint on held-out recordings (GameNGen §5, with the baselines that keep PSNR honest).

    python -m training.evaluate --checkpoint checkpoints/e1m1 --data data/e1m1 --out runs/eval

Prints a table and writes OUT/report.json, OUT/ar_psnr.png and OUT/grid.png:
- teacher-forced next-frame PSNR/SSIM (real context, DDIM steps of the checkpoint, CFG as shipped and 1.0);
- the copy-last-frame baseline, the mean-frame baseline, the autoencoder ceiling (decode(encode(real)));
- the status bar's own PSNR for the model and the autoencoder (it is game state);
- autoregressive rollouts fed the real actions: PSNR and sharpness per step, with copy-last per step.
Set PSNR is 10*log10(255^2 / mean MSE) over all frames, never a mean of per-frame PSNRs.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from neuraldoom import actions as A
from neuraldoom import autoencoder as AE
from neuraldoom import metrics as M
from neuraldoom.checkpoint import Checkpoint, CheckpointError
from neuraldoom.config import parse_args
from neuraldoom.engine import NeuralEngine
from neuraldoom.recording import Recording, RecordingError, find_recordings


@dataclass(frozen=True)
class Args:
    checkpoint: str
    data: str  # dataset folder: DATA/heldout is evaluated, DATA/train gives the mean frame
    out: str
    samples: int = 64  # teacher-forced targets
    rollouts: int = 8  # autoregressive episodes
    rollout_steps: int = 64
    seed: int = 0
    compile: bool = False  # use the compiled sampler (slower to start, faster to run)
    threads: int = 1


def check_compatible(rec: Recording, ckpt: Checkpoint) -> None:
    g, c = rec.game, ckpt.game
    for f in ("height", "width", "frame_skip", "map"):
        if getattr(g, f) != getattr(c, f):
            raise RecordingError(f"{rec.path} has {f}={getattr(g, f)!r} but the checkpoint was trained on "
                                 f"{f}={getattr(c, f)!r}")


def history(rec: Recording, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The up-to-n real frames before row i of its episode, and the actions that led to them
    (action j-1 led to frame j; the episode's first frame was led to by no action: NOOP)."""
    s = next(s for s, e in rec.episodes() if s <= i < e)
    lo = max(s, i - n)
    noop = np.array([A.NOOP.buttons, A.NOOP.turn])
    acts = np.stack([rec.actions[j - 1] if j - 1 >= s else noop for j in range(lo, i)])
    return np.asarray(rec.frames[lo:i]), acts


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    try:
        ckpt = Checkpoint(a.checkpoint)
        recs = [Recording(p) for p in find_recordings(Path(a.data) / "heldout")]
        recs = [r for r in recs if len(r)]
        for r in recs:
            check_compatible(r, ckpt)
        train = [Recording(p) for p in find_recordings(Path(a.data) / "train")]
    except (CheckpointError, RecordingError) as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    n = ckpt.denoiser_cfg.context
    H, W = ckpt.game.height, ckpt.game.width
    eng = NeuralEngine(ckpt, compile=a.compile, seed=a.seed, wait_compile=True)
    eng1 = NeuralEngine(ckpt, compile=a.compile, guidance=1.0, seed=a.seed, wait_compile=True)

    # mean-frame baseline: the average training frame
    pool = [r.frames[i] for r in train if len(r) for i in np.linspace(0, len(r) - 1, 200).astype(int)]
    mean_frame = np.mean(np.stack(pool).astype(np.float32), 0).round().astype(np.uint8)

    # -- teacher-forced ----------------------------------------------------------------------
    targets = []
    for r in recs:
        for s, e in r.episodes():
            targets += [(r, i) for i in range(s + 1, e)]
    pick = rng.choice(len(targets), min(a.samples, len(targets)), replace=False)
    real, prev, gen, gen1 = [], [], [], []
    for k in pick:
        r, i = targets[k]
        frames, acts = history(r, i, n)
        act = r.actions[i - 1]
        for e, sink in ((eng, gen), (eng1, gen1)):
            e.set_context(frames, acts)
            sink.append(e.step(_action(act)))
        real.append(np.asarray(r.frames[i]))
        prev.append(frames[-1])
    real, prev, gen, gen1 = map(np.stack, (real, prev, gen, gen1))
    ae_rec = AE.decode(ckpt.ae, AE.encode(ckpt.ae, real), H, W)
    report: dict = {
        "checkpoint": str(a.checkpoint),
        "n_samples": len(real),
        "tf_psnr": M.psnr(gen, real),
        "tf_psnr_nocfg": M.psnr(gen1, real),
        "tf_ssim": M.ssim(gen, real),
        "tf_sharpness": M.sharpness(gen, real),
        "copy_last_psnr": M.psnr(prev, real),
        "copy_last_ssim": M.ssim(prev, real),
        "mean_frame_psnr": M.psnr(np.broadcast_to(mean_frame, real.shape), real),
        "ae_psnr": M.psnr(ae_rec, real),
        "ae_ssim": M.ssim(ae_rec, real),
        "hud_psnr": M.psnr(M.hud(gen), M.hud(real)),
        "ae_hud_psnr": M.psnr(M.hud(ae_rec), M.hud(real)),
        "copy_last_hud_psnr": M.psnr(M.hud(prev), M.hud(real)),
    }

    # -- autoregressive ----------------------------------------------------------------------
    T = a.rollout_steps
    starts = [(r, s + min(n, (e - s) // 2)) for r in recs for s, e in r.episodes() if e - s > T + 2]
    starts = [starts[k] for k in rng.choice(len(starts), min(a.rollouts, len(starts)), replace=False)]
    ar_real = np.zeros((len(starts), T, H, W, 3), np.uint8)
    ar_gen, ar_copy = np.zeros_like(ar_real), np.zeros_like(ar_real)
    for j, (r, i) in enumerate(starts):
        T_j = min(T, len(r) - i)
        frames, acts = history(r, i, n)
        eng.set_context(frames, acts)
        for t in range(T_j):
            ar_gen[j, t] = eng.step(_action(r.actions[i + t - 1]))
            ar_real[j, t] = r.frames[i + t]
            ar_copy[j, t] = frames[-1]
    report["ar_psnr"] = [M.psnr(ar_gen[:, t], ar_real[:, t]) for t in range(T)]
    report["ar_copy_last_psnr"] = [M.psnr(ar_copy[:, t], ar_real[:, t]) for t in range(T)]
    report["ar_mean_frame_psnr"] = [M.psnr(np.broadcast_to(mean_frame, ar_real[:, t].shape), ar_real[:, t])
                                    for t in range(T)]
    report["ar_sharpness"] = [M.sharpness(ar_gen[:, t], ar_real[:, t]) for t in range(T)]
    report["n_rollouts"] = len(starts)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    _plots(out, report, prev, real, gen, ar_real, ar_gen)

    rows = [(f"teacher-forced PSNR (CFG {ckpt.sampler_cfg.cfg:.1f})", report["tf_psnr"]),
            ("teacher-forced PSNR (CFG 1.0)", report["tf_psnr_nocfg"]),
            ("teacher-forced SSIM", report["tf_ssim"]),
            ("copy-last-frame PSNR", report["copy_last_psnr"]),
            ("mean-frame PSNR", report["mean_frame_psnr"]),
            ("autoencoder ceiling PSNR", report["ae_psnr"]),
            ("status bar PSNR: model / autoencoder", f"{report['hud_psnr']:.2f} / {report['ae_hud_psnr']:.2f}"),
            ("sharpness, teacher-forced", report["tf_sharpness"])]
    for t in (1, 8, 16, 32, 64):
        if t <= T:
            rows.append((f"autoregressive step {t}: model / copy-last / sharpness",
                         f"{report['ar_psnr'][t - 1]:.2f} / {report['ar_copy_last_psnr'][t - 1]:.2f} / "
                         f"{report['ar_sharpness'][t - 1]:.2f}"))
    print(f"{'metric':<58} value  (n={report['n_samples']} held-out targets, {len(starts)} rollouts)")
    for k, v in rows:
        print(f"{k:<58} {v:.3f}" if isinstance(v, float) else f"{k:<58} {v}")
    return 0


def _action(code: np.ndarray) -> A.Action:
    return A.Action(int(code[0]), int(code[1]))


def _plots(out: Path, rep: dict, prev, real, gen, ar_real, ar_gen) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    steps = np.arange(1, len(rep["ar_psnr"]) + 1)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(steps, rep["ar_psnr"], label="model")
    ax[0].plot(steps, rep["ar_copy_last_psnr"], label="copy last context frame")
    ax[0].plot(steps, rep["ar_mean_frame_psnr"], label="mean frame", ls=":")
    ax[0].axhline(rep["ae_psnr"], color="gray", ls="--", label="autoencoder ceiling")
    ax[0].set(xlabel="autoregressive step", ylabel="PSNR (dB)")
    ax[0].legend(fontsize=7)
    ax[1].plot(steps, rep["ar_sharpness"])
    ax[1].axhline(1.0, color="gray", ls="--")
    ax[1].set(xlabel="autoregressive step", ylabel="sharpness (generated / real)")
    fig.tight_layout()
    fig.savefig(out / "ar_psnr.png", dpi=90)
    plt.close(fig)
    k = min(6, len(real))
    tf = np.concatenate([np.concatenate([prev[i], real[i], gen[i]], 1) for i in range(k)], 0)
    Image.fromarray(tf).save(out / "grid.png")  # rows: last context frame | real next | model next
    if len(ar_real):
        idx = [t for t in (0, 3, 7, 15, 31, 63) if t < ar_real.shape[1]]
        strip = np.concatenate([np.concatenate([ar_real[0, t] for t in idx], 1),
                                np.concatenate([ar_gen[0, t] for t in idx], 1)], 0)
        Image.fromarray(strip).save(out / "rollout.png")  # top: real, bottom: model, steps 1..64


if __name__ == "__main__":
    sys.exit(main())
