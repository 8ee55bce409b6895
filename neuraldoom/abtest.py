"""Blind A/B test (GameNGen §5.1): which of two clips of the same actions is the real game?

The paper's raters picked the real game 58% of the time for 1.6 s clips and 60% for 3.2 s. Each clip:
the real game plays some steps (sticky-random actions, or a recording's actions from its seed), its last
N frames fill the neural context, then the same actions drive both engines for `seconds`. The two clips
are shown in random order; the rater answers 1/A or 2/B. Every answer is appended (and flushed) to a
JSONL file; the fraction correct comes with a Wilson 95% interval. `auto=True` replaces the human with a
rater that picks the sharper clip (`metrics.gradient_energy`), so the test itself can be tested.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import metrics as M
from .actions import NOOP, Action, StickyRandomPolicy
from .config import TICS_PER_SECOND, WINDOW_SCALE, GameConfig
from .recording import Recording, unwritable
from .window import Window, check_display

WARMUP_SPREAD = 80  # random extra real steps before a random-play clip, so clips start in different places
PAPER = {1.6: 0.58, 3.2: 0.60}


class AbtestError(ValueError):
    """An A/B test that cannot run as asked."""


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for k successes out of n (95% for z = 1.96); (0, 1) when n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    center = (p + z * z / (2 * n)) / d
    half = z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def summarize(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Fraction of answers that picked the real clip, with its Wilson 95% interval."""
    n = len(answers)
    k = sum(1 for a in answers if a["answer"] == a["real_is"])
    lo, hi = wilson(k, n)
    return {"answers": n, "correct": k, "fraction": k / n if n else None, "ci95": [lo, hi]}


def read_answers(path: str | Path) -> list[dict[str, Any]]:
    """All answers in a JSONL file (a torn last line from a killed run is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class Clip:
    """The same actions through both engines, from the same real context; shown as A then B."""

    index: int
    seed: int
    start: int  # real steps played before the clip (its context ends there)
    actions: list[Action]
    real: np.ndarray  # (T, H, W, 3) uint8
    neural: np.ndarray  # (T, H, W, 3) uint8
    real_is: str  # "A" or "B"

    @property
    def a(self) -> np.ndarray:
        return self.real if self.real_is == "A" else self.neural

    @property
    def b(self) -> np.ndarray:
        return self.neural if self.real_is == "A" else self.real


def clip_frames(seconds: float, frame_skip: int) -> int:
    return max(1, int(round(seconds * TICS_PER_SECOND / frame_skip)))


def make_clips(real: Any, neural: Any, count: int, frames: int, rng: np.random.Generator, seed: int = 0,
               recording: Recording | None = None) -> Iterator[Clip]:
    """`count` clips of `frames` steps. Random play (seeds seed, seed+1…) or a recording's episodes."""
    n = neural.n
    episodes = []
    if recording is not None:
        episodes = [(s, e) for s, e in recording.episodes()
                    if int(recording.steps["seed"][s]) >= 0 and e - s > frames]
        if not episodes:
            raise AbtestError(f"{recording.path} has no seeded episode longer than {frames} steps")
    made, attempt = 0, 0
    while made < count:
        if attempt > 4 * count + 10:
            raise AbtestError("the real game keeps ending before a clip is complete (the player dies?)")
        attempt += 1
        hist: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=n)
        if recording is not None:  # replay a recorded episode from its seed up to a random start
            s, e = episodes[int(rng.integers(len(episodes)))]
            ep_seed = int(recording.steps["seed"][s])
            acts = [Action.from_code(c) for c in recording.actions[s:e]]
            start = int(rng.integers(min(n - 1, e - s - frames), e - s - frames + 1))
            clip_actions = acts[start:start + frames]
            warm_actions: list[Action] = acts[:start]
        else:
            ep_seed = seed + attempt - 1
            policy = StickyRandomPolicy(np.random.default_rng([seed, attempt]))
            start = n - 1 + int(rng.integers(WARMUP_SPREAD + 1))
            warm_actions = [policy() for _ in range(start)]
            clip_actions = [policy() for _ in range(frames)]
        frame = real.reset(ep_seed)
        hist.append((frame.copy(), NOOP.code))
        for a in warm_actions:
            frame = real.step(a)
            hist.append((frame.copy(), a.code))
        neural.reset(ep_seed)
        neural.set_context(*map(np.stack, zip(*hist, strict=True)))
        r, g = [], []
        for a in clip_actions:
            r.append(real.step(a).copy())
            g.append(neural.step(a))
        if real.done:
            continue
        yield Clip(made, ep_seed, start, clip_actions, np.stack(r), np.stack(g),
                   "A" if rng.random() < 0.5 else "B")
        made += 1


