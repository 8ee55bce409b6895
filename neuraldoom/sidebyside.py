"""`neuraldoom play --side-by-side`: real ViZDoom on the left, the neural engine on the right, in lockstep.

The same Action goes to both engines every tick (`lockstep.Lockstep`). The overlay shows the neural
frame's PSNR/SSIM against the real one, a sparkline of the last few seconds of PSNR and each engine's own
speed. Keys, besides the client's (Esc, F1, P, F12, M):
  R        re-sync: refill the neural context from the real game's recent frames (drift vanishes)
  L / Tab  layout: both -> real only -> neural only
  N / .    single step (pauses first)
Reuses the play client's input sources, pacing and drawing helpers; `client.py` stays engine-agnostic.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .actions import Action
from .client import (
    TICS_PER_SECOND,
    ClientOptions,
    _capture_mouse,
    _shadowed,
    _Timer,
    check_display,
    check_record_path,
    input_source,
    save_screenshot,
)
from .lockstep import Lockstep, Tick
from .metrics import hud_top
from .recording import RecordingWriter

LAYOUTS = ("both", "real", "neural")
RESYNC, LAYOUT, STEP = "resync", "layout", "step"
SPARK_SECONDS = 4.0  # the sparkline's span
GAP = 4  # pixels between the two panes, in frame pixels (scaled)
HELP = "R re-sync  L/Tab layout  N/. single step  P pause  F1 overlay/help  F12 screenshot  Esc quit"


def _own_keys(pygame: Any) -> dict[int, str]:
    return {pygame.K_r: RESYNC, pygame.K_l: LAYOUT, pygame.K_TAB: LAYOUT, pygame.K_n: STEP,
            pygame.K_PERIOD: STEP}


def run(pair: Lockstep, opts: ClientOptions = ClientOptions(),
        on_step: Callable[[int, Tick], None] | None = None) -> dict[str, Any]:
    """Play both engines side by side until quit or `opts.frames` ticks; return run stats.

    `on_step(i, tick)` is called after each lockstep tick (tests hook in here). With `opts.record` the
    real game is recorded (its warm-up steps included), so the session replays through either engine.
    """
    check_display(opts.headless)
    check_record_path(opts.record)
    if opts.headless:
        os.environ["SDL_VIDEODRIVER"] = "dummy"
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    import pygame

    from . import controls

    cfg = pair.cfg
    source = input_source(opts, cfg.frame_skip)
    rate = opts.fps or TICS_PER_SECOND / cfg.frame_skip
    period = 0.0 if (opts.headless or opts.uncapped) else 1.0 / rate
    seed = opts.seed if opts.seed is not None else int(np.random.default_rng().integers(2**31 - 1))
    own = _own_keys(pygame)

    pygame.display.init()
    pygame.font.init()
    writer: RecordingWriter | None = None
    stats: dict[str, Any] = {"steps": 0, "episodes": 0, "resyncs": 0, "quit": "frames"}
    psnrs: list[float] = []
    t_start = time.perf_counter()

    def start_episode() -> Tick:
        tick = pair.reset(seed)
        if writer is not None:  # the warm-up steps are part of the episode: record them too
            writer.new_episode(seed)
            frames, codes = pair.context()
            for j in range(len(frames) - 1):
                writer.add(frames[j], Action(int(codes[j + 1][0]), int(codes[j + 1][1])))
        stats["episodes"] += 1
        return tick

    try:
        if opts.record is not None:
            writer = RecordingWriter(opts.record, cfg, engine="real",
                                     extra={"source": "side-by-side", "input": opts.input})
        tick = start_episode()
        H, W = cfg.height, cfg.width
        s = opts.scale
        layout = "both"
        screen = _set_mode(pygame, layout, W, H, s)
        pygame.display.set_caption("neuraldoom: real | neural")
        small = pygame.Surface((W, H), 0, screen)
        font = pygame.font.Font(None, max(16, 5 * s))
        keyboard = isinstance(source, controls.KeyboardMouse)
        if keyboard and not opts.headless:
            _capture_mouse(pygame, True)
        show_overlay, show_help, paused, captured = opts.overlay, False, False, keyboard
        spark: deque[float] = deque(maxlen=max(2, int(SPARK_SECONDS * rate)))
        real_ms: deque[float] = deque(maxlen=32)
        neural_ms: deque[float] = deque(maxlen=32)
        fps_timer = _Timer()
        next_t = t_start = time.perf_counter()
        while opts.frames is None or stats["steps"] < opts.frames:
            # -- input ------------------------------------------------------------------------
            quit_now = single = False
            for event in pygame.event.get():
                cmd = own.get(getattr(event, "key", None)) if event.type == pygame.KEYDOWN else None
                if cmd is None:
                    cmd = source.handle(event)
                if cmd == controls.QUIT:
                    quit_now = True
                elif cmd == controls.OVERLAY:
                    show_overlay, show_help = (True, True) if show_overlay and not show_help else (
                        (False, False) if show_overlay else (True, False))
                elif cmd == controls.PAUSE:
                    paused = not paused
                elif cmd == STEP:
                    paused = single = True
                elif cmd == RESYNC:
                    tick = pair.resync()
                    stats["resyncs"] += 1
                elif cmd == LAYOUT:
                    layout = LAYOUTS[(LAYOUTS.index(layout) + 1) % len(LAYOUTS)]
                    screen = _set_mode(pygame, layout, W, H, s)
                    small = pygame.Surface((W, H), 0, screen)
                elif cmd == controls.SCREENSHOT:
                    save_screenshot(pygame, screen, "neuraldoom-sbs", stats["steps"])
                elif cmd == controls.MOUSE and keyboard and not opts.headless:
                    captured = not captured
                    _capture_mouse(pygame, captured)
            if quit_now:
                stats["quit"] = "user"
                break
            # -- step both --------------------------------------------------------------------
            if not paused or single:
                action = source.action()
                if writer is not None:
                    writer.add(tick.real, action, pair.variables)  # row t: real frame t, action t
                tick = pair.step(action)
                stats["steps"] += 1
                psnrs.append(tick.psnr)
                spark.append(tick.psnr)
                real_ms.append(tick.real_ms)
                neural_ms.append(tick.neural_ms)
                if on_step is not None:
                    on_step(stats["steps"] - 1, tick)
                if pair.done:
                    seed += 1
                    tick = start_episode()
            # -- draw -------------------------------------------------------------------------
            screen.fill((0, 0, 0))
            panes = {"both": [(tick.real, 0, "REAL"), (tick.neural, W * s + GAP * s, "NEURAL")],
                     "real": [(tick.real, 0, "REAL")], "neural": [(tick.neural, 0, "NEURAL")]}[layout]
            for frame, x, label in panes:
                small.blit(pygame.image.frombuffer(np.ascontiguousarray(frame), (W, H), "RGB"), (0, 0))
                screen.blit(pygame.transform.scale(small, (W * s, H * s)), (x, 0))
                if show_overlay:
                    img = _shadowed(font, label)
                    screen.blit(img, (x + W * s - img.get_width() - 4, 4))
            if show_overlay:
                fr = 1e3 / max(np.mean(real_ms), 1e-3) if real_ms else 0.0
                fn = 1e3 / max(np.mean(neural_ms), 1e-3) if neural_ms else 0.0
                ssim = f"  SSIM {tick.ssim:.3f}" if tick.ssim is not None else ""
                lines = [f"PSNR {tick.psnr:5.1f} dB{ssim}  step {stats['steps']}  seed {seed}"
                         f"{'  REC' if writer else ''}{'  PAUSED' if paused else ''}",
                         f"real {fr:6.0f} FPS  neural {fn:5.1f} FPS  view {fps_timer.rate():4.1f} FPS",
                         str(tick.action)]
                if show_help:
                    lines.append(HELP)
                y = 4
                for line in lines:
                    img = _shadowed(font, line)
                    screen.blit(img, (4, y))
                    y += img.get_height()
                _sparkline(pygame, screen, list(spark), screen.get_width(), hud_top(H) * s, s)
            pygame.display.flip()
            fps_timer.tick(time.perf_counter())
            # -- pace -------------------------------------------------------------------------
            if period:
                next_t += period
                delay = next_t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -period:
                    next_t = time.perf_counter()
    except KeyboardInterrupt:
        stats["quit"] = "interrupt"
    finally:
        if writer is not None:
            writer.close()
        pygame.quit()
    wall = time.perf_counter() - t_start
    finite = [p for p in psnrs if p < 100]
    stats.update(seconds=wall, steps_per_s=stats["steps"] / wall if wall else 0.0,
                 psnr_mean=float(np.mean(psnrs)) if psnrs else None,
                 psnr_min=float(np.min(finite)) if finite else None,
                 record=str(opts.record) if opts.record is not None else None)
    return stats


def summary_line(stats: dict[str, Any]) -> str:
    line = (f"neuraldoom: side by side, {stats['steps']} steps, {stats['episodes']} episode(s), "
            f"{stats['resyncs']} re-sync(s) in {stats['seconds']:.2f} s")
    if stats.get("psnr_mean") is not None:
        line += f"; neural vs real PSNR mean of steps {stats['psnr_mean']:.2f} dB"
    if stats.get("record"):
        line += f"; recorded the real game to {stats['record']}"
    return line


def _set_mode(pygame: Any, layout: str, W: int, H: int, s: int) -> Any:
    w = (2 * W + GAP) * s if layout == "both" else W * s
    return pygame.display.set_mode((w, H * s))


def _sparkline(pygame: Any, screen: Any, values: list[float], width: int, bottom: int, s: int,
               lo: float = 10.0, hi: float = 40.0) -> None:
    """PSNR over the last seconds (10-40 dB), bottom-left above the status bar, with a 20 dB guide line."""
    if len(values) < 2:
        return
    w, h = min(width // 3, 60 * s), 10 * s
    x0, y0 = 4, bottom - h - 4
    box = pygame.Surface((w, h), pygame.SRCALPHA)
    box.fill((0, 0, 0, 140))
    screen.blit(box, (x0, y0))

    def y(v: float) -> float:
        return y0 + h - (min(max(v, lo), hi) - lo) / (hi - lo) * h

    pygame.draw.line(screen, (120, 120, 120), (x0, y(20.0)), (x0 + w, y(20.0)))
    n = len(values)
    pts = [(x0 + i * (w - 1) / max(n - 1, 1), y(v)) for i, v in enumerate(values)]
    pygame.draw.lines(screen, (120, 255, 120), False, pts, max(1, s // 2))


__all__ = ["run", "summary_line", "LAYOUTS"]
