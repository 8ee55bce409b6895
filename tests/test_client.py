"""The play client and the `neuraldoom` command, driven headless with the real engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pygame
import pytest

from neuraldoom import actions as A
from neuraldoom import cli, client, controls
from neuraldoom.config import GameConfig
from neuraldoom.game import RealGame
from neuraldoom.recording import Recording

REPO = Path(__file__).resolve().parent.parent


def one_line_error(err: str, contains: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    assert lines[0].startswith("neuraldoom: ") and contains in lines[0], lines[0]


def test_main_py_headless_record_then_inspect(tmp_path, subprocess_env):
    rec = tmp_path / "session"
    r = subprocess.run([sys.executable, str(REPO / "main.py"), "--engine", "real", "--headless", "--frames", "300",
                        "--input", "random", "--seed", "4", "--record", str(rec)],
                       capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "300 steps" in r.stdout and "ms/frame" in r.stdout
    assert os.listdir(tmp_path) == ["session"], "the client littered the working directory"
    r = subprocess.run([sys.executable, "-m", "neuraldoom.cli", "inspect", str(rec)],
                       capture_output=True, text=True, env=subprocess_env, timeout=30)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1
    s = json.loads(r.stdout)
    assert (s["frames"], s["height"], s["width"], s["frame_skip"]) == (300, 120, 160, 2)
    assert s["engine"] == "real" and s["seeds"][0] == 4


def run_keyboard(tmp_path, script: dict[int, list[pygame.event.Event]], frames: int | None = 40, **kw):
    """Run the client with keyboard input; post script[i] right after step i. Returns (stats, actions)."""
    seen: list[A.Action] = []

    def on_step(i: int, action: A.Action, frame: np.ndarray) -> None:
        seen.append(action)
        for e in script.get(i, []):
            pygame.event.post(e)

    opts = client.ClientOptions(engine_name="real", seed=2, headless=True, frames=frames, input="keyboard",
                                record=tmp_path / "rec", **kw)
    with RealGame(GameConfig()) as game:
        stats = client.run(game, opts, on_step=on_step)
    return stats, seen


def key(down: bool, k: int) -> pygame.event.Event:
    return pygame.event.Event(pygame.KEYDOWN if down else pygame.KEYUP, key=k, mod=0)


def test_posted_events_drive_the_game(tmp_path):
    W, RIGHT, SPACE = pygame.K_w, pygame.K_RIGHT, pygame.K_SPACE
    stats, seen = run_keyboard(tmp_path, {
        9: [key(True, W)],
        19: [key(True, RIGHT), pygame.event.Event(pygame.MOUSEBUTTONDOWN, button=1, pos=(0, 0))],
        24: [pygame.event.Event(pygame.MOUSEMOTION, rel=(-40, 0), pos=(0, 0), buttons=(0, 0, 0))],
        29: [key(False, W), key(False, RIGHT), pygame.event.Event(pygame.MOUSEBUTTONUP, button=1, pos=(0, 0)),
             key(True, SPACE)],
    })
    assert stats["steps"] == 40 and stats["quit"] == "frames"
    assert all(a == A.NOOP for a in seen[:10])
    assert all(a.pressed() == ("MOVE_FORWARD",) and a.turn == A.NO_TURN for a in seen[10:20])
    assert seen[20] == A.Action.of("MOVE_FORWARD", "ATTACK", turn=4.0)  # right arrow: +4 deg/tic
    # -40 px * 0.25 deg/px / 2 tics = -5 deg/tic -> the -4 bucket; the mouse wins over the held arrow key
    assert seen[25] == A.Action.of("MOVE_FORWARD", "ATTACK", turn=-4.0)
    assert seen[26] == A.Action.of("MOVE_FORWARD", "ATTACK", turn=4.0)  # motion is consumed per step
    assert all(a == A.Action.of("USE") for a in seen[30:])
    rec = Recording(tmp_path / "rec")
    assert len(rec) == 40 and A.decode(rec.actions) == seen
    pos = rec.steps["vars"][:, [13, 14]]
    assert np.array_equal(pos[0], pos[10]), "the player moved before any key"
    assert not np.array_equal(pos[10], pos[20]), "holding W did not move the player"


def test_keyboard_mapping_reads_posted_events_not_get_pressed():
    pygame.display.init()
    try:
        pygame.display.set_mode((8, 8))
        km = controls.KeyboardMouse(frame_skip=2)
        for k in (pygame.K_w, pygame.K_a, pygame.K_LCTRL):
            pygame.event.post(key(True, k))
        pygame.event.post(key(True, pygame.K_ESCAPE))
        cmds = [km.handle(e) for e in pygame.event.get()]
        assert controls.QUIT in cmds
        assert km.action() == A.Action.of("MOVE_FORWARD", "MOVE_LEFT", "ATTACK")
        pygame.event.post(key(False, pygame.K_w))
        pygame.event.post(pygame.event.Event(pygame.WINDOWFOCUSLOST))
        for e in pygame.event.get():
            km.handle(e)
        assert km.action() == A.NOOP, "keys must not stay held after the window loses focus"
    finally:
        pygame.quit()


def test_window_close_and_errors_still_close_the_recording(tmp_path):
    stats, seen = run_keyboard(tmp_path, {19: [pygame.event.Event(pygame.QUIT)]}, frames=None, uncapped=True)
    assert stats["quit"] == "user" and stats["steps"] == 20
    assert len(Recording(tmp_path / "rec")) == 20  # flush_every is 32: only close() writes these rows

    def boom(i: int, action: A.Action, frame: np.ndarray) -> None:
        if i == 5:
            raise RuntimeError("engine fell over")

    with RealGame(GameConfig()) as game, pytest.raises(RuntimeError, match="fell over"):
        client.run(game, client.ClientOptions(headless=True, frames=50, input="random", record=tmp_path / "r2"),
                   on_step=boom)
    assert len(Recording(tmp_path / "r2")) == 6


def test_episode_end_resets_with_the_next_seed(tmp_path):
    with RealGame(GameConfig(episode_timeout=40)) as game:  # 20 steps per episode
        stats = client.run(game, client.ClientOptions(engine_name="real", seed=7, headless=True, frames=50,
                                                      input="random", record=tmp_path / "rec"))
    assert stats["episodes"] == 3
    rec = Recording(tmp_path / "rec")
    assert rec.episodes() == [(0, 20), (20, 40), (40, 50)]
    assert rec.summary()["seeds"] == [7, 8, 9]


def test_no_display_is_one_line_and_exit_2(subprocess_env):
    env = {k: v for k, v in subprocess_env.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER")}
    r = subprocess.run([sys.executable, str(REPO / "main.py"), "--engine", "real"], capture_output=True, text=True,
                       env=env, timeout=30)
    assert r.returncode == 2
    one_line_error(r.stderr, "no display")


@pytest.mark.parametrize("where, contains", [("file/rec", "is a file"), ("existing", "already holds")])
def test_unwritable_record_path_fails_before_the_game(tmp_path, capsys, monkeypatch, where, contains):
    (tmp_path / "file").write_text("x")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "meta.json").write_text("{}")
    started = []
    monkeypatch.setattr(cli, "make_engine", lambda a: started.append(a))
    code = cli.main(["play", "--engine", "real", "--headless", "--frames", "5", "--record", str(tmp_path / where)])
    assert code == 2 and not started
    one_line_error(capsys.readouterr().err, contains)


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["play", "--headless", "--frames", "1", "--checkpoint", str(tmp_path / "none")]) == 2
    one_line_error(capsys.readouterr().err, f"no neural checkpoint at {tmp_path / 'none'}")
    assert cli.main(["play", "--engine", "real", "--headless", "--frames", "1", "--map", "E9M9"]) == 2
    one_line_error(capsys.readouterr().err, "unknown map")
    assert cli.main(["inspect", str(tmp_path / "nothing")]) == 2
    one_line_error(capsys.readouterr().err, "does not exist")
    assert cli.main(["export", str(tmp_path), str(tmp_path / "x.mp4")]) == 2
    one_line_error(capsys.readouterr().err, "not a recording")


def test_default_checkpoint_is_relative_to_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.resolve_checkpoint(None) == REPO / "checkpoints" / "e1m1"


def test_export_command(recorded, tmp_path, capsys):
    out = tmp_path / "out.mp4"
    assert cli.main(["export", str(recorded[0]), str(out)]) == 0
    assert out.stat().st_size > 1000 and "70 frames" in capsys.readouterr().out


def test_client_plays_the_neural_engine_headless(tiny_checkpoint, tmp_path, capsys):
    from neuraldoom.cli import main
    from neuraldoom.recording import Recording

    rec = tmp_path / "neural_session"
    assert main(["play", "--checkpoint", str(tiny_checkpoint), "--no-compile", "--headless", "--frames", "5",
                 "--input", "random", "--record", str(rec)]) == 0
    r = Recording(rec)
    assert len(r) == 5 and r.meta["engine"] == "neural" and r.frames.shape[1:] == (120, 160, 3)


def test_f12_saves_a_screenshot_and_never_overwrites_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    f12 = key(True, pygame.K_F12)
    stats, _ = run_keyboard(tmp_path, {2: [f12, f12]}, frames=6)  # twice in one tick: same step, same second
    assert stats["steps"] == 6 and stats["quit"] == "frames"
    shots = sorted(tmp_path.glob("neuraldoom-*.png"))
    assert len(shots) == 2, shots
    for shot in shots:
        assert pygame.image.load(str(shot)).get_size() == (160 * 4, 120 * 4)
    err = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in err] == ["screenshot", "screenshot"], err


def test_f12_in_an_unwritable_folder_does_not_end_the_game(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir("/proc")  # not writable, even for root
    stats, seen = run_keyboard(tmp_path, {2: [key(True, pygame.K_F12)], 3: [key(True, pygame.K_w)]}, frames=8)
    assert stats["steps"] == 8 and stats["quit"] == "frames" and len(seen) == 8
    assert seen[4] == A.Action.of("MOVE_FORWARD"), "play goes on after the failed screenshot"
    assert len(Recording(tmp_path / "rec")) == 8
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("neuraldoom: screenshot failed"), err


def test_window_shows_a_failed_screenshot_on_screen(monkeypatch):
    from neuraldoom.window import Window

    with Window("test", scale=1, headless=True) as win:
        win.resize((32, 24))
        monkeypatch.chdir("/proc")
        assert win.screenshot("neuraldoom", 0) is None
        assert win.notice[0].startswith("screenshot failed: cannot write neuraldoom-")
        win.flip()  # draws the notice


def test_soak_script_plays_posts_its_storm_and_reports(tiny_checkpoint, capsys):
    from neuraldoom import soak

    assert soak.main(["--checkpoint", str(tiny_checkpoint), "--frames", "20", "--events", "300",
                      "--no-compile"]) == 0
    last = dict(kv.split("=") for kv in capsys.readouterr().out.splitlines()[-1].split())
    assert last["soak_frames"] == "20" and last["nonfinite"] == "0" and last["storm_events"] == "300"
    assert last["crashed"] == "0" and int(last["storm_steps"]) >= 30