def sharper_rater(clip: Clip) -> str:
    """The automatic rater: the sharper clip is the real one (the neural engine blurs)."""
    return "A" if M.gradient_energy(clip.a) >= M.gradient_energy(clip.b) else "B"


class PairView:
    """One clip pair in the window: clip A, a pause, clip B, a pause, then the question until answered.

    1/A or 2/B answers at any moment, also while the clips play; Space at the question replays them.
    """

    prefix = "neuraldoom-ab"

    def __init__(self, clip: Clip, number: int, total: int, gap: int) -> None:
        import pygame

        self.keys = {pygame.K_1: "A", pygame.K_a: "A", pygame.K_KP1: "A", pygame.K_2: "B", pygame.K_b: "B",
                     pygame.K_KP2: "B", pygame.K_SPACE: "replay"}
        end = [None] * gap  # "end of clip" shown for `gap` ticks
        self.timeline = ([(f, f"clip A   ({number}/{total})") for f in clip.a] + [(f, "end of clip A") for f in end]
                         + [(f, f"clip B   ({number}/{total})") for f in clip.b] + [(f, "end of clip B") for f in end])
        self.pos, self.answer = -1, None  # pos: the timeline entry on screen; past its end, the question

    @property
    def steps(self) -> int:
        return max(self.pos, 0)

    @property
    def done(self) -> bool:
        return self.answer is not None

    def start(self, win: Window) -> None:
        pass

    def command(self, cmd: str, win: Window) -> None:
        if cmd in ("A", "B"):
            self.answer = cmd
        elif cmd == "replay" and self.pos >= len(self.timeline):
            self.pos = -1

    def advance(self, win: Window) -> None:
        if not win.paused and self.pos < len(self.timeline):
            self.pos += 1

    def draw(self, win: Window) -> None:
        win.clear()
        if self.pos < len(self.timeline):
            frame, label = self.timeline[self.pos]
            if frame is not None:
                win.draw_frame(frame)
            lines = [label]
        else:
            lines = ["Which clip was the real game?", "1 / A   or   2 / B", "Space: replay   Esc: quit"]
        win.text(lines, (6, 6))


class HumanRater:
    """A window that plays clip A, then clip B, then waits for 1/A or 2/B (Space replays, Esc quits)."""

    def __init__(self, height: int, width: int, scale: int = WINDOW_SCALE,
                 fps: float = TICS_PER_SECOND / GameConfig.frame_skip,
                 headless: bool = False) -> None:
        self.win = Window("neuraldoom A/B test: which clip is the real game?", scale, headless, max(18, 7 * scale))
        self.win.resize((width * scale, height * scale))
        self.fps, self.headless = fps, headless

    def __call__(self, clip: Clip, number: int, total: int) -> str | None:
        """The rater's answer 'A' or 'B' for this clip, or None when they quit."""
        view = PairView(clip, number, total, gap=max(1, round(0.4 * self.fps)))
        how = self.win.run(view, fps=0.0 if self.headless else self.fps)
        if how == "interrupt":
            raise KeyboardInterrupt
        return view.answer if how == "done" else None

    def close(self) -> None:
        self.win.close()


