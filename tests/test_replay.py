"""`neuraldoom replay`: a recording's actions through the real game, the neural engine, or both."""

from __future__ import annotations

import json

import imageio_ffmpeg
import numpy as np
import pytest
from PIL import Image

from neuraldoom import cli, client
from neuraldoom import metrics as M
from neuraldoom.actions import NOOP
from neuraldoom.config import GameConfig
from neuraldoom.engine import NeuralEngine
from neuraldoom.recording import Recording, RecordingError, RecordingWriter
from neuraldoom.replay import run_replay


def one_line_error(err: str, contains: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    assert lines[0].startswith("neuraldoom: ") and contains in lines[0], lines[0]


def test_replay_both_writes_video_plot_and_json(recorded, tiny_checkpoint, tmp_path):
    path, frames, _ = recorded
    out = tmp_path / "out"
    rep = run_replay(path, "both", tiny_checkpoint, out)
    n = len(frames)  # 70 rows, 2 episodes
    assert sorted(p.name for p in out.iterdir()) == ["psnr.png", "replay.json", "replay.mp4"]
    data = json.loads((out / "replay.json").read_text())
    assert len(data["psnr"]) == len(data["ssim"]) == n == data["frames"]
    assert data["engine"] == "both" and (data["left"], data["right"]) == ("real replay", "neural replay")
    assert data["generated_steps"] == n - 2  # each episode's first frame is the context
    assert data["episode_starts"] == [0, 40] and data["seeds"] == [11, 12]
    psnr = np.array(data["psnr"])
    gen = np.array(data["generated"])
    assert (psnr[~gen] > 140).all(), "context frames are the real ones"
    assert data["mean_psnr"] == pytest.approx(rep["mean_psnr"]) and data["mean_psnr"] < 60
    u = data["first_step_under_20db"]
    assert u is None or (psnr[u] < 20 and gen[u] and not (psnr[:u][gen[:u]] < 20).any())
    with Image.open(out / "psnr.png") as im:
        assert im.format == "PNG" and im.size[0] > 100
    nframes, _ = imageio_ffmpeg.count_frames_and_secs(str(out / "replay.mp4"))
    assert nframes == n


def test_real_recording_replays_byte_for_byte(recorded):
    path, frames, _ = recorded
    rep = run_replay(path, "real")
    assert rep["identical_frames"] == rep["frames"] == len(frames)
    assert rep["left"] == "recording (real)" and rep["checkpoint"] is None


def test_resync_every(recorded, tiny_checkpoint):
    path, frames, _ = recorded
    rep = run_replay(path, "both", tiny_checkpoint, warmup=2, resync_every=5, measure_ssim=False)
    # episode rows [0, 40) and [40, 70): generated from row s+2; re-sync before generated step 5, 10, ...
    expect = [s + 2 + g for s, e in ((0, 40), (40, 70)) for g in range(5, e - s - 2, 5)]
    assert rep["resync_steps"] == expect
    assert rep["generated_steps"] == len(frames) - 4 and rep["mean_ssim"] is None


def test_neural_session_replays_in_the_real_game(tiny_checkpoint, tmp_path):
    rec = tmp_path / "neural-session"
    eng = NeuralEngine.from_checkpoint(tiny_checkpoint, compile=False)
    opts = client.ClientOptions(engine_name="neural", seed=21, headless=True, frames=15, input="random", record=rec)
    client.run(eng, opts)
    assert Recording(rec).meta["engine"] == "neural"
    real = run_replay(rec, "real")  # what would really have happened
    assert real["frames"] == 15 and real["left"] == "recording (neural)" and real["right"] == "real replay"
    neural = run_replay(rec, "neural", tiny_checkpoint)  # compared with the real replay, not with itself
    assert neural["left"] == "real replay" and len(neural["psnr"]) == 15


def test_recording_without_seed_replays_neural_only_with_a_warning(recorded, tiny_checkpoint, tmp_path):
    _, frames, acts = recorded
    path = tmp_path / "noseed"
    with RecordingWriter(path, GameConfig(episode_timeout=200)) as w:
        w.new_episode(None)
        for f, a in zip(frames[:12], acts[:12], strict=True):
            w.add(f, a)
    warnings: list[str] = []
    rep = run_replay(path, "both", tiny_checkpoint, warn=warnings.append)
    assert len(warnings) == 1 and "no game seed" in warnings[0]
    assert rep["engine"] == "neural" and rep["left"] == "recording (real)" and len(rep["psnr"]) == 12


@pytest.mark.parametrize("cfg, word", [(GameConfig(frame_skip=4), "frame_skip=4"),
                                       (GameConfig(width=320, height=240), "320x240"),
                                       (GameConfig(map="E1M2"), "map='E1M2'")])
def test_mismatched_recording_is_one_line_error(tiny_checkpoint, tmp_path, capsys, cfg, word):
    path = tmp_path / "other"
    with RecordingWriter(path, cfg) as w:
        w.new_episode(1)
        for _ in range(3):
            w.add(np.zeros((cfg.height, cfg.width, 3), np.uint8), NOOP)
    with pytest.raises(RecordingError, match=word):
        run_replay(path, "both", tiny_checkpoint)
    rc = cli.main(["replay", str(path), "--engine", "both", "--checkpoint", str(tiny_checkpoint), "--no-compile"])
    assert rc == 2
    one_line_error(capsys.readouterr().err, word)


def test_cli_replay(recorded, tiny_checkpoint, tmp_path, capsys):
    path, frames, _ = recorded
    out = tmp_path / "cli"
    rc = cli.main(["replay", str(path), "--engine", "both", "--out", str(out), "--checkpoint", str(tiny_checkpoint),
                   "--no-compile", "--no-ssim", "--resync-every", "8"])
    printed = capsys.readouterr().out
    assert rc == 0 and "replayed 70 frames (both)" in printed, printed
    data = json.loads((out / "replay.json").read_text())
    assert len(data["psnr"]) == len(frames) and data["resync_every"] == 8
    # every per-step value is the PSNR of the replayed frames, as the metric computes it
    assert data["psnr"][0] == pytest.approx(M.psnr(frames[0], frames[0]), abs=1e-3)
    rc = cli.main(["replay", str(tmp_path / "nope"), "--engine", "real"])
    assert rc == 2
    one_line_error(capsys.readouterr().err, "does not exist")


@pytest.mark.parametrize("where, contains", [("afile/out", "is a file, not a folder"),
                                             ("afile", "it is a file, not a folder"),
                                             ("/proc/neuraldoom-replay", "cannot write the replay to")])
def test_replay_to_an_unwritable_folder_is_one_line(recorded, tmp_path, capsys, where, contains):
    path = recorded[0]
    (tmp_path / "afile").write_text("keep me")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    out = where if where.startswith("/") else str(tmp_path / where)
    assert cli.main(["replay", str(path), "--engine", "real", "--out", out]) == 2
    one_line_error(capsys.readouterr().err, contains)
    assert (tmp_path / "afile").read_text() == "keep me"
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert len(Recording(path)) == 70


def test_real_replay_of_a_recording_without_seed_is_one_line(tmp_path, capsys):
    cfg = GameConfig()
    path = tmp_path / "noseed"
    with RecordingWriter(path, cfg) as w:
        w.new_episode(None)
        for _ in range(3):
            w.add(np.zeros((cfg.height, cfg.width, 3), np.uint8), NOOP)
    with pytest.raises(RecordingError, match="no game seed"):
        run_replay(path, "real")
    out = tmp_path / "out"
    assert cli.main(["replay", str(path), "--engine", "real", "--out", str(out)]) == 2
    one_line_error(capsys.readouterr().err, "no game seed")  # no warning line, no engine switched to
    assert not out.exists()
