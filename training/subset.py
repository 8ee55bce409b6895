"""A memorisation set: the first whole episodes of one training recording, as train/ and heldout/ both.

    python -m training.subset --data data/e1m1 --recording run-000-w00 --episodes 3 --out data/fit

`train_diffusion --data data/fit --max-frames 0` then trains on exactly those frames, and `training.evaluate
--data data/fit` scores the model on the frames it was trained on: how far the denoiser gets on data it
has seen many times separates a model that cannot fit its data from one that has not seen enough of it.
The copies are byte prefixes of the recording (frames, steps, meta), written beside OUT and renamed into
place whole, so a killed run leaves no half set.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from neuraldoom.config import parse_args
from neuraldoom.recording import Recording, RecordingError


@dataclass(frozen=True)
class Args:
    data: str  # dataset folder with train/ recordings
    recording: str  # the recording under DATA/train to cut (e.g. run-000-w00)
    out: str  # a new folder: OUT/train/RECORDING and OUT/heldout/RECORDING, the same frames
    episodes: int = 3  # how many of its first whole episodes


def make_subset(data: Path, recording: str, episodes: int, out: Path) -> int:
    """Writes the set; returns its frame count. Raises RecordingError / ValueError on bad input."""
    if episodes < 1:
        raise ValueError(f"--episodes must be at least 1, not {episodes}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give a new folder")
    rec = Recording(data / "train" / recording)
    eps = rec.episodes()
    if len(eps) < episodes:
        raise ValueError(f"{rec.path} holds {len(eps)} whole episodes, not {episodes}")
    n = eps[episodes - 1][1]
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        rec.copy_prefix(n, tmp / "train" / recording)
        shutil.copytree(tmp / "train", tmp / "heldout")  # the same frames: read the recording once
        out.mkdir(parents=True, exist_ok=True)
        for split in ("train", "heldout"):
            os.replace(tmp / split, out / split)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return n


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    try:
        n = make_subset(Path(a.data), a.recording, a.episodes, Path(a.out))
    except (RecordingError, ValueError, OSError) as e:
        print(f"subset: {e}", file=sys.stderr)
        return 2
    eps = f"{a.episodes} episode{'s' * (a.episodes > 1)}"
    print(f"subset: {n} frames ({eps} of {a.recording}) in {a.out}/train and {a.out}/heldout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