def run_abtest(checkpoint: str | Path, clips: int = 10, seconds: float = 1.6, answers: str | Path = "abtest.jsonl",
               auto: bool = False, compile: bool = False, seed: int | None = None, scale: int = WINDOW_SCALE,
               recording: str | Path | None = None, headless: bool = False,
               rater: Callable[[Clip, int, int], str | None] | None = None) -> dict[str, Any]:
    """Run a blind A/B test; every answer is appended to `answers`. Returns this session's summary."""
    if clips < 1:
        raise AbtestError(f"--clips must be >= 1, got {clips}")
    if seconds <= 0:
        raise AbtestError(f"--seconds must be > 0, got {seconds}")
    answers = Path(answers)
    why = unwritable(answers, folder=False)  # before anything starts
    if why:
        raise AbtestError(f"cannot append answers to {answers}: {why}")
    if not auto and rater is None:
        check_display(headless)  # before the engines start
    from .checkpoint import Checkpoint
    from .engine import NeuralEngine
    from .game import RealGame

    ckpt = Checkpoint(checkpoint)
    rec = None
    game = replace(ckpt.game, episode_timeout=0)
    if recording is not None:
        from .replay import check_compatible

        rec = Recording(recording)
        check_compatible(rec, ckpt.game)
        game = rec.game if rec.meta.get("engine", "real") == "real" else game
    seed = int(np.random.default_rng().integers(2**31 - 1)) if seed is None else seed
    rng = np.random.default_rng(seed)
    T = clip_frames(seconds, ckpt.game.frame_skip)
    rater_name = "auto-sharpness" if auto else getattr(rater, "name", "human")
    session = time.strftime("%Y%m%dT%H%M%S") + f"-{seed}"
    got: list[dict[str, Any]] = []
    neural = real = None
    try:
        neural = NeuralEngine(ckpt, compile=compile, seed=seed)
        real = RealGame(game)
        if rater is None:
            rater = (lambda clip, i, n: sharper_rater(clip)) if auto else HumanRater(
                ckpt.game.height, ckpt.game.width, scale, TICS_PER_SECOND / ckpt.game.frame_skip, headless)
        try:
            answers.parent.mkdir(parents=True, exist_ok=True)
            f = open(answers, "a")
        except OSError as e:
            raise AbtestError(f"cannot append answers to {answers}: {e.strerror}") from None
        with f:
            for clip in make_clips(real, neural, clips, T, rng, seed, rec):
                t0 = time.perf_counter()
                answer = rater(clip, clip.index + 1, clips)
                if answer is None:
                    break
                if answer not in ("A", "B"):
                    raise AbtestError(f"rater answered {answer!r}, expected 'A' or 'B'")
                row = {
                    "session": session, "clip": clip.index, "seed": clip.seed, "start": clip.start,
                    "frames": len(clip.actions), "seconds": seconds, "real_is": clip.real_is, "answer": answer,
                    "correct": answer == clip.real_is, "rater": rater_name,
                    "response_s": round(time.perf_counter() - t0, 3),
                    "psnr": round(M.psnr(clip.neural, clip.real), 3),
                    "sharpness": round(M.sharpness(clip.neural, clip.real), 4),
                    "checkpoint": str(checkpoint), "source": f"recording:{rec.path}" if rec else "random",
                    "actions": [a.code.tolist() for a in clip.actions],
                }
                try:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                except OSError as e:
                    raise AbtestError(f"cannot append answers to {answers}: {e.strerror}") from None
                got.append(row)
    finally:
        for thing in (real, neural, rater):
            close = getattr(thing, "close", None)
            if close is not None:
                close()
    return {"session": session, "seconds": seconds, "frames": T, "rater": rater_name,
            "answers_file": str(answers), **summarize(got)}


def summary_line(s: dict[str, Any]) -> str:
    if not s["answers"]:
        return f"neuraldoom: abtest: no answers given; nothing appended to {s['answers_file']}"
    lo, hi = s["ci95"]
    paper = PAPER.get(round(s["seconds"], 1))
    ref = f"; paper §5.1: {paper:.0%} at {s['seconds']:g} s" if paper else ""
    return (f"neuraldoom: abtest ({s['rater']}, {s['seconds']:g} s clips): real game picked {s['correct']}/"
            f"{s['answers']} = {s['fraction']:.1%} (95% CI {lo:.1%}-{hi:.1%}; chance 50%){ref}; "
            f"answers appended to {s['answers_file']}")


__all__ = ["run_abtest", "wilson", "summarize", "read_answers", "make_clips", "sharper_rater", "HumanRater", "PairView",
           "Clip", "AbtestError", "summary_line"]
