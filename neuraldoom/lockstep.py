"""Two engines in lockstep: the real ViZDoom and the neural engine, fed the same action every tick.

Both offer `reset(seed)` / `step(action)`. A `Lockstep` owns one of each:
- `reset(seed)` starts the real episode and plays `warmup` steps in it (NOOP by default), keeping the last
  N real frames and the actions that led to them; the neural context is then filled from exactly those
  frames (`NeuralEngine.set_context` encodes them), so both engines start from the same state;
- `step(action)` steps both with the same action and measures the neural frame against the real one;
- `resync()` refills the neural context from the real game's recent frames: accumulated drift vanishes.
Never imports pygame: `sidebyside.py` draws it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import metrics as M
from .actions import NOOP, Action
from .config import game_mismatch


@dataclass(frozen=True)
class Tick:
    """One lockstep tick: both frames, the action that led to them, neural-vs-real error, engine times."""

    real: np.ndarray  # (H, W, 3) uint8
    neural: np.ndarray  # (H, W, 3) uint8
    action: Action
    psnr: float  # dB, neural vs real (identical frames: metrics' cap, ~148 dB)
    ssim: float | None
    real_ms: float
    neural_ms: float


class Lockstep:
    """A real game and a neural engine driven together. `cfg`, `done`, `variables` follow the real game."""

    def __init__(self, real: Any, neural: Any, warmup: int | None = None, measure_ssim: bool = True) -> None:
        g, c = real.cfg, neural.cfg
        why = game_mismatch(g, c)
        if why:
            raise ValueError(f"the real game {why}")
        self.real, self.neural = real, neural
        self.cfg = real.cfg
        self.n = neural.n
        self.warmup = self.n - 1 if warmup is None else max(0, warmup)  # n-1 steps: n real frames of context
        self.measure_ssim = measure_ssim
        # the real game's last N frames and the action codes that led to them (NOOP for an episode's first)
        self.history: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.n)
        self.last: Tick | None = None

    @classmethod
    def from_checkpoint(cls, path: str | Path, compile: bool = True, seed: int = 0, warmup: int | None = None,
                        guidance: float | None = None) -> Lockstep:
        """The checkpoint's neural engine beside a real game of the checkpoint's map, size and frame_skip."""
        from .checkpoint import Checkpoint
        from .engine import NeuralEngine
        from .game import RealGame

        ckpt = Checkpoint(path)
        neural = NeuralEngine(ckpt, compile=compile, guidance=guidance, seed=seed)
        real = RealGame(replace(ckpt.game, episode_timeout=0))  # collection timeouts are not for play
        return cls(real, neural, warmup)

    @property
    def done(self) -> bool:
        return bool(self.real.done)

    @property
    def variables(self) -> np.ndarray:
        return self.real.variables

    def context(self) -> tuple[np.ndarray, np.ndarray]:
        """The real game's recent frames (n', H, W, 3) and the actions (n', 2) that led to each."""
        frames, codes = zip(*self.history, strict=True)
        return np.stack(frames), np.stack(codes)

    def reset(self, seed: int | None = None, warmup_actions: Iterable[Action] | None = None) -> Tick:
        """New real episode, `warmup` steps in it (NOOP, or the given actions), neural context from them."""
        frame = self.real.reset(seed)
        self.history.clear()
        self.history.append((frame.copy(), NOOP.code))
        acts = iter(warmup_actions) if warmup_actions is not None else None
        for _ in range(self.warmup):
            a = next(acts, NOOP) if acts is not None else NOOP
            frame = self.real.step(a)
            self.history.append((frame.copy(), a.code))
        self.neural.reset(seed)  # re-seeds the sampler's noise: the same seed gives the same run
        return self.resync()

    def resync(self) -> Tick:
        """Refill the neural context from the real game's recent frames; both now show the same frame."""
        frames, codes = self.context()
        self.neural.set_context(frames, codes)
        real = frames[-1]
        self.last = Tick(real, real, NOOP if self.last is None else self.last.action, M.psnr(real, real),
                         1.0 if self.measure_ssim else None, 0.0, 0.0)
        return self.last

    def step(self, action: Action) -> Tick:
        """The same action to both engines; the neural frame measured against the real one."""
        t0 = time.perf_counter()
        real = self.real.step(action).copy()
        t1 = time.perf_counter()
        neural = self.neural.step(action)
        t2 = time.perf_counter()
        self.history.append((real, action.code))
        self.last = Tick(real, neural, action, M.psnr(neural, real),
                         M.ssim(neural, real) if self.measure_ssim else None, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
        return self.last

    def close(self) -> None:
        self.real.close()
        self.neural.close()

    def __enter__(self) -> Lockstep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
