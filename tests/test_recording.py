"""The recording format: round trips, lazy reads, damaged files, a writer killed mid-episode, MP4 export."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from neuraldoom import actions as A
from neuraldoom.config import GameConfig
from neuraldoom.game import GAME_VARIABLES
from neuraldoom.recording import STEP_DTYPE, Recording, RecordingError, RecordingWriter, find_recordings


def test_round_trip(recorded, small_game_cfg):
    path, frames, acts = recorded
    rec = Recording(path)
    assert len(rec) == 70
    assert rec.game == small_game_cfg
    assert np.array_equal(rec.frames, np.stack(frames))
    assert np.array_equal(rec.actions, A.encode(acts))
    assert A.decode(rec.actions) == acts
    assert rec.episodes() == [(0, 40), (40, 70)]
    assert rec.steps["t"][:3].tolist() == [0, 1, 2] and rec.steps["t"][40] == 0
    assert rec.steps["vars"].shape == (70, len(GAME_VARIABLES))
    assert rec.steps["vars"][0][GAME_VARIABLES.index("HEALTH")] == 100
    s = rec.summary()
    assert (s["frames"], s["episodes"], s["height"], s["width"], s["frame_skip"]) == (70, 2, 120, 160, 2)
    assert s["seeds"] == [11, 12] and s["engine"] == "real"
    assert find_recordings(path.parent) == [path]


def test_reads_are_memory_mapped(recorded):
    rec = Recording(recorded[0])
    assert isinstance(rec.frames, np.memmap) and isinstance(rec.steps, np.memmap)
    assert rec.frames.shape == (70, 120, 160, 3) and rec.frames.dtype == np.uint8


def test_empty_recording(tmp_path):
    RecordingWriter(tmp_path / "r", GameConfig()).close()
    rec = Recording(tmp_path / "r")
    assert len(rec) == 0 and rec.episodes() == [] and rec.summary()["frames"] == 0
    assert rec.frames.shape == (0, 120, 160, 3)


def test_truncated_files_read_whole_rows_only(recorded):
    path = recorded[0]
    fbytes = 120 * 160 * 3
    with open(path / "frames.u8", "r+b") as f:
        f.truncate(60 * fbytes + fbytes // 2)  # half a frame at the end
    assert len(Recording(path)) == 60
    with open(path / "steps.bin", "r+b") as f:
        f.truncate(50 * STEP_DTYPE.itemsize + 5)
    rec = Recording(path)
    assert len(rec) == 50
    assert np.array_equal(rec.frames[49], recorded[1][49])
    assert rec.episodes() == [(0, 40), (40, 50)]


@pytest.mark.parametrize("damage, match", [
    (lambda p: (p / "meta.json").write_text("{not json"), "corrupt"),
    (lambda p: (p / "meta.json").unlink(), "not a recording"),
    (lambda p: (p / "steps.bin").unlink(), "steps.bin is missing"),
    (lambda p: (p / "meta.json").write_text(json.dumps({**json.loads((p / "meta.json").read_text()),
                                                        "buttons": ["JUMP"]})), "another action set"),
])
def test_damaged_recordings_raise_recording_error(recorded, damage, match):
    path = recorded[0]
    damage(path)
    with pytest.raises(RecordingError, match=match):
        Recording(path)


def test_writer_refuses_bad_input(tmp_path, recorded):
    with pytest.raises(RecordingError, match="already holds a recording"):
        RecordingWriter(recorded[0], GameConfig())
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecordingError, match="cannot write"):
        RecordingWriter(tmp_path / "file" / "rec", GameConfig())
    with RecordingWriter(tmp_path / "w", GameConfig()) as w:
        with pytest.raises(RecordingError, match="does not match"):
            w.add(np.zeros((128, 160, 3), np.uint8), A.NOOP)
        with pytest.raises(RecordingError, match="does not match"):
            w.add(np.zeros((120, 160, 3), np.float32), A.NOOP)
    with pytest.raises(RecordingError, match="no recordings"):
        find_recordings(tmp_path / "file")


KILLED_WRITER = """
import sys, time
import numpy as np
from neuraldoom.actions import StickyRandomPolicy
from neuraldoom.config import GameConfig
from neuraldoom.game import RealGame
from neuraldoom.recording import RecordingWriter
out = sys.argv[1]
policy = StickyRandomPolicy(np.random.default_rng(0))
g = RealGame(GameConfig())
w = RecordingWriter(out, GameConfig(), flush_every=10)
frame = g.reset(3)
w.new_episode(3)
for i in range(45):  # 4 flushes (40 rows), 5 rows pending
    a = policy()
    w.add(frame, a, g.variables)
    frame = g.step(a)
print("written", flush=True)
time.sleep(60)  # killed here, mid-episode, without close()
"""


def test_sigkilled_writer_leaves_a_readable_recording(tmp_path, subprocess_env):
    from neuraldoom.game import RealGame

    out = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True,
                         env=subprocess_env)
    try:
        assert p.stdout.readline().strip() == "written"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    finally:
        p.kill()
        p.wait()
    rec = Recording(out)
    assert 40 <= len(rec) <= 45, "rows up to the last flush must survive a SIGKILL"
    # the surviving rows are exactly what the game produced: replay the same seed and actions here
    policy = A.StickyRandomPolicy(np.random.default_rng(0))
    with RealGame(GameConfig()) as g:
        frame = g.reset(3)
        for i in range(len(rec)):
            a = policy()
            assert np.array_equal(rec.frames[i], frame), f"row {i} frame differs"
            assert rec.actions[i].tolist() == [a.buttons, a.turn]
            frame = g.step(a)
    assert rec.episodes() == [(0, len(rec))] and rec.summary()["seeds"] == [3]


def test_export_mp4(recorded, tmp_path):
    out = Recording(recorded[0]).export_mp4(tmp_path / "video" / "r.mp4", scale=2)
    data = out.read_bytes()
    assert len(data) > 1000
    assert data[4:8] == b"ftyp", "not an MP4 container"


def test_atomic_outputs_keep_the_old_file_when_a_write_fails(tmp_path):
    from neuraldoom.files import atomic_path, write_text

    f = tmp_path / "report.json"
    write_text(f, "old")
    with pytest.raises(RuntimeError), atomic_path(f) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert f.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    write_text(f, "new")
    assert f.read_text() == "new" and len(list(tmp_path.iterdir())) == 1
