"""Random access to recordings for training: uniform samples of frames (and frame windows) across
all recordings of a dataset, straight from the memory maps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from neuraldoom.recording import Recording, RecordingError, open_dataset


class FramePool:
    """All frames of the recordings under `path`, sampled uniformly without loading them."""

    def __init__(self, path: str | Path) -> None:
        self.recs = [r for r in open_dataset(path) if len(r)]
        if not self.recs:
            raise RecordingError(f"no frames in recordings under {path}")
        shapes = {(r.game.height, r.game.width, r.game.frame_skip) for r in self.recs}
        if len(shapes) > 1:
            raise RecordingError(f"recordings under {path} mix sizes/frame_skips: {sorted(shapes)}")
        self.height, self.width, self.frame_skip = shapes.pop()
        self.game = self.recs[0].game
        self.offsets = np.cumsum([0] + [len(r) for r in self.recs])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, i: int) -> tuple[Recording, int]:
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return self.recs[k], int(i - self.offsets[k])

    def frames(self, idx: np.ndarray) -> np.ndarray:
        """uint8 (B, H, W, 3) for global indices."""
        out = np.empty((len(idx), self.height, self.width, 3), np.uint8)
        for j, i in enumerate(idx):
            r, row = self.locate(int(i))
            out[j] = r.frames[row]
        return out

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.frames(rng.integers(0, len(self), n))

    def evenly(self, n: int) -> np.ndarray:
        """n frames spread evenly over the pool (a fixed evaluation set)."""
        return self.frames(np.linspace(0, len(self) - 1, min(n, len(self))).astype(np.int64))
