"""The pygame play loop. It knows only the engine protocol, never the model or ViZDoom:

    engine.reset(seed: int | None) -> frame (H, W, 3) uint8
    engine.step(action: Action)    -> frame
    engine.done: bool              the episode ended; the client resets with the next seed
    engine.cfg: GameConfig         size and frame_skip (the client paces to 35 / frame_skip steps/s)
    engine.variables (optional)    game variables, recorded with each step
    engine.close()

One loop iteration = read events -> one Action -> (record frame t + action t) -> engine.step -> draw.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .actions import Action
from .config import GameConfig
from .recording import RecordingWriter

TICS_PER_SECOND = 35


class Engine(Protocol):
    cfg: GameConfig
    done: bool

    def reset(self, seed: int | None = None) -> np.ndarray: ...
    def step(self, action: Action) -> np.ndarray: ...
    def close(self) -> None: ...


class ClientError(RuntimeError):
    """The client cannot run as asked: no display, an unwritable recording folder…"""


@dataclass(frozen=True)
class ClientOptions:
    engine_name: str = "neural"  # recorded in the recording's metadata
    seed: int | None = None  # first episode's seed (None: a random one); each reset takes the next
    scale: int = 4  # window = frame size x scale, nearest-neighbour
    fps: float | None = None  # steps per second; None = the game's own speed, 35 / frame_skip
    uncapped: bool = False  # no pacing at all (benchmarks)
    headless: bool = False  # dummy video driver, no pacing, summary line at the end
    frames: int | None = None  # stop after this many engine steps (required headless)
    input: str = "keyboard"  # "keyboard" or "random"
    record: str | Path | None = None  # folder for a RecordingWriter
    sensitivity: float = 0.25  # mouse: degrees of turn per pixel
    overlay: bool = True


def display_available() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("SDL_VIDEODRIVER"))


def check_display(headless: bool) -> None:
    """Fail early, before any engine starts, when a window cannot be opened."""
    if not headless and not display_available():
        raise ClientError("no display to open a window on (DISPLAY/WAYLAND_DISPLAY unset); "
                          "use --headless, or run under Xvfb")


def check_record_path(path: str | Path | None) -> None:
    """Fail early, before any engine starts, when a recording could not be written to `path`.

    Creates nothing: the writer makes the folder once the game runs.
    """
    if path is None:
        return
    p = Path(path).absolute()
    if p.exists():
        if not p.is_dir():
            raise ClientError(f"cannot record to {p}: it is a file, not a folder")
        if (p / "meta.json").exists():
            raise ClientError(f"cannot record to {p}: it already holds a recording; choose a new folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ClientError(f"cannot record to {p}: folder is not writable")
        return
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ClientError(f"cannot record to {p}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ClientError(f"cannot record to {p}: {parent} is not writable")


class _Timer:
    """Rolling rate over the last second or so, for the overlay."""

    def __init__(self, n: int = 32) -> None:
        self.times: deque[float] = deque(maxlen=n)

    def tick(self, t: float) -> None:
        self.times.append(t)

    def rate(self) -> float:
        if len(self.times) < 2:
            return 0.0
        return (len(self.times) - 1) / max(self.times[-1] - self.times[0], 1e-9)


def save_screenshot(pygame: Any, screen: Any, prefix: str, step: int) -> Path:
    """F12: the window as a PNG in the current folder."""
    shot = Path(f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{step}.png")
    pygame.image.save(screen, str(shot))
    print(f"neuraldoom: screenshot {shot}", file=sys.stderr)
    return shot


def input_source(opts: ClientOptions, frame_skip: int) -> Any:
    """The keyboard and mouse, or scripted sticky-random play."""
    from . import controls

    if opts.input == "random":
        return controls.RandomInput(opts.seed)
    if opts.input == "keyboard":
        return controls.KeyboardMouse(frame_skip, opts.sensitivity)
    raise ClientError(f"unknown input {opts.input!r}; use keyboard or random")


def run(engine: Engine, opts: ClientOptions = ClientOptions(),
        on_step: Callable[[int, Action, np.ndarray], None] | None = None) -> dict[str, Any]:
    """Play `engine` in a window (or headless) until quit or `opts.frames` steps; return run stats.

    `on_step(i, action, frame)` is called after each engine step (tests and tools hook in here).
    The recording, when asked for, is closed whatever ends the loop (window closed, Ctrl-C, error).
    """
    check_display(opts.headless)
    check_record_path(opts.record)
    if opts.headless:
        os.environ["SDL_VIDEODRIVER"] = "dummy"  # before pygame opens the video subsystem
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    import pygame

    from . import controls

    cfg = engine.cfg
    source = input_source(opts, cfg.frame_skip)
    period = 0.0
    if not (opts.headless or opts.uncapped):
        period = 1.0 / (opts.fps or TICS_PER_SECOND / cfg.frame_skip)
    seed = opts.seed if opts.seed is not None else int(np.random.default_rng().integers(2**31 - 1))

    pygame.display.init()
    pygame.font.init()
    writer: RecordingWriter | None = None
    stats: dict[str, Any] = {"steps": 0, "episodes": 0, "quit": "frames"}
    t_step = t_draw = t_other = 0.0
    t_start = time.perf_counter()
    try:
        frame = engine.reset(seed)
        H, W = frame.shape[:2]
        size = (W * opts.scale, H * opts.scale)
        screen = pygame.display.set_mode(size)
        small = pygame.Surface((W, H), 0, screen)  # same format as the screen, so scale() can write into it
        pygame.display.set_caption(f"neuraldoom ({opts.engine_name})")
        font = pygame.font.Font(None, max(16, 6 * opts.scale))
        keyboard = isinstance(source, controls.KeyboardMouse)
        if keyboard and not opts.headless:
            _capture_mouse(pygame, True)
        if opts.record is not None:
            writer = RecordingWriter(opts.record, cfg, engine=opts.engine_name,
                                     extra={"source": "client", "input": opts.input})
            writer.new_episode(seed)
        stats["episodes"] = 1
        show_overlay, show_help, paused, captured = opts.overlay, False, False, keyboard
        fps_timer, step_timer = _Timer(), _Timer()
        overlay_cache: tuple[str, list[Any]] = ("", [])
        last_step_ms = 0.0
        action = Action()
        next_t = t_start = time.perf_counter()
        while opts.frames is None or stats["steps"] < opts.frames:
            t0 = time.perf_counter()
            # -- input ------------------------------------------------------------------------
            quit_now = False
            for event in pygame.event.get():
                cmd = source.handle(event)
                if cmd == controls.QUIT:
                    quit_now = True
                elif cmd == controls.OVERLAY:  # overlay -> overlay + help -> nothing
                    show_overlay, show_help = (True, True) if show_overlay and not show_help else (
                        (False, False) if show_overlay else (True, False))
                elif cmd == controls.PAUSE:
                    paused = not paused
                elif cmd == controls.SCREENSHOT:
                    save_screenshot(pygame, screen, "neuraldoom", stats["steps"])
                elif cmd == controls.MOUSE and keyboard and not opts.headless:
                    captured = not captured
                    _capture_mouse(pygame, captured)
            if quit_now:
                stats["quit"] = "user"
                break
            t1 = time.perf_counter()
            # -- step -------------------------------------------------------------------------
            if not paused:
                action = source.action()
                if writer is not None:
                    writer.add(frame, action, getattr(engine, "variables", None))  # row t: frame t, action t
                t1 = time.perf_counter()
                frame = engine.step(action)
                stats["steps"] += 1
                if engine.done:
                    seed += 1
                    frame = engine.reset(seed)
                    stats["episodes"] += 1
                    if writer is not None:
                        writer.new_episode(seed)
                if on_step is not None:
                    on_step(stats["steps"] - 1, action, frame)
            t2 = time.perf_counter()
            if not paused:
                last_step_ms = (t2 - t1) * 1e3
                step_timer.tick(t2)
            # -- draw -------------------------------------------------------------------------
            if frame.shape[:2] != (H, W):  # an engine may change size between episodes
                H, W = frame.shape[:2]
                size = (W * opts.scale, H * opts.scale)
                screen = pygame.display.set_mode(size)
                small = pygame.Surface((W, H), 0, screen)
            # frame -> a small surface in the screen's pixel format -> nearest upscale straight into the screen
            small.blit(pygame.image.frombuffer(np.ascontiguousarray(frame), (W, H), "RGB"), (0, 0))
            pygame.transform.scale(small, size, screen)
            if show_overlay:
                text = (f"{fps_timer.rate():5.1f} FPS  {step_timer.rate():5.1f} steps/s  "
                        f"step {last_step_ms:5.1f} ms  {opts.engine_name}  seed {seed}"
                        f"{'  REC' if writer else ''}{'  PAUSED' if paused else ''}\n{action}")
                if show_help:
                    text += "\n" + controls.HELP
                if text != overlay_cache[0]:
                    overlay_cache = (text, [_shadowed(font, line) for line in text.split("\n")])
                y = 4
                for img in overlay_cache[1]:
                    screen.blit(img, (4, y))
                    y += img.get_height()
            pygame.display.flip()
            t3 = time.perf_counter()
            fps_timer.tick(t3)
            t_step += t2 - t1
            t_draw += t3 - t2
            t_other += t1 - t0
            # -- pace -------------------------------------------------------------------------
            if period:
                next_t += period
                delay = next_t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -period:  # fell behind (slow engine, window dragged): do not race to catch up
                    next_t = time.perf_counter()
        wall = time.perf_counter() - t_start
    except KeyboardInterrupt:
        stats["quit"] = "interrupt"
        wall = time.perf_counter() - t_start
    finally:
        if writer is not None:
            writer.close()
        pygame.quit()
    n = max(stats["steps"], 1)
    stats.update(
        seconds=wall,
        loop_ms=wall * 1e3 / n,
        step_ms=t_step * 1e3 / n,
        draw_ms=t_draw * 1e3 / n,
        other_ms=t_other * 1e3 / n,  # events, action, recording
        steps_per_s=stats["steps"] / wall if wall else 0.0,
        record=str(opts.record) if opts.record is not None else None,
    )
    return stats


def summary_line(stats: dict[str, Any]) -> str:
    line = (f"neuraldoom: {stats['steps']} steps, {stats['episodes']} episode(s) in {stats['seconds']:.2f} s "
            f"({stats['steps_per_s']:.0f} steps/s); loop {stats['loop_ms']:.2f} ms/frame = engine "
            f"{stats['step_ms']:.2f} + draw {stats['draw_ms']:.2f} + input/record {stats['other_ms']:.2f}")
    if stats.get("record"):
        line += f"; recorded to {stats['record']}"
    return line


def _shadowed(font: Any, text: str) -> Any:
    """Text with a 1-pixel dark shadow, readable on any frame."""
    import pygame

    fg = font.render(text, True, (255, 255, 120))
    img = pygame.Surface((fg.get_width() + 1, fg.get_height() + 1), pygame.SRCALPHA)
    img.blit(font.render(text, True, (0, 0, 0)), (1, 1))
    img.blit(fg, (0, 0))
    return img


def _capture_mouse(pygame: Any, on: bool) -> None:
    """Relative mouse mode: the pointer is hidden and grabbed, motion arrives as `rel`."""
    try:
        pygame.mouse.set_relative_mode(on)
    except (AttributeError, pygame.error):
        pygame.event.set_grab(on)
        pygame.mouse.set_visible(not on)


__all__ = ["ClientError", "ClientOptions", "Engine", "run", "summary_line", "check_display", "check_record_path",
           "display_available"]
