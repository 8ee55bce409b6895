"""The `neuraldoom` command: play, inspect recordings, export them to video.

    neuraldoom play                                   # the neural engine from checkpoints/e1m1
    neuraldoom play --engine real --record sessions/s1
    neuraldoom play --engine real --headless --frames 1000 --input random   # benchmark
    neuraldoom inspect sessions/s1                    # one line of JSON
    neuraldoom export sessions/s1 s1.mp4

User errors (bad WAD, missing checkpoint, unwritable folder…) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .actions import ActionError
from .config import GameConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = "checkpoints/e1m1"  # relative to the repository root, so it works from any cwd


class UsageError(RuntimeError):
    """A user error found by the command line itself."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that mean "the user asked for something impossible", not a bug."""
    from .client import ClientError
    from .game import GameError
    from .recording import RecordingError

    errors: list[type[BaseException]] = [UsageError, ClientError, GameError, RecordingError, ActionError]
    # CheckpointError: only if its module is loaded (it imports torch; an error from it means it is loaded)
    ckpt = sys.modules.get("neuraldoom.checkpoint")
    if ckpt is not None and isinstance(getattr(ckpt, "CheckpointError", None), type):
        errors.append(ckpt.CheckpointError)
    return tuple(errors)


def _is_user_error(e: BaseException) -> bool:
    if isinstance(e, _user_errors()):
        return True
    # any other ValueError/RuntimeError subclass defined by a neuraldoom module is a user-facing error too
    return isinstance(e, (ValueError, RuntimeError)) and type(e).__module__.startswith("neuraldoom.")


def resolve_checkpoint(path: str | None) -> Path:
    if path is None:
        return REPO_ROOT / DEFAULT_CHECKPOINT
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p  # `--checkpoint checkpoints/x` from outside the repository
    return p


def make_engine(a: argparse.Namespace) -> Any:
    """The engine for `play`, imported lazily: the real game needs no torch, the neural one no ViZDoom."""
    if a.engine == "real":
        from .game import RealGame

        cfg = GameConfig()
        overrides = {k: getattr(a, k) for k in ("wad", "scenario", "map", "width", "height", "frame_skip")
                     if getattr(a, k) is not None}
        return RealGame(replace(cfg, **overrides))
    ckpt = resolve_checkpoint(a.checkpoint)
    missing = UsageError(f"no neural checkpoint at {ckpt} (train one, or use --engine real)")
    if not ckpt.is_dir():
        raise missing
    try:
        from .engine import NeuralEngine
    except ModuleNotFoundError as e:
        if e.name in ("neuraldoom.engine", "neuraldoom.checkpoint"):
            raise missing from None
        raise UsageError(f"cannot load the neural engine: {e}") from None
    return NeuralEngine.from_checkpoint(ckpt, compile=not a.no_compile)


# -- play ---------------------------------------------------------------------------------------------
def cmd_play(a: argparse.Namespace) -> int:
    from . import client

    if a.headless and a.frames is None:
        raise UsageError("--headless needs --frames N")
    if a.scale < 1:
        raise UsageError(f"--scale must be >= 1, got {a.scale}")
    if a.engine == "neural":
        given = [f"--{k.replace('_', '-')}" for k in ("wad", "scenario", "map", "width", "height", "frame_skip")
                 if getattr(a, k) is not None]
        if given:
            print(f"neuraldoom: {' '.join(given)} ignored: the neural engine plays its checkpoint's game",
                  file=sys.stderr)
    # cheap checks first: nothing starts (no engine, no compile) when the run could not go anywhere
    client.check_display(a.headless)
    client.check_record_path(a.record)
    opts = client.ClientOptions(
        engine_name=a.engine, seed=a.seed, scale=a.scale, fps=a.fps, uncapped=a.uncapped, headless=a.headless,
        frames=a.frames, input=a.input, record=a.record, sensitivity=a.sensitivity, overlay=not a.no_overlay,
    )
    engine = make_engine(a)
    try:
        stats = client.run(engine, opts)
    finally:
        engine.close()
    if a.headless or stats["quit"] == "interrupt":
        print(client.summary_line(stats))
    return 130 if stats["quit"] == "interrupt" else 0


