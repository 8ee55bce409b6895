"""The `neuraldoom` command: play, inspect recordings, export them to video.

    neuraldoom play                                   # the neural engine from checkpoints/e1m1
    neuraldoom play --engine real --record sessions/s1
    neuraldoom play --engine real --headless --frames 1000 --input random   # benchmark
    neuraldoom play --side-by-side                    # real ViZDoom | neural engine, same actions, live PSNR
    neuraldoom inspect sessions/s1                    # one line of JSON
    neuraldoom export sessions/s1 s1.mp4
    neuraldoom replay sessions/s1 --engine both --out runs/s1   # MP4 + PSNR plot + JSON
    neuraldoom abtest --clips 20 --seconds 1.6        # blind A/B test: which clip is the real game?

User errors (bad WAD, missing checkpoint, unwritable folder…) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from .actions import ActionError
from .config import DEFAULT_CHECKPOINT, MOUSE_SENSITIVITY, WINDOW_SCALE, GameConfig, resolve_checkpoint


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
    return NeuralEngine.from_checkpoint(ckpt, compile=not a.no_compile, cores=a.cores, dtype=a.dtype,
                                        steps=a.steps, guidance=a.guidance, teacher=a.teacher, parallel="auto")


# -- play ---------------------------------------------------------------------------------------------
def cmd_play(a: argparse.Namespace) -> int:
    from . import client

    if a.headless and a.frames is None:
        raise UsageError("--headless needs --frames N")
    if a.scale < 1:
        raise UsageError(f"--scale must be >= 1, got {a.scale}")
    if a.cores is not None and a.cores < 1:
        raise UsageError(f"--cores must be >= 1, got {a.cores}")
    if a.steps is not None and not 1 <= a.steps <= 1000:
        raise UsageError(f"--steps must be between 1 and 1000, got {a.steps}")
    if a.guidance is not None and a.guidance <= 0:
        raise UsageError(f"--guidance must be > 0, got {a.guidance}")
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
    if getattr(a, "side_by_side", False):
        return _play_side_by_side(a, opts)
    return _play(make_engine(a), client.run, client.summary_line, opts)


def _play(source: Any, run: Callable[[Any, Any], dict], summary_line: Callable[[dict], str], opts: Any) -> int:
    """Play `source` (an engine, or the lockstep pair) through its window loop `run`, close it whatever
    happens, and end as every play ends: the summary line when headless or interrupted, 130 on Ctrl-C."""
    try:
        stats = run(source, opts)
    finally:
        source.close()
    if opts.headless or stats["quit"] == "interrupt":
        print(summary_line(stats))
    return 130 if stats["quit"] == "interrupt" else 0


def _neural_checkpoint(a: argparse.Namespace) -> Path:
    """The checkpoint folder for commands that need the neural engine, or a one-line error."""
    ckpt = resolve_checkpoint(a.checkpoint)
    if not ckpt.is_dir():
        raise UsageError(f"no neural checkpoint at {ckpt} (train one, or pass --checkpoint)")
    return ckpt


def _play_side_by_side(a: argparse.Namespace, opts: Any) -> int:
    """`play --side-by-side`: the real game and the neural engine in lockstep, in one window."""
    from . import sidebyside
    from .lockstep import Lockstep

    ckpt = _neural_checkpoint(a)
    given = [f"--{k.replace('_', '-')}" for k in ("wad", "scenario", "map", "width", "height", "frame_skip")
             if getattr(a, k) is not None]
    if given:
        print(f"neuraldoom: {' '.join(given)} ignored: side by side plays the checkpoint's game", file=sys.stderr)
    pair = Lockstep.from_checkpoint(ckpt, compile=not a.no_compile, seed=a.seed or 0)
    return _play(pair, sidebyside.run, sidebyside.summary_line, opts)


# -- replay / abtest ----------------------------------------------------------------------------------
def cmd_replay(a: argparse.Namespace) -> int:
    from . import replay

    if not Path(a.recording).exists():
        raise UsageError(f"{a.recording} does not exist")
    ckpt = _neural_checkpoint(a) if a.engine != "real" else None
    rep = replay.run_replay(a.recording, a.engine, ckpt, a.out, compile=not a.no_compile, warmup=a.warmup,
                            resync_every=a.resync_every, seed=a.seed, measure_ssim=not a.no_ssim)
    print(replay.summary_line(rep))
    return 0


def cmd_abtest(a: argparse.Namespace) -> int:
    from . import abtest

    ckpt = _neural_checkpoint(a)
    if a.recording is not None and not Path(a.recording).exists():
        raise UsageError(f"{a.recording} does not exist")
    s = abtest.run_abtest(ckpt, clips=a.clips, seconds=a.seconds, answers=a.answers, auto=a.auto,
                          compile=not a.no_compile, seed=a.seed, scale=a.scale, recording=a.recording,
                          headless=a.headless)
    print(abtest.summary_line(s))
    return 0


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
    p.add_argument("--threads", type=int, default=1,
                   help="neural engine: torch threads (see docs/DESIGN.md §4); with 2+ cores, at most half of them")
    p.add_argument("--cores", type=int, default=None,
                   help="neural engine: cores to use (default: all this process may use; 2+ run the two UNet "
                        "passes of each guided step at once, with the same frames; 1: one after the other)")
    p.add_argument("--steps", type=int, default=None,
                   help="neural engine: DDIM steps (default: the checkpoint's, 4); where the checkpoint carries a "
                        "student distilled for N steps it plays, one UNet pass a step")
    p.add_argument("--guidance", type=float, default=None,
                   help="neural engine: play the teacher with this classifier-free guidance weight "
                        "(default: the checkpoint's, 1.5, or a distilled student's folded-in guidance)")
    p.add_argument("--teacher", action="store_true",
                   help="neural engine: the teacher with guidance even where a distilled student is carried")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="neural engine: the UNet's dtype (auto: bfloat16 where the CPU has it natively)")
    p.add_argument("--seed", type=int, default=None, help="first episode's seed; each new episode takes the next")
    p.add_argument("--record", default=None, metavar="DIR", help="save the session as a recording in DIR")
    p.add_argument("--headless", action="store_true", help="no window, no pacing: run --frames steps, print timings")
    p.add_argument("--frames", type=int, default=None, help="stop after N steps")
    p.add_argument("--input", choices=("keyboard", "random"), default="keyboard",
                   help="keyboard+mouse, or sticky random play")
    p.add_argument("--scale", type=int, default=WINDOW_SCALE, help="window scale (nearest neighbour)")
    p.add_argument("--fps", type=float, default=None, help="steps per second (default 35 / frame_skip)")
    p.add_argument("--uncapped", action="store_true", help="do not pace the loop")
    p.add_argument("--sensitivity", type=float, default=MOUSE_SENSITIVITY, help="mouse: degrees of turn per pixel")
    p.add_argument("--no-overlay", action="store_true", help="start with the overlay hidden (F1 toggles)")
    p.add_argument("--side-by-side", action="store_true",
                   help="real ViZDoom | neural engine in one window, the same actions to both (--engine ignored); "
                        "R re-sync, L layout, N single step")
    g = p.add_argument_group("real engine game (GameConfig)")
    g.add_argument("--wad", default=None, help=f"default {GameConfig.wad}")
    g.add_argument("--scenario", default=None, help="a shipped scenario name or a .wad path")
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
    rep = sub.add_parser("replay", help="replay a recording's actions through the real game, the neural engine "
                                        "or both; with --out: MP4, PSNR plot and JSON")
    rep.add_argument("recording")
    rep.add_argument("--engine", choices=("real", "neural", "both"), default="both")
    rep.add_argument("--out", default=None, metavar="DIR", help="write DIR/replay.mp4, DIR/psnr.png, DIR/replay.json")
    rep.add_argument("--checkpoint", default=None,
                     help=f"neural checkpoint folder (default: {DEFAULT_CHECKPOINT} in the repository)")
    rep.add_argument("--no-compile", action="store_true", help="neural engine: skip torch.compile (faster start)")
    rep.add_argument("--threads", type=int, default=1, help="neural engine: torch threads")
    rep.add_argument("--warmup", type=int, default=1,
                     help="frames of each episode given to the neural engine as context (padded to its length)")
    rep.add_argument("--resync-every", type=int, default=0, metavar="N",
                     help="refill the neural context from the reference every N generated steps (0: never)")
    rep.add_argument("--seed", type=int, default=0, help="the neural sampler's noise seed")
    rep.add_argument("--no-ssim", action="store_true", help="skip SSIM (faster on long recordings)")
    rep.set_defaults(func=cmd_replay)
    ab = sub.add_parser("abtest", help="blind A/B test: pairs of real and neural clips of the same actions, "
                                       "which one is real? (GameNGen §5.1)")
    ab.add_argument("--clips", type=int, default=10, help="number of clip pairs")
    ab.add_argument("--seconds", type=float, default=1.6, help="clip length (the paper: 1.6 and 3.2)")
    ab.add_argument("--answers", default="abtest.jsonl", metavar="FILE", help="JSONL file every answer is appended to")
    ab.add_argument("--auto", action="store_true", help="no window: an automatic rater picks the sharper clip")
    ab.add_argument("--recording", default=None, metavar="REC",
                    help="take the clips' actions from this recording's seeded episodes (default: random play)")
    ab.add_argument("--checkpoint", default=None,
                    help=f"neural checkpoint folder (default: {DEFAULT_CHECKPOINT} in the repository)")
    ab.add_argument("--no-compile", action="store_true", help="neural engine: skip torch.compile (faster start)")
    ab.add_argument("--threads", type=int, default=1, help="neural engine: torch threads")
    ab.add_argument("--seed", type=int, default=None, help="seed for clip order, play and sampling (default random)")
    ab.add_argument("--scale", type=int, default=WINDOW_SCALE, help="window scale")
    ab.add_argument("--headless", action="store_true", help="dummy video driver (testing)")
    ab.set_defaults(func=cmd_abtest)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if getattr(a, "threads", None) and getattr(a, "engine", "neural") != "real":
            import torch  # only the neural engine pays for importing torch

            torch.set_num_threads(a.threads)
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
