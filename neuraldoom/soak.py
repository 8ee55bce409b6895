"""Soak the play loop (a benchmark, not a unit test: minutes of CPU): long play stays finite and its memory
flat, and a storm of random window events posted to the real client does not bring it down.

    python -m neuraldoom.soak [--checkpoint DIR] [--frames 10000] [--events 10000] [--no-compile]

1. What `python main.py --headless --frames N --input random` does, in this process, with every sampled
   latent checked finite and the resident memory (RSS) read every 250 steps: "start" after the warm-up
   (the first 10% of the steps: compile cache, allocator pools), "end" at the last step.
2. The client in a window (SDL's dummy video driver) with keyboard and mouse input, with EVENTS random
   events posted to pygame's queue, ten a step: key presses and releases of any key but the two that end
   or pause the game (Esc, P), mouse motion, buttons and wheel, window focus, resize, minimise, expose,
   text input. Screenshots (F12) land in a temporary folder.

Prints a table; the last line is machine-readable (`soak_frames=… nonfinite=… rss_start_mb=… rss_end_mb=…
rss_growth_mb=… storm_events=… storm_steps=… crashed=…`); exit 1 if a check failed.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import DEFAULT_CHECKPOINT, parse_args, resolve_checkpoint

GROWTH_LIMIT_MB = 32.0  # RSS growth after warm-up that counts as a leak (over 10,000 frames)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def long_play(engine: Any, frames: int) -> dict[str, Any]:
    from . import client

    samples: list[tuple[int, float]] = []
    bad = [0]

    def on_step(i: int, action: Any, frame: np.ndarray) -> None:
        if not bool(np.isfinite(engine.z[-1].numpy()).all()):
            bad[0] += 1
        if i % 250 == 0 or i == frames - 1:
            samples.append((i, rss_mb()))

    t0 = time.perf_counter()
    stats = client.run(engine, client.ClientOptions(headless=True, frames=frames, input="random", seed=0), on_step)
    warm = next((r for i, r in samples if i >= frames // 10), samples[-1][1])
    return {"frames": stats["steps"], "seconds": time.perf_counter() - t0, "nonfinite": bad[0],
            "rss_start_mb": warm, "rss_end_mb": samples[-1][1], "rss_max_mb": max(r for _, r in samples)}


def random_events(rng: np.random.Generator, n: int) -> list[Any]:
    import pygame as pg

    keys = [k for k in range(pg.K_a, pg.K_z + 1) if k != pg.K_p] + [
        pg.K_LEFT, pg.K_RIGHT, pg.K_UP, pg.K_DOWN, pg.K_SPACE, pg.K_LCTRL, pg.K_RCTRL, pg.K_LSHIFT, pg.K_F1,
        pg.K_F12, pg.K_m, pg.K_RETURN, pg.K_TAB, pg.K_0, pg.K_9, pg.K_F5]
    kinds = ["down", "up", "motion", "button_down", "button_up", "wheel", "window", "text"]
    out = []
    for _ in range(n):
        kind = kinds[rng.integers(len(kinds))]
        if kind in ("down", "up"):
            k = int(keys[rng.integers(len(keys))])
            out.append(pg.event.Event(pg.KEYDOWN if kind == "down" else pg.KEYUP, key=k, mod=0, unicode="",
                                      scancode=0))
        elif kind == "motion":
            rel = (int(rng.integers(-400, 401)), int(rng.integers(-300, 301)))
            out.append(pg.event.Event(pg.MOUSEMOTION, pos=(0, 0), rel=rel, buttons=(0, 0, 0)))
        elif kind in ("button_down", "button_up"):
            out.append(pg.event.Event(pg.MOUSEBUTTONDOWN if kind == "button_down" else pg.MOUSEBUTTONUP,
                                      button=int(rng.integers(1, 8)), pos=(0, 0)))
        elif kind == "wheel":
            out.append(pg.event.Event(pg.MOUSEWHEEL, x=0, y=int(rng.integers(-3, 4))))
        elif kind == "window":
            t = [pg.WINDOWFOCUSLOST, pg.WINDOWFOCUSGAINED, pg.WINDOWMINIMIZED, pg.WINDOWRESTORED,
                 pg.WINDOWEXPOSED, pg.WINDOWRESIZED][rng.integers(6)]
            out.append(pg.event.Event(t, x=int(rng.integers(1, 2000)), y=int(rng.integers(1, 2000))))
        else:
            out.append(pg.event.Event(pg.TEXTINPUT, text=chr(int(rng.integers(32, 127)))))
    return out


def event_storm(engine: Any, events: int, per_step: int = 10) -> dict[str, Any]:
    import pygame as pg

    from . import client

    steps = -(-events // per_step)
    storm = random_events(np.random.default_rng(0), events)
    posted = [0]

    def on_step(i: int, action: Any, frame: np.ndarray) -> None:
        for e in storm[i * per_step:(i + 1) * per_step]:
            pg.event.post(e)
            posted[0] += 1

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # F12 screenshots land here
        try:
            stats = client.run(engine, client.ClientOptions(frames=steps + 1, uncapped=True, seed=1), on_step)
            error = None
        except Exception as e:  # the storm's verdict: report, do not hide
            stats, error = {"steps": 0, "quit": "crash"}, f"{type(e).__name__}: {e}"
        finally:
            os.chdir(cwd)
            shots = len(list(Path(tmp).glob("*.png")))
    return {"events": posted[0], "steps": stats["steps"], "quit": stats["quit"], "error": error, "shots": shots}


@dataclass(frozen=True)
class Args:
    checkpoint: str = DEFAULT_CHECKPOINT  # in the repository unless a path that exists here
    frames: int = 10_000  # steps of headless random play
    events: int = 10_000  # random window events to post
    compile: bool = True  # the compiled sampler, as `python main.py` plays


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    from .checkpoint import CheckpointError
    from .engine import NeuralEngine

    try:
        engine = NeuralEngine.from_checkpoint(resolve_checkpoint(a.checkpoint), compile=a.compile,
                                              parallel="auto")
    except CheckpointError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    try:
        play = long_play(engine, a.frames)
        storm = event_storm(engine, a.events)
    finally:
        engine.close()
    growth = play["rss_end_mb"] - play["rss_start_mb"]
    ok = (play["frames"] == a.frames and play["nonfinite"] == 0 and growth < GROWTH_LIMIT_MB
          and storm["error"] is None and storm["events"] == a.events)
    print(f"long play: {play['frames']} frames in {play['seconds']:.0f} s ({play['frames'] / play['seconds']:.1f} "
          f"FPS, {engine.label}); non-finite latents {play['nonfinite']}; RSS after warm-up "
          f"{play['rss_start_mb']:.0f} MB, at the end {play['rss_end_mb']:.0f} MB (max {play['rss_max_mb']:.0f})")
    print(f"event storm: {storm['events']} events over {storm['steps']} steps, ended by {storm['quit']!r}"
          f"{', ' + storm['error'] if storm['error'] else ''}; {storm['shots']} screenshots")
    print(f"soak_frames={play['frames']} nonfinite={play['nonfinite']} rss_start_mb={play['rss_start_mb']:.1f} "
          f"rss_end_mb={play['rss_end_mb']:.1f} rss_growth_mb={growth:.1f} storm_events={storm['events']} "
          f"storm_steps={storm['steps']} crashed={int(storm['error'] is not None)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
