"""The one window and loop that every view plays in: `play`, `play --side-by-side` and the A/B rater.

`Window` owns SDL: the display check (one `ClientError` line when there is none), the headless dummy
driver, nearest-neighbour scaling of uint8 frames, shadowed overlay text, F12 screenshots, pause, the F1
overlay cycle, the mouse grab, pacing with `pygame.time.Clock` and quitting. `Window.run(view)` is the
loop, the shape of DIAMOND's `Game.run` over interchangeable play environments:

    pump events -> commands (the window's own: quit, F1, P, F12, M; the rest go to the view)
    view.advance(window)   one tick: step the engine(s) unless paused
    view.draw(window)      frames and text, through the window's helpers
    flip, pace

A view is small: `keys` (its own key -> command, read before the input source), `prefix` and `steps`
(screenshot names), `done`, and `start`, `command`, `advance`, `draw`.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # before anything here imports pygame

from .config import TICS_PER_SECOND  # noqa: E402  a view paces to TICS_PER_SECOND / frame_skip steps per second

NOTICE_SECONDS = 3.0  # how long a notice (screenshot saved or failed) stays on screen


class ClientError(RuntimeError):
    """The client cannot run as asked: no display, an unwritable recording folder…"""


def display_available() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("SDL_VIDEODRIVER"))


def check_display(headless: bool) -> None:
    """Fail early, before any engine starts, when a window cannot be opened."""
    if not headless and not display_available():
        raise ClientError("no display to open a window on (DISPLAY/WAYLAND_DISPLAY unset); "
                          "use --headless, or run under Xvfb")


class View(Protocol):
    keys: dict[int, str]  # the view's own keys -> commands, read before the input source sees the event
    prefix: str  # screenshots are PREFIX-YYYYmmdd-HHMMSS-STEPS.png
    steps: int
    done: bool  # the loop ends once this is true

    def start(self, win: Window) -> None: ...
    def command(self, cmd: str, win: Window) -> None: ...
    def advance(self, win: Window) -> None: ...
    def draw(self, win: Window) -> None: ...


class Window:
    """A pygame window (SDL's dummy driver when headless), opened at once, sized by `resize`."""

    def __init__(self, caption: str, scale: int = 4, headless: bool = False, font_size: int = 16,
                 grab_mouse: bool = False, overlay: bool = True) -> None:
        check_display(headless)
        if headless:
            os.environ["SDL_VIDEODRIVER"] = "dummy"  # before pygame opens the video subsystem
        import pygame

        from . import controls

        self.pg, self.controls = pygame, controls
        try:
            pygame.display.init()
        except pygame.error as e:
            raise ClientError(f"cannot open a window: {e}") from None
        pygame.font.init()
        self.caption, self.scale, self.headless = caption, scale, headless
        self.font = pygame.font.Font(None, font_size)
        self.grab = grab_mouse and not headless  # M toggles it; never with the dummy driver
        self.captured = False
        self.overlay, self.help, self.paused = overlay, False, False
        self.clock = pygame.time.Clock()
        self.screen: Any = None
        self.notice: tuple[str, float] = ("", 0.0)
        self.timings = {"events": 0.0, "advance": 0.0, "draw": 0.0}
        self.seconds = 0.0
        self._small: dict[tuple[int, int], Any] = {}
        self._text: dict[str, Any] = {}

    # -- drawing ------------------------------------------------------------------------------
    def resize(self, size: tuple[int, int]) -> Any:
        """The screen, (re)opened when its size changes (first frame, new layout, a new episode's size)."""
        if self.screen is None or self.screen.get_size() != tuple(size):
            self.screen = self.pg.display.set_mode(size)
            self.pg.display.set_caption(self.caption)
            self._small.clear()  # in the old screen's pixel format
            if self.grab and not self.captured:
                self.capture_mouse(True)
        return self.screen

    def clear(self) -> None:
        self.screen.fill((0, 0, 0))

    def draw_frame(self, frame: np.ndarray, pos: tuple[int, int] = (0, 0)) -> None:
        """A uint8 (H, W, 3) frame at `pos`, upscaled `scale` times, nearest neighbour."""
        pg = self.pg
        H, W = frame.shape[:2]
        small = self._small.get((W, H))
        if small is None:  # same format as the screen, so scale() can write straight into it
            small = self._small[(W, H)] = pg.Surface((W, H), 0, self.screen)
        small.blit(pg.image.frombuffer(np.ascontiguousarray(frame), (W, H), "RGB"), (0, 0))
        size = (W * self.scale, H * self.scale)
        dest = self.screen if pos == (0, 0) and self.screen.get_size() == size else self.screen.subsurface(
            pg.Rect(pos, size))
        pg.transform.scale(small, size, dest)

    def rendered(self, line: str) -> Any:
        """One line of text with a 1-pixel dark shadow, readable on any frame (cached)."""
        img = self._text.get(line)
        if img is None:
            pg = self.pg
            fg = self.font.render(line, True, (255, 255, 120))
            img = pg.Surface((fg.get_width() + 1, fg.get_height() + 1), pg.SRCALPHA)
            img.blit(self.font.render(line, True, (0, 0, 0)), (1, 1))
            img.blit(fg, (0, 0))
            if len(self._text) > 256:  # the overlay changes every frame: keep the cache small
                self._text.clear()
            self._text[line] = img
        return img

    def text(self, lines: list[str], pos: tuple[int, int] = (4, 4), right: bool = False) -> None:
        """Lines top-down from `pos` (its x the right edge when `right`)."""
        x, y = pos
        for line in lines:
            for part in line.split("\n"):
                img = self.rendered(part)
                self.screen.blit(img, (x - img.get_width() if right else x, y))
                y += img.get_height()

    def flip(self) -> None:
        text, until = self.notice
        if text and time.monotonic() < until:
            h = self.rendered(text).get_height()
            self.text([text], (4, self.screen.get_height() - h - 4))
        self.pg.display.flip()

    # -- commands -----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        """A one-line notice: on stderr, and on screen for a few seconds."""
        print(f"neuraldoom: {text}", file=sys.stderr)
        self.notice = (text, time.monotonic() + NOTICE_SECONDS)

    def screenshot(self, prefix: str, step: int) -> Path | None:
        """F12: the window as a PNG in the current folder, never over an existing file. A failure is a
        notice, not the end of the game."""
        stem = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{step}"
        png = io.BytesIO()
        try:
            self.pg.image.save(self.screen, png, "png")
            shot, n = Path(f"{stem}.png"), 1
            while shot.exists():  # F12 twice in a second while paused
                n += 1
                shot = Path(f"{stem}-{n}.png")
            with open(shot, "xb") as f:
                f.write(png.getvalue())
        except (OSError, self.pg.error) as e:
            why = getattr(e, "strerror", None) or str(e)
            self.say(f"screenshot failed: cannot write {stem}.png in the current folder: {why}")
            return None
        self.say(f"screenshot {shot}")
        return shot

    def capture_mouse(self, on: bool) -> None:
        """Relative mouse mode: the pointer is hidden and grabbed, motion arrives as `rel`."""
        pg = self.pg
        try:
            pg.mouse.set_relative_mode(on)
        except (AttributeError, pg.error):
            pg.event.set_grab(on)
            pg.mouse.set_visible(not on)
        self.captured = on

    def commands(self, source: Any = None, keys: dict[int, str] | None = None) -> list[str]:
        """The event pump: each event to the view's keys, else to the input source (which keeps the held
        keys); without a source the standard commands (Esc, F1, P, F12, M, closing the window)."""
        pg, c = self.pg, self.controls
        out = []
        for event in pg.event.get():
            cmd = keys.get(getattr(event, "key", None)) if keys and event.type == pg.KEYDOWN else None
            if cmd is None:
                if source is not None:
                    cmd = source.handle(event)
                elif event.type == pg.QUIT:
                    cmd = c.QUIT
                elif event.type == pg.KEYDOWN:
                    cmd = c.KEY_COMMANDS.get(getattr(event, "key", None))
            if cmd is not None:
                out.append(cmd)
        return out

    def handle(self, cmd: str, view: View) -> bool:
        """The window's own commands (overlay, pause, screenshot, mouse); False for any other."""
        c = self.controls
        if cmd == c.OVERLAY:  # overlay -> overlay + help -> nothing
            self.overlay, self.help = (True, True) if self.overlay and not self.help else (
                (False, False) if self.overlay else (True, False))
        elif cmd == c.PAUSE:
            self.paused = not self.paused
        elif cmd == c.SCREENSHOT:
            self.screenshot(view.prefix, view.steps)
        elif cmd == c.MOUSE:
            if self.grab:
                self.capture_mouse(not self.captured)
        else:
            return False
        return True

    # -- the loop -----------------------------------------------------------------------------
    @property
    def fps(self) -> float:
        return float(self.clock.get_fps())

    def run(self, view: View, source: Any = None, fps: float = 0.0) -> str:
        """Drive `view` until it is done ("done"), the user quits ("user") or Ctrl-C ("interrupt").

        `fps`: frames per second to pace to (0: as fast as possible). Times spent go to `timings`
        (events, advance, draw) and `seconds` (the loop's wall time, after `view.start`).
        """
        t_start = time.perf_counter()
        try:
            view.start(self)
            t_start = time.perf_counter()
            self.clock.tick()
            while not view.done:
                t0 = time.perf_counter()
                for cmd in self.commands(source, view.keys):
                    if cmd == self.controls.QUIT:
                        return "user"
                    if not self.handle(cmd, view):
                        view.command(cmd, self)
                    if view.done:
                        return "done"
                t1 = time.perf_counter()
                view.advance(self)
                t2 = time.perf_counter()
                view.draw(self)
                self.flip()
                t3 = time.perf_counter()
                self.timings["events"] += t1 - t0
                self.timings["advance"] += t2 - t1
                self.timings["draw"] += t3 - t2
                self.clock.tick(fps)  # sleeps to `fps`; a slow frame is not made up for by racing after it
            return "done"
        except KeyboardInterrupt:
            return "interrupt"
        finally:
            self.seconds = time.perf_counter() - t_start

    def close(self) -> None:
        self.pg.quit()

    def __enter__(self) -> Window:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Window", "View", "ClientError", "check_display", "display_available", "TICS_PER_SECOND"]
