"""Map coverage of a dataset: distinct grid cells visited (POSITION_X/Y in the recorded game variables).

    python -m training.coverage data/agent/recordings data/e1m1 --block 10000

For each recording (one worker's shard, in play order) the rows are cut into consecutive blocks of
--block frames; a block's coverage is the number of distinct cells (the reward's grid, 64 map units)
its positions fall in, over all its episodes. Blocks are compared at equal frame counts, so an agent
and a sticky-random collect are measured the same way; --max-frames caps each dataset's total.
Also reported: distinct cells per episode (mean), and the union over the whole dataset.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neuraldoom.config import GAME_VARIABLES, parse_args
from neuraldoom.recording import open_dataset

IX, IY = GAME_VARIABLES.index("POSITION_X"), GAME_VARIABLES.index("POSITION_Y")


def cells_of(vars_: np.ndarray, cell: float) -> np.ndarray:
    """(N, V) game variables -> (N,) int64 cell ids."""
    cx = np.floor(vars_[:, IX] / cell).astype(np.int64)
    cy = np.floor(vars_[:, IY] / cell).astype(np.int64)
    return cx * 1_000_003 + cy


def coverage(path: str | Path, block: int = 10_000, cell: float = 64.0,
             max_frames: int | None = None) -> dict[str, Any]:
    """Coverage statistics of the recordings under `path` (see the module docstring)."""
    blocks: list[int] = []
    per_episode: list[int] = []
    union: set[int] = set()
    frames = 0
    for rec in open_dataset(path):
        n = len(rec) if max_frames is None else min(len(rec), max_frames - frames)
        if n <= 0:
            break
        steps = np.asarray(rec.steps[:n])
        ids = cells_of(steps["vars"], cell)
        frames += n
        union.update(np.unique(ids).tolist())
        for s in range(0, n - block + 1, block):
            blocks.append(len(np.unique(ids[s: s + block])))
        ep = steps["episode"]
        for e in np.unique(ep):
            per_episode.append(len(np.unique(ids[ep == e])))
    return {"path": str(path), "frames": frames, "block": block, "cell": cell,
            "cells_per_block_mean": float(np.mean(blocks)) if blocks else None, "cells_per_block": blocks,
            "cells_per_episode_mean": float(np.mean(per_episode)) if per_episode else None,
            "episodes": len(per_episode), "cells_total": len(union)}


@dataclass(frozen=True)
class Args:
    data: tuple[str, ...] = field(metadata={"positional": True})  # dataset folders (recordings at or below)
    block: int = 10_000  # frames per block
    cell: float = 64.0  # grid cell size in map units
    max_frames: int = 0  # cap per dataset; 0 = the smallest dataset's size


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    cap = a.max_frames or min(sum(len(r) for r in open_dataset(d)) for d in a.data)
    results = [coverage(d, a.block, a.cell, cap) for d in a.data]
    for r in results:
        print(f"{r['path']}: {r['frames']} frames, {len(r['cells_per_block'])} blocks of {r['block']}: "
              f"{r['cells_per_block_mean']} cells/block; {r['cells_per_episode_mean']} cells/episode over "
              f"{r['episodes']} episodes; {r['cells_total']} cells in all")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
