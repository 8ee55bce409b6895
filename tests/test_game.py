"""The real ViZDoom, headless, behind the engine protocol."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from neuraldoom.actions import Action, ActionError, StickyRandomPolicy
from neuraldoom.config import GameConfig
from neuraldoom.game import GAME_VARIABLES, GameError, RealGame


def play(cfg: GameConfig, seed: int, actions: list[Action]) -> list[np.ndarray]:
    with RealGame(cfg) as g:
        frames = [g.reset(seed).copy()]
        frames += [g.step(a).copy() for a in actions]
    return frames


def random_actions(n: int, seed: int = 0) -> list[Action]:
    p = StickyRandomPolicy(np.random.default_rng(seed))
    return [p() for _ in range(n)]


def test_shapes_dtypes_and_variables():
    with RealGame(GameConfig()) as g:
        f = g.reset(1)
        assert f.shape == (120, 160, 3) and f.dtype == np.uint8 and f.flags.c_contiguous
        assert f.std() > 5  # a real picture, not a blank buffer
        assert g.variables.shape == (len(GAME_VARIABLES),)
        assert g.var("HEALTH") == 100
        x0 = g.var("POSITION_X"), g.var("POSITION_Y")
        for _ in range(20):
            f2 = g.step(Action.of("MOVE_FORWARD"))
        assert f2.shape == f.shape and f2.dtype == np.uint8
        assert (g.var("POSITION_X"), g.var("POSITION_Y")) != x0, "walking forward should move the player"
        assert not g.done
        with pytest.raises(ActionError):
            g.step([1, 0, 0, 0, 0, 0, 0])  # type: ignore[arg-type]


def test_other_resolution():
    with RealGame(GameConfig(width=320, height=240)) as g:
        assert g.reset(0).shape == (240, 320, 3)


def test_same_seed_same_actions_give_identical_frames():
    acts = random_actions(150)
    a = play(GameConfig(), 7, acts)
    b = play(GameConfig(), 7, acts)
    assert len(a) == len(b) == 151
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert np.array_equal(x, y), f"frame {i} differs between two games with the same seed"
    assert not np.array_equal(a[0], a[-1])  # the random walk did go somewhere


def test_reseeding_reproduces_an_episode_in_one_game():
    acts = random_actions(60, seed=3)
    with RealGame(GameConfig()) as g:
        runs, states = [], []
        for _ in range(3):
            frames = [g.reset(5).copy()] + [g.step(a).copy() for a in acts]
            runs.append(np.stack(frames))
            states.append(g.variables.copy())
    # Measured: the first episode after init can differ from later ones with the same seed in a few
    # frames of the weapon sprite only (rows ~74-99 at 160x120); the game state is identical.
    assert np.array_equal(runs[1], runs[2])
    assert np.array_equal(states[0], states[1]) and np.array_equal(states[1], states[2])


def test_different_seeds_differ():
    acts = random_actions(300, seed=1)
    a = np.stack(play(GameConfig(), 1, acts))
    b = np.stack(play(GameConfig(), 2, acts))
    assert not np.array_equal(a, b)


def test_episode_timeout_sets_done_and_step_after_end_is_harmless():
    with RealGame(GameConfig(episode_timeout=20, frame_skip=4)) as g:
        g.reset(0)
        n = 0
        while not g.done:
            last = g.step(Action())
            n += 1
            assert n < 50
        assert 4 <= n <= 6
        assert np.array_equal(g.step(Action()), last)
        g.reset(1)
        assert not g.done


@pytest.mark.parametrize(
    "change, match",
    [({"wad": "nosuch.wad"}, "unknown WAD"), ({"scenario": "nosuch"}, "unknown scenario"),
     ({"map": "E9M9"}, "unknown map 'E9M9'"), ({"map": "MAP01"}, "unknown map"),
     ({"width": 123, "height": 45}, "unsupported resolution")],
)
def test_bad_game_configs_raise_game_error(change, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GameError, match=match):
        RealGame(replace(GameConfig(), **change))
    assert os.getcwd() == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_no_litter_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with RealGame(GameConfig()) as g:
        g.reset(0)
        for _ in range(10):
            g.step(Action.of("ATTACK"))
        tmp = Path(g._tmp)
        assert tmp.is_dir()
    assert os.getcwd() == str(tmp_path)
    assert list(tmp_path.iterdir()) == [], "the engine wrote into the user's folder"
    assert not tmp.exists(), "the private engine folder outlived close()"


CHILD = """
import sys, time
from pathlib import Path
from neuraldoom.game import RealGame
g = RealGame()
g.reset(0)
me = Path(f"/proc/{__import__('os').getpid()}/task")
kids = [int(p) for t in me.iterdir() for p in (t / "children").read_text().split()]
engine = [k for k in kids if Path(f"/proc/{k}/comm").read_text().strip() == "vizdoom"]
print(engine[0], g._tmp, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead; only its parent has not reaped it yet


def test_engine_dies_with_a_sigkilled_parent(subprocess_env):
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=subprocess_env)
    try:
        pid, tmp = p.stdout.readline().split()
        engine = int(pid)
        assert Path(tmp).is_dir()
        assert _alive(engine)
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.time() + 3.0
        while _alive(engine) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(engine), f"ViZDoom engine {engine} outlived its SIGKILLed parent"
        while Path(tmp).exists() and time.time() < deadline + 1.0:
            time.sleep(0.05)
        assert not Path(tmp).exists(), "the engine's private folder outlived a SIGKILLed parent"
    finally:
        p.kill()
        p.wait()
