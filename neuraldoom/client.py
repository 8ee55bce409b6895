"""The play view: one engine in the window. It knows only the engine protocol, never the model or ViZDoom:

    engine.reset(seed: int | None) -> frame (H, W, 3) uint8
    engine.step(action: Action)    -> frame
    engine.done: bool              the episode ended; the client resets with the next seed
    engine.cfg: GameConfig         size and frame_skip (the client paces to 35 / frame_skip steps/s)
    engine.variables (optional)    game variables, recorded with each step
    engine.close()

One tick = (record frame t + action t) -> engine.step -> draw; the window (`window.py`) reads the events,
draws, paces and quits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .actions import Action
from .config import MOUSE_SENSITIVITY, TICS_PER_SECOND, WINDOW_SCALE, GameConfig
from .recording import RecordingWriter, unwritable
from .window import ClientError, Window, check_display, display_available


class Engine(Protocol):
    cfg: GameConfig
    done: bool

    def reset(self, seed: int | None = None) -> np.ndarray: ...
    def step(self, action: Action) -> np.ndarray: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ClientOptions:
    engine_name: str = "neural"  # recorded in the recording's metadata
    seed: int | None = None  # first episode's seed (None: a random one); each reset takes the next
    scale: int = WINDOW_SCALE  # window = frame size x scale, nearest-neighbour
    fps: float | None = None  # steps per second; None = the game's own speed, 35 / frame_skip
    uncapped: bool = False  # no pacing at all (benchmarks)
    headless: bool = False  # dummy video driver, no pacing, summary line at the end
    frames: int | None = None  # stop after this many engine steps (required headless)
    input: str = "keyboard"  # "keyboard" or "random"
    record: str | Path | None = None  # folder for a RecordingWriter
    sensitivity: float = MOUSE_SENSITIVITY  # mouse: degrees of turn per pixel
    overlay: bool = True

    def rate(self, frame_skip: int) -> float:
        """Steps per second to pace to; 0 (as fast as possible) headless or uncapped."""
        return 0.0 if (self.headless or self.uncapped) else (self.fps or TICS_PER_SECOND / frame_skip)

    def first_seed(self) -> int:
        return self.seed if self.seed is not None else int(np.random.default_rng().integers(2**31 - 1))


def check_record_path(path: str | Path | None) -> None:
    """Fail early, before any engine starts, when a recording could not be written to `path`.

    Creates nothing: the writer makes the folder once the game runs.
    """
    if path is None:
        return
    p = Path(path).absolute()
    if (p / "meta.json").exists():
        raise ClientError(f"cannot record to {p}: it already holds a recording; choose a new folder")
    why = unwritable(p)
    if why:
        raise ClientError(f"cannot record to {p}: {why}")


def input_source(opts: ClientOptions, frame_skip: int) -> Any:
    """The keyboard and mouse, or scripted sticky-random play."""
    from . import controls

    if opts.input == "random":
        return controls.RandomInput(opts.seed)
    if opts.input == "keyboard":
        return controls.KeyboardMouse(frame_skip, opts.sensitivity)
    raise ClientError(f"unknown input {opts.input!r}; use keyboard or random")


def open_window(opts: ClientOptions, caption: str, source: Any, font_size: int) -> Window:
    """The window for a play session: headless or not, mouse grabbed for keyboard play, overlay as asked."""
    from . import controls

    return Window(caption, opts.scale, opts.headless, font_size,
                  grab_mouse=isinstance(source, controls.KeyboardMouse), overlay=opts.overlay)


class PlayView:
    """One engine, the whole window; the overlay shows speed, step time, seed and the current action."""

    keys: dict[int, str] = {}
    prefix = "neuraldoom"

    def __init__(self, engine: Engine, opts: ClientOptions, source: Any, seed: int,
                 on_step: Callable[[int, Action, np.ndarray], None] | None = None) -> None:
        self.engine, self.opts, self.source, self.seed, self.on_step = engine, opts, source, seed, on_step
        self.writer: RecordingWriter | None = None
        self.steps = self.episodes = 0
        self.engine_s = 0.0  # engine steps and resets (+ on_step), for the summary's breakdown
        self.last_step_ms = 0.0
        self.action = Action()

    @property
    def done(self) -> bool:
        return self.opts.frames is not None and self.steps >= self.opts.frames

    def start(self, win: Window) -> None:
        self.frame = self.engine.reset(self.seed)
        if self.opts.record is not None:
            self.writer = RecordingWriter(self.opts.record, self.engine.cfg, engine=self.opts.engine_name,
                                          extra={"source": "client", "input": self.opts.input})
            self.writer.new_episode(self.seed)
        self.episodes = 1

    def command(self, cmd: str, win: Window) -> None:
        pass

    def advance(self, win: Window) -> None:
        if win.paused:
            return
        self.action = self.source.action()
        if self.writer is not None:  # row t: frame t, action t
            self.writer.add(self.frame, self.action, getattr(self.engine, "variables", None))
        t0 = time.perf_counter()
        self.frame = self.engine.step(self.action)
        self.steps += 1
        if self.engine.done:
            self.seed += 1
            self.frame = self.engine.reset(self.seed)
            self.episodes += 1
            if self.writer is not None:
                self.writer.new_episode(self.seed)
        if self.on_step is not None:
            self.on_step(self.steps - 1, self.action, self.frame)
        dt = time.perf_counter() - t0
        self.engine_s += dt
        self.last_step_ms = dt * 1e3

    def draw(self, win: Window) -> None:
        H, W = self.frame.shape[:2]  # an engine may change size between episodes
        win.resize((W * win.scale, H * win.scale))
        win.draw_frame(self.frame)
        if win.overlay:
            fps = win.fps
            what = getattr(self.engine, "label", self.opts.engine_name)  # the neural engine says which sampler
            win.text([f"{fps:5.1f} FPS  {0.0 if win.paused else fps:5.1f} steps/s  step {self.last_step_ms:5.1f} ms"
                      f"  {what}  seed {self.seed}{'  REC' if self.writer else ''}"
                      f"{'  PAUSED' if win.paused else ''}", str(self.action)]
                     + ([win.controls.HELP] if win.help else []))


def run(engine: Engine, opts: ClientOptions = ClientOptions(),
        on_step: Callable[[int, Action, np.ndarray], None] | None = None) -> dict[str, Any]:
    """Play `engine` in a window (or headless) until quit or `opts.frames` steps; return run stats.

    `on_step(i, action, frame)` is called after each engine step (tests and tools hook in here).
    The recording, when asked for, is closed whatever ends the loop (window closed, Ctrl-C, error).
    """
    check_display(opts.headless)
    check_record_path(opts.record)
    source = input_source(opts, engine.cfg.frame_skip)
    view = PlayView(engine, opts, source, opts.first_seed(), on_step)
    try:
        with open_window(opts, f"neuraldoom ({opts.engine_name})", source, max(16, 6 * opts.scale)) as win:
            how = win.run(view, source, opts.rate(engine.cfg.frame_skip))
    finally:
        if view.writer is not None:
            view.writer.close()
    n, wall, t = max(view.steps, 1), win.seconds, win.timings
    return {
        "steps": view.steps, "episodes": view.episodes, "quit": {"done": "frames"}.get(how, how),
        "seconds": wall,
        "loop_ms": wall * 1e3 / n,
        "step_ms": view.engine_s * 1e3 / n,
        "draw_ms": t["draw"] * 1e3 / n,
        "other_ms": (t["events"] + t["advance"] - view.engine_s) * 1e3 / n,  # events, action, recording
        "steps_per_s": view.steps / wall if wall else 0.0,
        "record": str(opts.record) if opts.record is not None else None,
    }


def summary_line(stats: dict[str, Any]) -> str:
    line = (f"neuraldoom: {stats['steps']} steps, {stats['episodes']} episode(s) in {stats['seconds']:.2f} s "
            f"({stats['steps_per_s']:.0f} steps/s); loop {stats['loop_ms']:.2f} ms/frame = engine "
            f"{stats['step_ms']:.2f} + draw {stats['draw_ms']:.2f} + input/record {stats['other_ms']:.2f}")
    if stats.get("record"):
        line += f"; recorded to {stats['record']}"
    return line


__all__ = ["ClientError", "ClientOptions", "Engine", "PlayView", "run", "summary_line", "check_display",
           "check_record_path", "display_available", "input_source", "open_window", "TICS_PER_SECOND"]
