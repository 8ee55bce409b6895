"""Pairs for fine-tuning the decoder on what play asks it to draw: the play sampler's next latent from the
real context (teacher-forced), beside the real frame it stands for.

    python -m training.decoder_pairs --checkpoint checkpoints/e1m1 --data data/e1m1 --out runs/pairs \
        --count 24000 --latents runs/lat100k --max-frames 100000
    python -m training.train_autoencoder --data data/e1m1 --out runs/decP --init-from checkpoints/e1m1/autoencoder \
        --decoder-only --pairs runs/pairs --pair-share 0.5 ...

The decoder was trained on the encoder's latents of real frames, but in play it draws the denoiser's
samples, which miss the real latent by an unstructured error about as large as Gaussian noise of std 0.3;
the decoder draws such an error as speckled grey-brown texture. Trained on these pairs it learns to draw
the real frame from the sample instead. The targets are the training recordings' frames (never held-out
ones), chosen uniformly among the cache's target rows.

Writes OUT/latents.npy (N, C, h, w) float16, OUT/frames.npy (N, H, W, 3) uint8 and OUT/meta.json (what
made them, and how many are done: a rerun of the same command continues where a killed one stopped).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from neuraldoom.checkpoint import Checkpoint, CheckpointError, weights_digest
from neuraldoom.config import parse_args
from neuraldoom.files import write_text
from neuraldoom.recording import RecordingError
from neuraldoom.sampler import DDIMSampler, FrameBounds, denoiser_pass, plan_skip
from training import latents as L
from training import trainer


@dataclass(frozen=True)
class Args:
    checkpoint: str  # the checkpoint whose sampler draws the latents (its denoiser and sampler settings)
    data: str  # dataset folder; the pairs come from its train/ recordings
    out: str  # pairs folder (continued if it holds the same command's unfinished pairs)
    count: int = 24000  # pairs to draw
    steps: int = 0  # the sampler's DDIM steps (0: the checkpoint's; a student distilled for them plays them)
    latents: str = ""  # the latent cache to read contexts from (default OUT/latents)
    max_frames: int = 0  # the first frames of the training recordings to draw targets from (0: all)
    batch: int = 32
    chunk: int = 512  # pairs written (and counted done) at a time
    seed: int = 0
    precision: str = "auto"  # auto (bf16 autocast where it is fast), fp32, bf16
    threads: int = 1


FILES = ("latents.npy", "frames.npy")


def open_pairs(path: str | Path, encoder: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(latents (N, C, h, w) float16, frames (N, H, W, 3) uint8) of a pairs folder, memory-mapped, only the
    pairs done. encoder: the digest (latents.encoder_digest) of the autoencoder that will decode them: pairs
    drawn in another encoder's latent space are refused. RecordingError (one line) for a folder without
    pairs or made for another encoder."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        z, f = (np.load(path / name, mmap_mode="r") for name in FILES)
        n, made_for = int(meta["done"]), meta["made_by"]["encoder"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecordingError(f"{path} holds no decoder pairs ({e})") from None
    if not n:
        raise RecordingError(f"{path} holds no decoder pairs yet")
    if encoder and made_for != encoder:
        raise RecordingError(f"{path}: its pairs are latents of another encoder than this autoencoder's")
    return z[:n], f[:n]


def frames_of(parts: list, rows: np.ndarray) -> np.ndarray:
    """The recorded frames (B, H, W, 3) of cache rows, given latents.portions' list of (recording, rows)."""
    ends = np.cumsum([n for _, n in parts])
    out = []
    for g in rows:
        k = int(np.searchsorted(ends, g, side="right"))
        r, _ = parts[k]
        out.append(np.asarray(r.frames[int(g - (ends[k - 1] if k else 0))]))
    return np.stack(out)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    try:
        if a.count < 1 or a.batch < 1 or a.chunk < a.batch:
            raise ValueError(f"--count and --batch must be >= 1 and --chunk >= --batch, not {a.count}, {a.batch}, "
                             f"{a.chunk}")
        acc = trainer.accelerator(a.precision)
        ck = Checkpoint(a.checkpoint)
        steps = a.steps or ck.sampler_cfg.steps
        if steps in ck.students:
            denoiser, cfg = ck.student(steps), 1.0
        else:
            denoiser, cfg = ck.denoiser, ck.sampler_cfg.cfg
        sampler = DDIMSampler(denoiser, steps, cfg, ck.sampler_cfg.deadband, FrameBounds.from_config(ck.sampler_cfg),
                              plan_skip(ck.sampler_cfg, steps, steps in ck.students)).eval()
        data = Path(a.data) / "train"
        cache = Path(a.latents) if a.latents else out / "latents"
        lat = L.build(ck.ae, data, cache / "train", a.max_frames)
        parts = L.portions(data, a.max_frames)
    except (CheckpointError, RecordingError, ValueError) as e:
        print(f"decoder_pairs: {e}", file=sys.stderr)
        return 2
    made_by = {**asdict(a), "denoiser": weights_digest(denoiser), "encoder": L.encoder_digest(ck.ae)}
    for k in ("out", "threads", "precision", "latents", "chunk"):  # what does not change the pairs
        made_by.pop(k)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    H, W = ck.game.height, ck.game.width
    if meta.get("made_by") != made_by:  # new, or another command's pairs: start over
        np.lib.format.open_memmap(out / FILES[0], "w+", np.float16, (a.count, *lat.z.shape[1:])).flush()
        np.lib.format.open_memmap(out / FILES[1], "w+", np.uint8, (a.count, H, W, 3)).flush()
        meta = {"made_by": made_by, "done": 0}
        write_text(meta_path, json.dumps(meta))
    zs = np.load(out / FILES[0], mmap_mode="r+")
    fs = np.load(out / FILES[1], mmap_mode="r+")
    done = int(meta["done"])
    # every pair's row and noise are fixed by the seed alone, so a resumed run draws the very same pairs
    rows = lat.targets[torch.from_numpy(np.random.default_rng(a.seed).integers(0, len(lat), a.count))]
    gen = torch.Generator().manual_seed(a.seed)
    noise_all = torch.randn((a.count, *lat.z.shape[1:]), generator=gen)
    denoise = denoiser_pass(denoiser)
    reads = denoiser.reads
    print(f"decoder_pairs: {done} of {a.count} pairs done, {steps}-step sampler, CFG {cfg:g}")
    while done < a.count:
        end = min(done + a.chunk, a.count)
        for i in range(done, end, a.batch):
            j = min(i + a.batch, end)
            idx = rows[i:j]
            _, ctx, codes = lat.window(idx, ck.denoiser_cfg.context, reads)
            with torch.no_grad(), acc.autocast():
                z = sampler.sample(noise_all[i:j].to(acc.device), ctx.to(acc.device), codes.to(acc.device),
                                   denoise).float().cpu()
            zs[i:j] = z.half().numpy()
            fs[i:j] = frames_of(parts, idx.numpy())
        zs.flush()
        fs.flush()
        done = end
        meta["done"] = done
        write_text(meta_path, json.dumps(meta))  # after the flush: a pair counts once it is on disk
        print(f"decoder_pairs: {done} / {a.count}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
