"""Collect play data from the real game: several headless ViZDoom processes with sticky random play.

    python -m training.collect --steps 100000 --out data/e1m1

Each worker writes its own shard under OUT/train/ and OUT/heldout/ (the split is by episode). Rerunning
with the same OUT appends new shards until OUT holds --steps frames in total, with fresh seeds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from neuraldoom.actions import StickyRandomPolicy
from neuraldoom.config import EPISODE_TICS, GameConfig, parse_args
from neuraldoom.game import GameError, RealGame
from neuraldoom.recording import Recording, RecordingError, RecordingWriter, find_recordings


def existing_frames(out: Path) -> tuple[int, int]:
    """(frames already in OUT, next run index)."""
    try:
        recs = find_recordings(out)
    except RecordingError:
        return 0, 0
    runs = {p.name.split("-")[1] for p in recs if p.name.startswith("run")}
    return sum(len(Recording(p)) for p in recs), len(runs)


def worker(cfg: GameConfig, out: str, run: int, w: int, steps: int, seed: int, repeat: float, idle: float,
           heldout: float, counter: mp.Value, parent: int) -> None:  # type: ignore[type-arg]
    die_with_parent(parent)
    rng = np.random.default_rng([seed, run, w])
    name = f"run-{run:03d}-w{w:02d}"
    writers = {s: RecordingWriter(Path(out) / s / name, cfg, engine="real",
                                  extra={"policy": "sticky_random", "repeat": repeat, "idle": idle})
               for s in ("train", "heldout")}
    done = 0
    try:
        with RealGame(cfg) as game:
            while done < steps:
                ep_seed = int(rng.integers(2**31 - 1))
                writer = writers["heldout" if rng.random() < heldout else "train"]
                policy = StickyRandomPolicy(rng, repeat, idle)
                frame = game.reset(ep_seed)
                writer.new_episode(ep_seed)
                while not game.done and done < steps:
                    action = policy()
                    vars_ = game.variables.copy()
                    writer.add(frame, action, vars_)
                    frame = game.step(action)
                    done += 1
                    if done % 64 == 0:
                        with counter.get_lock():
                            counter.value += 64
                writer.flush()
        with counter.get_lock():
            counter.value += done % 64
    finally:  # also on SIGTERM: the shards keep every step written so far
        for wr in writers.values():
            wr.close()


def die_with_parent(parent: int) -> None:
    """A worker whose collect process dies (even by SIGKILL) gets SIGTERM and ends, closing its shards,
    instead of playing on as an orphan (Linux: PR_SET_PDEATHSIG)."""
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, stop)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's normal exit still ends daemon workers
    if os.getppid() != parent:  # the parent died before prctl took effect
        raise SystemExit(1)


@dataclass(frozen=True)
class Args:
    steps: int  # total frames wanted in OUT
    out: str
    workers: int = 3  # parallel games (3-4 is best on 2 cores)
    wad: str = GameConfig.wad
    scenario: str = GameConfig.scenario
    map: str = GameConfig.map
    width: int = GameConfig.width
    height: int = GameConfig.height
    frame_skip: int = GameConfig.frame_skip
    episode_tics: int = EPISODE_TICS  # episode timeout in tics
    repeat: float = 0.8  # probability of repeating the last action
    idle: float = 0.0  # share of new actions that stand still, for ~1 s (StickyRandomPolicy)
    heldout: float = 0.1  # fraction of episodes held out
    seed: int = 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    if not 0 <= a.idle <= 1:
        print(f"collect: --idle must be within [0, 1], not {a.idle}", file=sys.stderr)
        return 2
    if a.workers < 1 or a.steps < 1:
        print(f"collect: --workers and --steps must be at least 1 (got {a.workers} and {a.steps})", file=sys.stderr)
        return 2

    cfg = replace(GameConfig(), wad=a.wad, scenario=a.scenario, map=a.map, width=a.width, height=a.height,
                  frame_skip=a.frame_skip, episode_timeout=a.episode_tics)
    out = Path(a.out)
    try:
        RealGame(cfg).close()  # fail fast, in this process, on a bad WAD/map/resolution
        have, run = existing_frames(out)
    except (GameError, RecordingError) as e:
        print(f"collect: {e}", file=sys.stderr)
        return 2
    todo = a.steps - have
    if todo <= 0:
        print(f"collect: {out} already holds {have} frames (>= {a.steps})")
        return 0
    counter = mp.Value("q", 0)
    per = [todo // a.workers + (i < todo % a.workers) for i in range(a.workers)]
    procs = [mp.Process(target=worker, args=(cfg, str(out), run, w, n, a.seed, a.repeat, a.idle, a.heldout, counter,
                                             os.getpid()), daemon=True) for w, n in enumerate(per) if n > 0]
    t0 = time.time()
    for pr in procs:
        pr.start()
    with tqdm(total=todo, unit="step", desc=f"collect x{len(procs)}") as bar:
        while any(pr.is_alive() for pr in procs):
            time.sleep(0.5)
            bar.n = counter.value
            bar.refresh()
        bar.n = counter.value
        bar.refresh()
    failed = [pr.exitcode for pr in procs if pr.exitcode != 0]
    dt = time.time() - t0
    print(f"collect: {counter.value} steps in {dt:.1f}s = {counter.value / dt:.0f} steps/s "
          f"with {len(procs)} games; {have + counter.value} frames in {out}")
    if failed:
        print(f"collect: {len(failed)} worker(s) failed (exit codes {failed}); rerun to top up", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
