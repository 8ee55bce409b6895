"""A long free rollout of the neural engine as one picture: what a player sees after N steps of play.

    python -m training.rollout_strip --checkpoint checkpoints/e1m1 --out docs/rollout_1000.png

Starts from the checkpoint's own starting context (as `python main.py` does), plays --steps steps of
sticky-random actions (seeded: --policy sticky is the collection's policy, straight the same draws without
a turn, idle the collection's play that also stands still) and writes a strip of the frames at the --show
steps (left to right; step 0 is the last real context frame). It prints each shown frame's gradient
energy relative to that real frame (far below 1 is the melt into mush, far above 1 is noise) and the mean
colour of its view (above the status bar): a drift into a colour cast, a white or a dark screen shows there.

With --real the strip gets a second row, the real ViZDoom fed the same actions (neuraldoom.lockstep): both
start from the real game's own first 64 steps of the same policy (not the checkpoint's start), so the
picture answers what a number cannot: is the neural view what the game shows there (a wall when the player
faces a wall), and does it follow the player's turns and moves. Each shown step prints its PSNR against the
real frame; after the real episode ends (the player died) its row shows the last real frame.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from neuraldoom import actions as A
from neuraldoom import metrics as M
from neuraldoom.checkpoint import Checkpoint, CheckpointError
from neuraldoom.config import parse_args
from neuraldoom.engine import NeuralEngine
from neuraldoom.files import atomic_path
from neuraldoom.lockstep import Lockstep

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
    real: bool = False  # a second row: the real game on the same actions, both started from its own frames


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


def lockstep_play(pair: Lockstep, policy: str, seed: int, steps: int, show: tuple[int, ...]
                  ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """The neural engine and the real game on the same seeded `policy`: its first draws warm the real game
    up into the neural context, the next `steps` go to both. The (neural, real) frames at the `show` steps
    and at step 0 (the last warm-up frame, which both show)."""
    draw = A.StickyRandomPolicy(np.random.default_rng(seed), **POLICIES[policy])
    tick = pair.reset(seed, warmup_actions=(draw() for _ in range(pair.warmup)))
    neural, real = {0: tick.neural}, {0: tick.real}
    for t in range(1, steps + 1):
        tick = pair.step(draw())
        if t in show:
            neural[t], real[t] = tick.neural, tick.real
    return neural, real


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
    real: dict[int, np.ndarray] = {}
    if a.real:
        from neuraldoom.game import RealGame

        with Lockstep(RealGame(replace(eng.cfg, episode_timeout=0)), eng) as pair:
            frames, real = lockstep_play(pair, a.policy, a.seed, a.steps, a.show)
    else:
        frames = free_play(eng, a.policy, a.seed, a.steps, a.show)
    first = frames[0]
    sharp = [f"{t}: {M.sharpness(f[None], first[None]):.2f} (rgb {','.join(f'{c:.0f}' for c in view_rgb(f))}"
             + (f"; {M.psnr(f, real[t]):.1f} dB vs real" if real else "") + ")"
             for t, f in frames.items() if t]
    shown = [t for t in a.show if t in frames]
    strip = np.concatenate([frames[t] for t in shown], 1)
    if real:
        strip = np.concatenate([strip, np.concatenate([real[t] for t in shown], 1)], 0)
    from PIL import Image

    img = Image.fromarray(strip)
    if a.scale > 1:
        img = img.resize((img.width * a.scale, img.height * a.scale), Image.NEAREST)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        img.save(tmp)
    print(f"rollout_strip: steps {', '.join(str(t) for t in shown)} -> {out}"
          f"{' (top: neural, bottom: the real game)' if real else ''}; "
          f"gradient energy vs the start frame (view colour): {'; '.join(sharp)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
