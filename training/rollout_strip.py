"""A long free rollout of the neural engine as one picture: what a player sees after N steps of play.

    python -m training.rollout_strip --checkpoint checkpoints/e1m1 --out docs/rollout_1000.png

Starts from the checkpoint's own starting context (as `python main.py` does), plays --steps steps of
sticky-random actions (seeded: --policy sticky is the collection's policy, straight the same draws without
a turn, idle the collection's play that also stands still) and writes a strip of the frames at the --show
steps (left to right; step 0 is the last real context frame). It prints each shown frame's gradient
energy relative to that real frame (far below 1 is the melt into mush, far above 1 is noise) and the mean
colour of its view (above the status bar): a drift into a colour cast, a white or a dark screen shows there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from neuraldoom import actions as A
from neuraldoom import metrics as M
from neuraldoom.checkpoint import Checkpoint, CheckpointError
from neuraldoom.config import parse_args
from neuraldoom.engine import NeuralEngine

POLICIES = {"sticky": {}, "straight": {"turns": False}, "idle": {"idle": 0.15}}


@dataclass(frozen=True)
class Args:
    checkpoint: str
    out: str  # a .png path
    steps: int = 1000
    show: tuple[int, ...] = (0, 10, 25, 50, 100, 250, 500, 1000)  # the steps shown (0 = the last context frame)
    seed: int = 0
    policy: str = "sticky"  # sticky | straight | idle
    scale: int = 1
    compile: bool = False
    threads: int = 1


def view_rgb(frame: np.ndarray) -> np.ndarray:
    """(3,) the mean colour of a frame's view (above the status bar)."""
    return frame[:M.hud_top(frame.shape[0])].reshape(-1, 3).mean(0)


def colour_cast(frame: np.ndarray) -> float:
    """How far the view's mean colour is from grey (its largest channel minus its smallest): DOOM's
    damage tint grown over a whole view, the red drift of long free play, reads 40-90; E1M1's held-out views
    read 6 at the median, 95% of them under 20."""
    rgb = view_rgb(frame)
    return float(rgb.max() - rgb.min())


def free_play(eng: NeuralEngine, policy: str, seed: int, steps: int, show: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Free play from the checkpoint's own start: `steps` steps of the seeded `policy` (a POLICIES key);
    the frames at the `show` steps, in order, and always step 0 (the last real context frame)."""
    draw = A.StickyRandomPolicy(np.random.default_rng(seed), **POLICIES[policy])
    frames = {0: eng.reset(seed)}
    for t in range(1, steps + 1):
        f = eng.step(draw())
        if t in show:
            frames[t] = f
    return frames


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    if a.policy not in POLICIES:
        print(f"rollout_strip: --policy must be one of {', '.join(POLICIES)}, got {a.policy!r}", file=sys.stderr)
        return 2
    try:
        eng = NeuralEngine(Checkpoint(a.checkpoint), compile=a.compile, seed=a.seed, wait_compile=True)
    except CheckpointError as e:
        print(f"rollout_strip: {e}", file=sys.stderr)
        return 2
    frames = free_play(eng, a.policy, a.seed, a.steps, a.show)
    first = frames[0]
    sharp = [f"{t}: {M.sharpness(f[None], first[None]):.2f} (rgb {','.join(f'{c:.0f}' for c in view_rgb(f))})"
             for t, f in frames.items() if t]
    strip = np.concatenate([frames[t] for t in a.show if t in frames], 1)
    from PIL import Image

    img = Image.fromarray(strip)
    if a.scale > 1:
        img = img.resize((img.width * a.scale, img.height * a.scale), Image.NEAREST)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    img.save(tmp)
    tmp.replace(out)
    print(f"rollout_strip: steps {', '.join(str(t) for t in a.show if t in frames)} -> {out}; "
          f"gradient energy vs the start frame (view colour): {'; '.join(sharp)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
