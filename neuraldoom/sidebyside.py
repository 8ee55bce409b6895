"""`neuraldoom play --side-by-side`: real ViZDoom on the left, the neural engine on the right, in lockstep.

The same Action goes to both engines every tick (`lockstep.Lockstep`). The overlay shows the neural
frame's PSNR/SSIM against the real one, a sparkline of the last few seconds of PSNR and each engine's own
speed. Keys, besides the window's (Esc, F1, P, F12, M):
  R        re-sync: refill the neural context from the real game's recent frames (drift vanishes)
  L / Tab  layout: both -> real only -> neural only
  N / .    single step (pauses first)
A view for `window.Window`, with the play client's input sources and options; `client.py` stays
engine-agnostic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .actions import Action
from .client import ClientOptions, check_display, check_record_path, input_source, open_window
from .config import TICS_PER_SECOND
from .lockstep import Lockstep, Tick
from .metrics import hud_top
from .recording import RecordingWriter
from .window import Window

LAYOUTS = ("both", "real", "neural")
RESYNC, LAYOUT, STEP = "resync", "layout", "step"
SPARK_SECONDS = 4.0  # the sparkline's span
GAP = 4  # pixels between the two panes, in frame pixels (scaled)
HELP = "R re-sync  L/Tab layout  N/. single step  P pause  F1 overlay/help  F12 screenshot  Esc quit"


class SideBySideView:
    """Both engines of a `Lockstep` in one window; the real game is what gets recorded."""

    prefix = "neuraldoom-sbs"

    def __init__(self, pair: Lockstep, opts: ClientOptions, source: Any, seed: int,
                 on_step: Callable[[int, Tick], None] | None = None) -> None:
        import pygame

        self.keys = {pygame.K_r: RESYNC, pygame.K_l: LAYOUT, pygame.K_TAB: LAYOUT, pygame.K_n: STEP,
                     pygame.K_PERIOD: STEP}
        self.pair, self.opts, self.source, self.seed, self.on_step = pair, opts, source, seed, on_step
        self.writer: RecordingWriter | None = None
        self.steps = self.episodes = self.resyncs = 0
        self.layout, self.single = "both", False
        self.psnrs: list[float] = []
        rate = opts.fps or TICS_PER_SECOND / pair.cfg.frame_skip
        self.spark: deque[float] = deque(maxlen=max(2, int(SPARK_SECONDS * rate)))
        self.real_ms: deque[float] = deque(maxlen=32)
        self.neural_ms: deque[float] = deque(maxlen=32)

    @property
    def done(self) -> bool:
        return self.opts.frames is not None and self.steps >= self.opts.frames

    def start(self, win: Window) -> None:
        if self.opts.record is not None:
            self.writer = RecordingWriter(self.opts.record, self.pair.cfg, engine="real",
                                          extra={"source": "side-by-side", "input": self.opts.input})
        self.start_episode()

    def start_episode(self) -> None:
        self.tick = self.pair.reset(self.seed)
        if self.writer is not None:  # the warm-up steps are part of the episode: record them too
            self.writer.new_episode(self.seed)
            frames, codes = self.pair.context()
            for j in range(len(frames) - 1):
                self.writer.add(frames[j], Action.from_code(codes[j + 1]))
        self.episodes += 1

    def command(self, cmd: str, win: Window) -> None:
        if cmd == STEP:
            win.paused = self.single = True
        elif cmd == RESYNC:
            self.tick = self.pair.resync()
            self.resyncs += 1
        elif cmd == LAYOUT:
            self.layout = LAYOUTS[(LAYOUTS.index(self.layout) + 1) % len(LAYOUTS)]

    def advance(self, win: Window) -> None:
        if win.paused and not self.single:
            return
        self.single = False
        action = self.source.action()
        if self.writer is not None:
            self.writer.add(self.tick.real, action, self.pair.variables)  # row t: real frame t, action t
        self.tick = tick = self.pair.step(action)
        self.steps += 1
        self.psnrs.append(tick.psnr)
        self.spark.append(tick.psnr)
        self.real_ms.append(tick.real_ms)
        self.neural_ms.append(tick.neural_ms)
        if self.on_step is not None:
            self.on_step(self.steps - 1, tick)
        if self.pair.done:
            self.seed += 1
            self.start_episode()

    def draw(self, win: Window) -> None:
        H, W, s, tick = self.pair.cfg.height, self.pair.cfg.width, win.scale, self.tick
        win.resize(((2 * W + GAP) * s if self.layout == "both" else W * s, H * s))
        win.clear()
        panes = {"both": [(tick.real, 0, "REAL"), (tick.neural, W * s + GAP * s, "NEURAL")],
                 "real": [(tick.real, 0, "REAL")], "neural": [(tick.neural, 0, "NEURAL")]}[self.layout]
        for frame, x, label in panes:
            win.draw_frame(frame, (x, 0))
            if win.overlay:
                win.text([label], (x + W * s - 4, 4), right=True)
        if not win.overlay:
            return
        fr = 1e3 / max(np.mean(self.real_ms), 1e-3) if self.real_ms else 0.0
        fn = 1e3 / max(np.mean(self.neural_ms), 1e-3) if self.neural_ms else 0.0
        ssim = f"  SSIM {tick.ssim:.3f}" if tick.ssim is not None else ""
        win.text([f"PSNR {tick.psnr:5.1f} dB{ssim}  step {self.steps}  seed {self.seed}"
                  f"{'  REC' if self.writer else ''}{'  PAUSED' if win.paused else ''}",
                  f"real {fr:6.0f} FPS  neural {fn:5.1f} FPS  view {win.fps:4.1f} FPS",
                  str(tick.action)] + ([HELP] if win.help else []))
        sparkline(win, list(self.spark), hud_top(H) * s)


def run(pair: Lockstep, opts: ClientOptions = ClientOptions(),
        on_step: Callable[[int, Tick], None] | None = None) -> dict[str, Any]:
    """Play both engines side by side until quit or `opts.frames` ticks; return run stats.

    `on_step(i, tick)` is called after each lockstep tick (tests hook in here). With `opts.record` the
    real game is recorded (its warm-up steps included), so the session replays through either engine.
    """
    check_display(opts.headless)
    check_record_path(opts.record)
    source = input_source(opts, pair.cfg.frame_skip)
    view = SideBySideView(pair, opts, source, opts.first_seed(), on_step)
    try:
        with open_window(opts, "neuraldoom: real | neural", source, max(16, 5 * opts.scale)) as win:
            how = win.run(view, source, opts.rate(pair.cfg.frame_skip))
    finally:
        if view.writer is not None:
            view.writer.close()
    wall = win.seconds
    finite = [p for p in view.psnrs if p < 100]
    return {"steps": view.steps, "episodes": view.episodes, "resyncs": view.resyncs,
            "quit": {"done": "frames"}.get(how, how), "seconds": wall,
            "steps_per_s": view.steps / wall if wall else 0.0,
            "psnr_mean": float(np.mean(view.psnrs)) if view.psnrs else None,
            "psnr_min": float(np.min(finite)) if finite else None,
            "record": str(opts.record) if opts.record is not None else None}


def summary_line(stats: dict[str, Any]) -> str:
    line = (f"neuraldoom: side by side, {stats['steps']} steps, {stats['episodes']} episode(s), "
            f"{stats['resyncs']} re-sync(s) in {stats['seconds']:.2f} s")
    if stats.get("psnr_mean") is not None:
        line += f"; neural vs real PSNR mean of steps {stats['psnr_mean']:.2f} dB"
    if stats.get("record"):
        line += f"; recorded the real game to {stats['record']}"
    return line


def sparkline(win: Window, values: list[float], bottom: int, lo: float = 10.0, hi: float = 40.0) -> None:
    """PSNR over the last seconds (10-40 dB), bottom-left above the status bar, with a 20 dB guide line."""
    if len(values) < 2:
        return
    pg, screen, s = win.pg, win.screen, win.scale
    w, h = min(screen.get_width() // 3, 60 * s), 10 * s
    x0, y0 = 4, bottom - h - 4
    box = pg.Surface((w, h), pg.SRCALPHA)
    box.fill((0, 0, 0, 140))
    screen.blit(box, (x0, y0))

    def y(v: float) -> float:
        return y0 + h - (min(max(v, lo), hi) - lo) / (hi - lo) * h

    pg.draw.line(screen, (120, 120, 120), (x0, y(20.0)), (x0 + w, y(20.0)))
    n = len(values)
    pts = [(x0 + i * (w - 1) / max(n - 1, 1), y(v)) for i, v in enumerate(values)]
    pg.draw.lines(screen, (120, 255, 120), False, pts, max(1, s // 2))


__all__ = ["run", "summary_line", "SideBySideView", "LAYOUTS"]
