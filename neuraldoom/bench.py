"""Benchmark the play loop: where a frame's milliseconds go, eager vs compiled, with and without CFG,
and the real ViZDoom's speed, in one run (compare ratios: a shared machine is noisy).

    python -m neuraldoom.bench [--checkpoint DIR] [--frames 30] [--threads 1]

The last line is exactly: fps=<compiled 4-step CFG fps> eager_fps=<...> real_fps=<...>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import autoencoder as AE
from .actions import StickyRandomPolicy
from .checkpoint import Checkpoint, CheckpointError
from .engine import NeuralEngine

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "e1m1"


def time_engine(eng: NeuralEngine, frames: int, seed: int = 0) -> dict[str, float]:
    """Mean ms per frame: sampling (all UNet steps), decode, other (input, ring buffer, noise)."""
    policy = StickyRandomPolicy(np.random.default_rng(seed))
    eng.reset(seed)
    for _ in range(3):  # warm-up
        eng.step(policy())
    t_sample = t_decode = 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(frames):
            action = policy()
            a = time.perf_counter()
            z = eng.next_latent(action)
            b = time.perf_counter()
            AE.decode(eng.ae, z, eng.cfg.height, eng.cfg.width)
            c = time.perf_counter()
            t_sample += b - a
            t_decode += c - b
    total = (time.perf_counter() - t0) / frames * 1000
    s, d = t_sample / frames * 1000, t_decode / frames * 1000
    return {"sample_ms": s, "decode_ms": d, "other_ms": total - s - d, "total_ms": total, "fps": 1000 / total}


def real_fps(ckpt: Checkpoint, steps: int = 500) -> float:
    from .game import RealGame

    with RealGame(ckpt.game) as g:
        g.reset(0)
        policy = StickyRandomPolicy(np.random.default_rng(0))
        t0 = time.perf_counter()
        for _ in range(steps):
            g.step(policy())
            if g.done:
                g.reset(0)
        return steps / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    p.add_argument("--frames", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        ckpt = Checkpoint(a.checkpoint)
    except CheckpointError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    steps = ckpt.sampler_cfg.steps
    rows = []
    for compiled in ([False] if a.no_compile else [False, True]):
        for cfg in (ckpt.sampler_cfg.cfg, 1.0):
            t0 = time.perf_counter()
            eng = NeuralEngine(ckpt, compile=compiled, guidance=cfg, wait_compile=True)
            start = time.perf_counter() - t0
            r = time_engine(eng, a.frames)
            mode = "compiled" if eng.compiled else ("eager" if not compiled else "eager (compile failed)")
            rows.append({"mode": mode, "cfg": cfg, "start_s": start, **r})
    rfps = real_fps(ckpt)
    print(f"checkpoint {a.checkpoint}: {steps} DDIM steps, context {ckpt.denoiser_cfg.context}, "
          f"{ckpt.game.width}x{ckpt.game.height}, torch threads {a.threads}, {a.frames} frames each")
    print(f"{'mode':<12}{'CFG':>5}{'UNet steps ms':>15}{'decode ms':>11}{'other ms':>10}{'total ms':>10}"
          f"{'FPS':>7}{'start s':>9}")
    for r in rows:
        print(f"{r['mode']:<12}{r['cfg']:>5.1f}{r['sample_ms']:>15.1f}{r['decode_ms']:>11.1f}{r['other_ms']:>10.1f}"
              f"{r['total_ms']:>10.1f}{r['fps']:>7.1f}{r['start_s']:>9.1f}")
    print(f"{'real ViZDoom':<12}{'':>5}{'':>15}{'':>11}{'':>10}{1000 / rfps:>10.2f}{rfps:>7.0f}")
    guided = ckpt.sampler_cfg.cfg
    eager = next(r for r in rows if r["mode"] == "eager" and r["cfg"] == guided)
    comp = next((r for r in rows if r["mode"] != "eager" and r["cfg"] == guided), eager)
    print(f"fps={comp['fps']:.2f} eager_fps={eager['fps']:.2f} real_fps={rfps:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
