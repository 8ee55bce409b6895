"""The `neuraldoom` command's edges: every user error is one line on stderr, exit 2, nothing lost."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from neuraldoom import cli
from neuraldoom.actions import NOOP
from neuraldoom.config import GameConfig
from neuraldoom.game import vizdoom_root
from neuraldoom.recording import Recording, RecordingWriter

PACKAGE = Path(__file__).resolve().parent.parent / "neuraldoom"


def one_line_error(err: str, contains: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    assert lines[0].startswith("neuraldoom: ") and contains in lines[0], lines[0]


@pytest.fixture
def small_rec(tmp_path):
    """A 6-frame recording written directly (no game): enough to export."""
    cfg = GameConfig()
    path = tmp_path / "rec"
    rng = np.random.default_rng(0)
    with RecordingWriter(path, cfg) as w:
        w.new_episode(1)
        for _ in range(6):
            w.add(rng.integers(0, 256, (cfg.height, cfg.width, 3), dtype=np.uint8), NOOP)
    return path


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where, contains", [
    ("afile/out.mp4", "is a file, not a folder"),  # the parent is a regular file
    ("afile/deeper/out.mp4", "is a file, not a folder"),
    ("adir", "it is a folder"),
    ("/proc/neuraldoom-test/out.mp4", "cannot write a video to"),  # unwritable even for root
    ("/proc/neuraldoom-test.mp4", "cannot write a video to"),
])
def test_export_to_an_unwritable_path(small_rec, tmp_path, capsys, where, contains):
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "adir").mkdir()
    before = files(tmp_path)
    out = where if where.startswith("/") else str(tmp_path / where)
    assert cli.main(["export", str(small_rec), out]) == 2
    one_line_error(capsys.readouterr().err, contains)
    assert files(tmp_path) == before, "a failed export changed files"


def test_export_never_overwrites_the_recording_itself(small_rec, capsys):
    before = files(small_rec)
    assert cli.main(["export", str(small_rec), str(small_rec / "frames.u8")]) == 2
    one_line_error(capsys.readouterr().err, "part of the recording")
    assert files(small_rec) == before and len(Recording(small_rec)) == 6


def test_a_failed_export_keeps_the_old_video(small_rec, tmp_path, capsys, monkeypatch):
    out = tmp_path / "old.mp4"
    assert cli.main(["export", str(small_rec), str(out)]) == 0
    capsys.readouterr()
    old = out.read_bytes()
    import imageio_ffmpeg

    real_write_frames = imageio_ffmpeg.write_frames

    class DiesMidway:  # ffmpeg gone after two frames (disk full, killed)
        def __init__(self, *args, **kw):
            self.gen, self.sent = real_write_frames(*args, **kw), 0

        def send(self, frame):
            if frame is not None:
                self.sent += 1
                if self.sent > 2:
                    raise BrokenPipeError(32, "Broken pipe")
            return self.gen.send(frame)

        def close(self):
            self.gen.close()

    monkeypatch.setattr(imageio_ffmpeg, "write_frames", DiesMidway)
    assert cli.main(["export", str(small_rec), str(out)]) == 2
    one_line_error(capsys.readouterr().err, "cannot write a video to")
    assert out.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.mp4", "rec"], "the partial file was left behind"


def test_scenario_cfg_is_refused_in_one_line(tmp_path, capsys):
    cfg = vizdoom_root() / "scenarios" / "basic.cfg"
    rc = cli.main(["play", "--engine", "real", "--headless", "--frames", "2", "--input", "random",
                   "--scenario", str(cfg), "--record", str(tmp_path / "rec")])
    assert rc == 2
    err = capsys.readouterr().err
    one_line_error(err, ".cfg")
    assert "basic.wad map MAP01" in err, err  # says which WAD and map the config plays
    assert not (tmp_path / "rec").exists()
    # the WAD it names plays
    rc = cli.main(["play", "--engine", "real", "--headless", "--frames", "2", "--input", "random",
                   "--scenario", str(cfg.with_suffix(".wad")), "--wad", "freedoom2.wad", "--map", "MAP01"])
    assert rc == 0 and "2 steps" in capsys.readouterr().out


def test_no_module_imports_another_modules_private_helpers():
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert offenders == []


def test_one_parser_switches_true_bools_off_and_takes_positionals():
    from dataclasses import dataclass, field

    from neuraldoom.config import parse_args

    @dataclass(frozen=True)
    class Flags:
        paths: tuple[str, ...] = field(metadata={"positional": True})
        ema: bool = True
        fast: bool = False
        rate: float = 0.5

    assert parse_args(Flags, ["a", "b"]) == Flags(("a", "b"))
    assert parse_args(Flags, ["a", "--no-ema", "--fast", "--rate", "2"]) == Flags(("a",), False, True, 2.0)


def test_one_game_check_names_what_differs():
    from dataclasses import replace

    from neuraldoom.config import GameConfig, game_mismatch

    g = GameConfig()
    assert game_mismatch(g, g) is None
    assert game_mismatch(replace(g, wad="/x/FREEDOOM1.WAD"), g) is None  # the same WAD elsewhere
    assert "320x240" in game_mismatch(replace(g, width=320, height=240), g)
    assert "frame_skip=4" in game_mismatch(replace(g, frame_skip=4), g)
    assert "hud=False" in game_mismatch(replace(g, hud=False), g)
    assert "doom2.wad" in game_mismatch(replace(g, wad="doom2.wad"), g)
