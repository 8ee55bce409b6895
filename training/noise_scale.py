"""How much of a training sample's gradient is signal: the gradient noise scale of the denoiser's loss.

    python -m training.noise_scale --checkpoint checkpoints/e1m1 --data data/e1m1 --samples 1024

For single-sample gradients g_i of the training loss (clean reference, the whole schedule, no dropout)
it prints, over all noise levels and in four bands of t, the mean energy E|g|^2, the noise tr(Sigma), the
signal |G|^2 (unbiased) and their ratio B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training"): batches far below B_simple learn the same per sample whatever their size, and
the band energies are what `train_diffusion --timesteps importance` draws by. Streams the sums, so memory
stays at a few gradients whatever --samples.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from neuraldoom.checkpoint import Checkpoint, CheckpointError
from neuraldoom.config import parse_args
from neuraldoom.recording import RecordingError
from training import latents as L
from training.train_diffusion import diffusion_loss, noise_schedule


@dataclass(frozen=True)
class Args:
    checkpoint: str  # the denoiser to measure
    data: str  # dataset folder: its train/ recordings
    samples: int = 1024  # single-sample gradients
    max_frames: int = 100000  # frames of DATA/train to encode (cached under --cache)
    cache: str = "runs/noise-scale-latents"  # latent cache (a train_diffusion run's OUT/latents/train works too)
    bands: int = 4
    seed: int = 0
    threads: int = 1


def noise_scale(ck: Checkpoint, data: L.LatentSet, samples: int, bands: int, seed: int) -> list[dict[str, float]]:
    """One row per band of t (the last row: all of t): n, energy, noise, signal, b_simple."""
    model, cfg = ck.denoiser.train(), ck.denoiser_cfg
    T = cfg.num_train_timesteps
    sched = noise_schedule(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    idx = data.targets[torch.randint(0, len(data), (samples,), generator=gen)]
    edges = [(T * b // bands, T * (b + 1) // bands) for b in range(bands)] + [(0, T)]
    sums: list[list] = [[0, 0.0, None] for _ in edges]  # n, sum |g|^2, sum g
    for i in range(samples):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        t = int(torch.randint(0, T, (1,), generator=g))
        batch = data.window(idx[i:i + 1], cfg.context, model.reads)
        loss = diffusion_loss(model, sched, batch, cfg, 0.0, g, torch.device("cpu"), "clean", levels=torch.tensor([t]))
        v = torch.cat([x.flatten() for x in torch.autograd.grad(loss, params)]).double()
        for (lo, hi), s in zip(edges, sums, strict=True):
            if lo <= t < hi:
                s[0] += 1
                s[1] += float(v @ v)
                s[2] = v.clone() if s[2] is None else s[2] + v
    rows = []
    for (lo, hi), (n, sq, sm) in zip(edges, sums, strict=True):
        if n < 2:
            raise ValueError(f"t in [{lo}, {hi}) drew {n} samples: give more --samples")
        mean = sm / n
        noise = (sq / n - float(mean @ mean)) * n / (n - 1)
        signal = float(mean @ mean) - noise / n
        rows.append({"lo": lo, "hi": hi, "n": n, "energy": sq / n, "noise": noise, "signal": signal,
                     "b_simple": noise / signal if signal > 0 else float("inf")})
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    torch.set_num_threads(a.threads)
    try:
        ck = Checkpoint(a.checkpoint)
        data = L.build(ck.ae, Path(a.data) / "train", Path(a.cache), a.max_frames)
        rows = noise_scale(ck, data, a.samples, a.bands, a.seed)
    except (CheckpointError, RecordingError, ValueError, OSError) as e:
        print(f"noise_scale: {e}", file=sys.stderr)
        return 2
    print(f"{'t':>12} {'n':>6} {'E|g|^2':>10} {'tr(Sigma)':>10} {'|G|^2':>10} {'B_simple':>9}")
    for r in rows:
        b = "inf (signal under noise)" if r["b_simple"] == float("inf") else f"{r['b_simple']:.0f}"
        print(f"{r['lo']:>5}-{r['hi'] - 1:<6} {r['n']:>6} {r['energy']:>10.4g} {r['noise']:>10.4g} "
              f"{r['signal']:>10.4g} {b:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