# -- inspect / export ---------------------------------------------------------------------------------
def inspect_path(path: str | Path) -> dict[str, Any]:
    """Recording.summary() for one recording; totals for a dataset folder of recordings."""
    from .recording import Recording, RecordingError, find_recordings

    path = Path(path)
    if not path.exists():
        raise RecordingError(f"{path} does not exist")
    if (path / "meta.json").exists():
        return Recording(path).summary()
    recs = [Recording(p) for p in find_recordings(path)]
    sums = [r.summary() for r in recs]
    shared = {}
    for k in ("height", "width", "frame_skip"):
        values = sorted({s[k] for s in sums})
        if len(values) > 1:
            raise RecordingError(f"recordings in {path} differ in {k}: {values}")
        shared[k] = values[0]
    return {
        "recordings": len(recs),
        "frames": sum(s["frames"] for s in sums),
        "episodes": sum(s["episodes"] for s in sums),
        **shared,
        "maps": sorted({s["map"] for s in sums}),
        "engines": sorted({s["engine"] for s in sums}),
    }


def cmd_inspect(a: argparse.Namespace) -> int:
    print(json.dumps(inspect_path(a.path)))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from .recording import Recording

    rec = Recording(a.path)
    if len(rec) == 0:
        raise UsageError(f"{a.path} holds no frames to export")
    out = rec.export_mp4(a.out, fps=a.fps, scale=a.scale)
    print(f"neuraldoom: wrote {out} ({len(rec)} frames)")
    return 0


# -- argument parsing ---------------------------------------------------------------------------------
def add_play_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("real", "neural"), default="neural", help="what draws the frames")
    p.add_argument("--checkpoint", default=None,
                   help=f"neural checkpoint folder (default: {DEFAULT_CHECKPOINT} in the repository)")
    p.add_argument("--no-compile", action="store_true", help="neural engine: skip torch.compile (faster start)")
    p.add_argument("--seed", type=int, default=None, help="first episode's seed; each new episode takes the next")
    p.add_argument("--record", default=None, metavar="DIR", help="save the session as a recording in DIR")
    p.add_argument("--headless", action="store_true", help="no window, no pacing: run --frames steps, print timings")
    p.add_argument("--frames", type=int, default=None, help="stop after N steps")
    p.add_argument("--input", choices=("keyboard", "random"), default="keyboard",
                   help="keyboard+mouse, or sticky random play")
    p.add_argument("--scale", type=int, default=4, help="window scale (nearest neighbour)")
    p.add_argument("--fps", type=float, default=None, help="steps per second (default 35 / frame_skip)")
    p.add_argument("--uncapped", action="store_true", help="do not pace the loop")
    p.add_argument("--sensitivity", type=float, default=0.25, help="mouse: degrees of turn per pixel")
    p.add_argument("--no-overlay", action="store_true", help="start with the overlay hidden (F1 toggles)")
    g = p.add_argument_group("real engine game (GameConfig)")
    g.add_argument("--wad", default=None, help=f"default {GameConfig.wad}")
    g.add_argument("--scenario", default=None, help="a shipped scenario name or a .wad/.cfg path")
    g.add_argument("--map", default=None, help=f"default {GameConfig.map}")
    g.add_argument("--width", type=int, default=None, help=f"default {GameConfig.width}")
    g.add_argument("--height", type=int, default=None, help=f"default {GameConfig.height}")
    g.add_argument("--frame-skip", type=int, default=None, help=f"tics per step, default {GameConfig.frame_skip}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuraldoom", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    play = sub.add_parser("play", help="play through the neural (or the real) engine")
    add_play_arguments(play)
    play.set_defaults(func=cmd_play)
    ins = sub.add_parser("inspect", help="print a recording's or dataset's summary as one line of JSON")
    ins.add_argument("path")
    ins.set_defaults(func=cmd_inspect)
    exp = sub.add_parser("export", help="export a recording to MP4")
    exp.add_argument("path")
    exp.add_argument("out", help="output .mp4")
    exp.add_argument("--fps", type=float, default=None, help="default: the game's speed, 35 / frame_skip")
    exp.add_argument("--scale", type=int, default=2, help="nearest-neighbour upscale")
    exp.set_defaults(func=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return int(a.func(a))
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not _is_user_error(e):
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"neuraldoom: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
