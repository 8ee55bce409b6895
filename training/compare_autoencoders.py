"""Compare trained autoencoders on one fixed held-out set: one markdown row each, and pictures.

    python -m training.compare_autoencoders --data data/e1m1 --autoencoders runs/aeA/autoencoder \\
        runs/aeB/autoencoder --names A B --pictures docs/autoencoder

Each row: PSNR, status-bar PSNR, status bar read right (all three numbers, against the recording's game
variables), sharpness (reconstruction / real mean gradient), SSIM, and decode / encode milliseconds per
160x120 frame on one thread. --pictures writes, for the first autoencoder, a strip of held-out frames
beside their reconstructions and the status-bar crops (nearest-neighbour, 4x).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderTiny

from neuraldoom import autoencoder as AE
from neuraldoom import metrics as M
from neuraldoom import statusbar as SB
from neuraldoom.checkpoint import CheckpointError, load_model_dir
from neuraldoom.config import parse_args
from neuraldoom.recording import RecordingError, open_dataset
from training.evaluate import evaluate_autoencoder

HEADER = ("| autoencoder | PSNR | status bar PSNR | status bar read right | sharpness | SSIM | decode ms | "
          "encode ms | latent |\n|---|---|---|---|---|---|---|---|---|")


@dataclass(frozen=True)
class Args:
    data: str  # dataset folder: DATA/heldout is the evaluation set
    autoencoders: tuple[str, ...]  # autoencoder folders
    names: tuple[str, ...] = ()  # one per autoencoder (default: the folder's parent name)
    frames: int = 1024  # held-out frames, spread evenly
    pictures: str = ""  # folder for the first autoencoder's strip and status-bar crops
    threads: int = 1


def timing(ae: AutoencoderTiny, frame: np.ndarray, repeats: int = 20) -> tuple[float, float]:
    """(decode ms, encode ms) of one frame, batch 1, median of repeats."""
    z = AE.encode(ae, frame[None])
    dec, enc = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        AE.decode(ae, z, *frame.shape[:2])
        dec.append(time.perf_counter() - t)
        t = time.perf_counter()
        AE.encode(ae, frame[None])
        enc.append(time.perf_counter() - t)
    return 1000 * float(np.median(dec)), 1000 * float(np.median(enc))


def pictures(ae: AutoencoderTiny, frames: np.ndarray, out: Path, k: int = 6) -> None:
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    pick = frames[np.linspace(0, len(frames) - 1, k).astype(int)]
    rec = AE.decode(ae, AE.encode(ae, pick), *pick.shape[1:3])
    strip = np.concatenate([np.concatenate([f, r], 1) for f, r in zip(pick, rec, strict=True)], 0)
    Image.fromarray(strip).resize((strip.shape[1] * 4, strip.shape[0] * 4), Image.NEAREST).save(
        out / "reconstructions.png")  # each row: real | reconstruction
    top = M.hud_top(pick.shape[1])
    bars = np.concatenate([np.concatenate([f[top:], r[top:]], 0) for f, r in zip(pick, rec, strict=True)], 0)
    Image.fromarray(bars).resize((bars.shape[1] * 4, bars.shape[0] * 4), Image.NEAREST).save(
        out / "statusbar.png")  # pairs of rows: real status bar, then the reconstruction's


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    torch.set_num_threads(a.threads)
    names = a.names or tuple(Path(p).parent.name for p in a.autoencoders)
    if len(names) != len(a.autoencoders):
        print("compare_autoencoders: give one --names entry per autoencoder", file=sys.stderr)
        return 2
    try:
        frames, values = SB.sample_recordings(open_dataset(Path(a.data) / "heldout"), a.frames)
        models = [load_model_dir(AutoencoderTiny, p).eval() for p in a.autoencoders]
    except (RecordingError, CheckpointError, ValueError) as e:
        print(f"compare_autoencoders: {e}", file=sys.stderr)
        return 2
    print(HEADER)
    for name, ae in zip(names, models, strict=True):
        with torch.no_grad():
            r = evaluate_autoencoder(ae, frames, values)
            dec_ms, enc_ms = timing(ae, frames[len(frames) // 2])
        h, w = AE.latent_hw(ae, *frames.shape[1:3])
        print(f"| {name} | {r['psnr']:.2f} | {r['hud_psnr']:.2f} | {100 * r['statusbar_acc']:.1f}% | "
              f"{r['sharpness']:.3f} | {r['ssim']:.3f} | {dec_ms:.1f} | {enc_ms:.1f} | "
              f"{ae.config.latent_channels}×{h}×{w} |", flush=True)
    if a.pictures:
        pictures(models[0], frames, Path(a.pictures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
