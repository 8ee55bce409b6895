"""One recording format for agent data, human sessions and evaluation sets (docs/DESIGN.md §6).

A recording is a folder:
  meta.json    GameConfig, button set, game-variable names, engine, written once at the start
  frames.u8    raw uint8 frames, (N, H, W, 3), append-only
  steps.bin    one fixed-size record per frame (STEP_DTYPE), append-only

Row t holds frame t and the action taken after seeing it, so frame t+1 of the same episode is the
result of action t. Both files are appended and flushed every `flush_every` steps and at episode ends;
the reader takes the rows both files hold whole, so a writer killed with SIGKILL leaves a recording
readable up to its last flush. Reading is memory-mapped: nothing is loaded into RAM up front.
A dataset is any folder holding recordings (sharded by collect worker, split train/heldout).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from . import actions as A
from .config import GAME_VARIABLES, TICS_PER_SECOND, GameConfig, from_dict, to_dict

FORMAT_VERSION = 1
STEP_DTYPE = np.dtype(
    [
        ("episode", "<i4"),  # episode index within this recording
        ("t", "<i4"),  # step within the episode
        ("seed", "<i8"),  # the episode's game seed (-1: unknown), so it can be replayed
        ("buttons", "u1"),
        ("turn", "u1"),
        ("reward", "<f4"),
        ("vars", "<f4", (len(GAME_VARIABLES),)),
    ]
)


class RecordingError(ValueError):
    """A recording that is missing, corrupt, or does not fit what is asked of it."""


class RecordingWriter:
    """Append frames and actions; flushed often so a killed process loses at most one chunk."""

    def __init__(self, path: str | Path, game: GameConfig, engine: str = "real",
                 flush_every: int = 32, extra: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if (self.path / "meta.json").exists():
                raise RecordingError(f"{self.path} already holds a recording; choose a new folder")
            meta = {
                "format_version": FORMAT_VERSION,
                "game": to_dict(game),
                "engine": engine,
                "buttons": list(A.BUTTONS),
                "turn_buckets": list(A.TURN_BUCKETS),
                "game_variables": list(GAME_VARIABLES),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                **(extra or {}),
            }
            tmp = self.path / "meta.json.tmp"
            tmp.write_text(json.dumps(meta, indent=2))
            os.replace(tmp, self.path / "meta.json")
            self._frames = open(self.path / "frames.u8", "ab")
            self._steps = open(self.path / "steps.bin", "ab")
        except OSError as e:
            raise RecordingError(f"cannot write a recording to {self.path}: {e.strerror}") from None
        self.shape = (game.height, game.width, 3)
        self.flush_every = flush_every
        self.n = 0
        self.episode = -1
        self.t = 0
        self._pending = 0

    def new_episode(self, seed: int | None) -> None:
        self.flush()
        self.episode += 1
        self.t = 0
        self.seed = -1 if seed is None else int(seed)

    def add(self, frame: np.ndarray, action: A.Action, variables: np.ndarray | None = None,
            reward: float = 0.0) -> None:
        """Frame t and the action taken after it."""
        if self.episode < 0:
            self.new_episode(None)
        if frame.shape != self.shape or frame.dtype != np.uint8:
            raise RecordingError(f"frame {frame.shape} {frame.dtype} does not match {self.shape} uint8")
        rec = np.zeros((), STEP_DTYPE)
        rec["episode"], rec["t"], rec["seed"] = self.episode, self.t, self.seed
        rec["buttons"], rec["turn"], rec["reward"] = action.buttons, action.turn, reward
        if variables is not None:
            rec["vars"] = variables
        self._frames.write(np.ascontiguousarray(frame).tobytes())
        self._steps.write(rec.tobytes())
        self.n += 1
        self.t += 1
        self._pending += 1
        if self._pending >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        # frames first: a row counts only once its step record is there too
        self._frames.flush()
        self._steps.flush()
        self._pending = 0

    def close(self) -> None:
        if not self._frames.closed:
            self.flush()
            self._frames.close()
            self._steps.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Recording:
    """A recording opened lazily: `frames` and `steps` are memory maps."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.meta = json.loads((self.path / "meta.json").read_text())
            self.game = from_dict(GameConfig, self.meta["game"])
        except FileNotFoundError:
            raise RecordingError(f"{self.path} is not a recording (no meta.json)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise RecordingError(f"{self.path}/meta.json is corrupt: {e}") from None
        if self.meta.get("buttons") != list(A.BUTTONS) or self.meta.get("turn_buckets") != list(A.TURN_BUCKETS):
            raise RecordingError(f"{self.path} uses another action set: {self.meta.get('buttons')}")
        H, W = self.game.height, self.game.width
        fbytes = H * W * 3
        try:
            nf = (self.path / "frames.u8").stat().st_size // fbytes
            ns = (self.path / "steps.bin").stat().st_size // STEP_DTYPE.itemsize
        except FileNotFoundError as e:
            raise RecordingError(f"{self.path} is incomplete: {Path(e.filename).name} is missing") from None
        self.n = min(nf, ns)  # a truncated tail (killed writer) is ignored
        if self.n == 0:
            self.frames = np.zeros((0, H, W, 3), np.uint8)
            self.steps = np.zeros(0, STEP_DTYPE)
        else:
            self.frames = np.memmap(self.path / "frames.u8", np.uint8, "r", shape=(self.n, H, W, 3))
            self.steps = np.memmap(self.path / "steps.bin", STEP_DTYPE, "r", shape=(self.n,))

    def __len__(self) -> int:
        return self.n

    @property
    def actions(self) -> np.ndarray:
        """(N, 2) int64 action codes [buttons, turn]."""
        return np.stack([self.steps["buttons"], self.steps["turn"]], -1).astype(np.int64)

    def episodes(self) -> list[tuple[int, int]]:
        """[start, end) row ranges, one per episode."""
        if self.n == 0:
            return []
        ep = np.asarray(self.steps["episode"])
        cuts = np.flatnonzero(np.diff(ep)) + 1
        bounds = [0, *cuts.tolist(), self.n]
        return list(zip(bounds[:-1], bounds[1:], strict=False))

    def copy_prefix(self, n: int, dst: str | Path) -> Recording:
        """The first n rows as a new recording at `dst` (a new folder): same meta, byte prefixes of the data."""
        dst = Path(dst)
        dst.mkdir(parents=True)
        shutil.copyfile(self.path / "meta.json", dst / "meta.json")
        self.frames[:n].tofile(dst / "frames.u8")
        self.steps[:n].tofile(dst / "steps.bin")
        return Recording(dst)

    def summary(self) -> dict[str, Any]:
        return {
            "frames": self.n,
            "episodes": len(self.episodes()),
            "height": self.game.height,
            "width": self.game.width,
            "frame_skip": self.game.frame_skip,
            "map": self.game.map,
            "wad": self.game.wad,
            "scenario": self.game.scenario,
            "engine": self.meta.get("engine", "real"),
            "seeds": sorted({int(s) for s in np.unique(self.steps["seed"])}) if self.n else [],
        }

    def export_mp4(self, out: str | Path, fps: float | None = None, scale: int = 2) -> Path:
        """Write the frames to an H.264 MP4 (imageio-ffmpeg), nearest-neighbour upscaled."""
        target = Path(out).absolute()
        if target.parent.resolve() == self.path.resolve() and target.name in RECORDING_FILES:
            raise RecordingError(f"cannot write a video to {target}: it is part of the recording")
        return write_mp4(out, (f for f in self.frames), fps or TICS_PER_SECOND / self.game.frame_skip, scale)


RECORDING_FILES = ("meta.json", "frames.u8", "steps.bin")


def unwritable(path: str | Path, folder: bool = True) -> str | None:
    """Why `path` (a folder to write into, or with folder=False a file to write) cannot be written, or None.

    Creates nothing. Only a first check, before anything starts: root ignores permissions, so writers still
    turn OSError into a one-line error.
    """
    p = Path(path).absolute()
    if p.exists():
        if folder != p.is_dir():
            return "it is a file, not a folder" if folder else "it is a folder"
        if not os.access(p, os.W_OK | (os.X_OK if folder else 0)):
            return "folder is not writable" if folder else "file is not writable"
        return None
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def write_mp4(out: str | Path, frames: Iterator[np.ndarray], fps: float, scale: int = 2) -> Path:
    """Encode `frames` to `out`. Written to a hidden file beside it first, so a failed or interrupted run
    leaves an existing `out` as it was; every failure to write is a RecordingError."""
    import imageio_ffmpeg

    out = Path(out)
    why = unwritable(out, folder=False)
    if why:
        raise RecordingError(f"cannot write a video to {out}: {why}")
    tmp = out.with_name(f".{out.stem}.partial{out.suffix or '.mp4'}")  # ffmpeg picks the format by suffix

    def failed(e: OSError) -> RecordingError:
        why = e.strerror or "ffmpeg stopped (a format it does not know from the name, or a full disk?)"
        return RecordingError(f"cannot write a video to {out}: {why}")

    writer = None
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.open("wb").close()  # ffmpeg would only say so on stderr, and carry on
        except OSError as e:
            raise failed(e) from None
        for f in frames:
            f = np.asarray(f)
            if scale > 1:
                f = f.repeat(scale, 0).repeat(scale, 1)
            try:
                if writer is None:
                    writer = imageio_ffmpeg.write_frames(str(tmp), (f.shape[1], f.shape[0]), fps=fps,
                                                         macro_block_size=1, quality=8, ffmpeg_log_level="quiet")
                    writer.send(None)
                writer.send(np.ascontiguousarray(f))
            except OSError as e:
                raise failed(e) from None
        if writer is None:
            raise RecordingError(f"no frames to write to {out}")
        try:
            writer.close()
            if tmp.stat().st_size == 0:
                raise RecordingError(f"cannot write a video to {out}: ffmpeg wrote nothing")
            os.replace(tmp, out)
        except OSError as e:
            raise failed(e) from None
    finally:
        if writer is not None:
            writer.close()
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return out


def find_recordings(path: str | Path) -> list[Path]:
    """Recording folders at or below `path`, sorted."""
    path = Path(path)
    if (path / "meta.json").exists():
        return [path]
    found = sorted(p.parent for p in path.rglob("meta.json"))
    if not found:
        raise RecordingError(f"no recordings found in {path}")
    return found


def open_dataset(path: str | Path) -> list[Recording]:
    return [Recording(p) for p in find_recordings(path)]
