"""What a denoiser knows, teacher-forced on held-out play: the questions behind a blurry or noisy frame.

    python -m training.probe --checkpoint checkpoints/e1m1 --data data/e1m1 --out runs/probe

For held-out targets with their real context it prints, and writes to OUT/probe.json, each row's latent MSE
(against the real frame's latent), PSNR and sharpness (against the real frames):
- copy-last, the baseline every next-frame model must beat;
- the sampler's frame at noise temperatures (1 = play's sampler; 0 = its deterministic path): where the
  model is unsure, a sample draws a guess (noise by eye) and a colder one the average (blur);
- the sampler's later steps started from the real next frame noised to their level (the plan's t): how
  much of the picture the first step, from the context alone, loses and how much the steps after it;
- the model's one-pass mean (x0 from pure noise at the first timestep): what it knows with no guessing;
- the same mean with the current action, then all the actions, taken from other targets: how much the
  actions are used (equal rows: ignored).
OUT/probe.png: rows of last context frame | real next | sample (temperature 1) | one-pass mean.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from neuraldoom import actions as A
from neuraldoom import autoencoder as AE
from neuraldoom import metrics as M
from neuraldoom.checkpoint import Checkpoint, CheckpointError
from neuraldoom.config import parse_args
from neuraldoom.files import atomic_path, write_text
from neuraldoom.recording import Recording, RecordingError, find_recordings
from neuraldoom.replay import check_compatible
from neuraldoom.sampler import DDIMSampler
from training.evaluate import history


@dataclass(frozen=True)
class Args:
    checkpoint: str
    data: str  # dataset folder: DATA/heldout is probed
    out: str
    samples: int = 48  # teacher-forced targets
    seed: int = 0
    temperatures: tuple[float, ...] = (1.0, 0.7, 0.4, 0.0)
    guidance: float = 1.0  # CFG weight of the sampler rows
    threads: int = 1


def contexts(ckpt: Checkpoint, picks: list[tuple[Recording, int]]) -> tuple[torch.Tensor, ...]:
    """Latent context (B, N, C, h, w), action codes (B, N+1, 2) and the real next latents for (recording,
    row) targets, padded before an episode's start as the engine pads (first frame, NOOP actions)."""
    n = ckpt.denoiser.context
    ctxs, codes, nxt = [], [], []
    for r, i in picks:
        frames, acts = history(r, i, n)
        frames = np.concatenate([np.repeat(frames[:1], n - len(frames), 0), frames])
        acts = np.concatenate([np.repeat(A.NOOP.code[None], n - len(acts), 0), acts, r.actions[i - 1][None]])
        reads = ckpt.denoiser.reads  # only the frames the UNet reads are encoded; the rest repeat the oldest
        z = AE.encode(ckpt.ae, frames[-reads:])
        ctxs.append(torch.cat([z[:1].expand(n - reads, -1, -1, -1), z]))
        codes.append(torch.as_tensor(acts, dtype=torch.long))
        nxt.append(np.asarray(r.frames[i]))
    real = np.stack(nxt)
    return torch.stack(ctxs), torch.stack(codes), AE.encode(ckpt.ae, real), torch.from_numpy(real)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    torch.set_num_threads(a.threads)
    try:
        ckpt = Checkpoint(a.checkpoint)
        recs = [r for r in (Recording(p) for p in find_recordings(Path(a.data) / "heldout")) if len(r)]
        if not recs:
            raise RecordingError(f"no held-out recordings in {a.data}/heldout")
        for r in recs:
            check_compatible(r, ckpt.game)
    except (CheckpointError, RecordingError) as e:
        print(f"probe: {e}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(a.seed)
    targets = [(r, i) for r in recs for s, e in r.episodes() for i in range(s + 1, e)]
    picks = [targets[k] for k in rng.choice(len(targets), min(a.samples, len(targets)), replace=False)]
    den = ckpt.denoiser.eval()
    ctx, codes, z_real, real_t = contexts(ckpt, picks)
    real = real_t.numpy()
    H, W = real.shape[1:3]
    last = ctx[:, -1]
    g = torch.Generator().manual_seed(a.seed)
    noise = torch.randn(z_real.shape, generator=g)
    rows: dict[str, torch.Tensor] = {"copy-last": last}
    sampler = DDIMSampler(den, ckpt.sampler_cfg.steps, a.guidance)  # the teacher's DDIM (not a student)
    t0, a0, _ = sampler.plan[0]
    bucket = torch.zeros(len(ctx), dtype=torch.long)
    with torch.no_grad():
        for temp in a.temperatures:
            rows[f"sample, temperature {temp:g}"] = sampler(noise * temp, ctx, codes)

        def mean(c: torch.Tensor) -> torch.Tensor:
            v = den(noise, torch.full((len(ctx),), t0), ctx, c, bucket)
            return den.from_target(a0**0.5 * noise - (1 - a0) ** 0.5 * v, den.reference(ctx, c))

        # the sampler's later steps started from the real next frame noised to their level: which step of
        # the plan loses the picture (the layout at the first, from context alone, or the detail after it)
        x_real = den.to_target(z_real, den.reference(ctx, codes))
        tail = DDIMSampler(den, ckpt.sampler_cfg.steps, a.guidance)
        for k in range(1, len(sampler.plan)):
            tail.plan = sampler.plan[k:]
            t, at, _ = tail.plan[0]
            rows[f"steps {k + 1}-{len(sampler.plan)} from the real frame at t={t}"] = tail(
                at**0.5 * x_real + (1 - at) ** 0.5 * noise, ctx, codes)
        roll = torch.roll(torch.arange(len(ctx)), 1)
        swapped = codes.clone()
        swapped[:, -1] = codes[roll, -1]
        rows["one-pass mean"] = mean(codes)
        rows["one-pass mean, current action of another target"] = mean(swapped)
        rows["one-pass mean, all actions of another target"] = mean(codes[roll])
    report, frames = {}, {}
    for name, z in rows.items():
        shown = AE.decode(ckpt.ae, z, H, W)
        report[name] = {"latent_mse": float((z - z_real).pow(2).mean()), "psnr": M.psnr(shown, real),
                        "sharpness": M.sharpness(shown, real)}
        frames[name] = shown
    print(f"probe: {len(real)} held-out targets, {a.checkpoint}")
    print(f"{'':52s} {'latent MSE':>10s} {'PSNR':>6s} {'sharp':>6s}")
    for name, m in report.items():
        print(f"{name:52s} {m['latent_mse']:10.4f} {m['psnr']:6.2f} {m['sharpness']:6.3f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "probe.json", json.dumps({"checkpoint": a.checkpoint, "samples": len(real),
                                               "guidance": a.guidance, "rows": report}, indent=1))
    k = min(6, len(real))
    prev = np.stack([np.asarray(r.frames[i - 1]) for r, i in picks[:k]])
    first = next(n for n in rows if n.startswith("sample"))
    grid = np.concatenate([np.concatenate([prev[j], real[j], frames[first][j], frames["one-pass mean"][j]], 1)
                           for j in range(k)], 0)
    with atomic_path(out / "probe.png") as tmp:
        Image.fromarray(grid).save(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
