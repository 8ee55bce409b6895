"""training/collect.py end to end on a tiny budget."""

from __future__ import annotations

import pytest

from neuraldoom.cli import inspect_path
from neuraldoom.recording import Recording, RecordingError, find_recordings
from training import collect

ARGS = ["--workers", "2", "--episode-tics", "60", "--heldout", "0.3", "--seed", "1"]


def seeds(path) -> set[int]:
    return {s for p in find_recordings(path) for s in Recording(p).summary()["seeds"]}


def test_collect_writes_shards_and_tops_up(tmp_path, capsys):
    out = tmp_path / "data"
    assert collect.main(["--steps", "240", "--out", str(out), *ARGS]) == 0
    shards = find_recordings(out)
    assert {p.parent.name for p in shards} == {"train", "heldout"}
    assert sorted(p.name for p in shards if p.parent.name == "train") == ["run-000-w00", "run-000-w01"]
    total = inspect_path(out)
    assert total["frames"] == 240 and total["recordings"] == 4
    assert (total["height"], total["width"], total["frame_skip"]) == (120, 160, 2)
    # 60 tics at frame_skip 2 = 30 steps per episode: 8 episodes, each in exactly one split
    assert total["episodes"] == 8
    assert inspect_path(out / "heldout")["frames"] > 0 and inspect_path(out / "train")["frames"] > 0
    for p in shards:
        rec = Recording(p)
        for a, b in rec.episodes():
            assert rec.steps["t"][a:b].tolist() == list(range(b - a))  # whole episodes, in order
    first = seeds(out)

    # a rerun with a larger total appends new shards with fresh seeds up to the new total
    assert collect.main(["--steps", "400", "--out", str(out), *ARGS]) == 0
    assert inspect_path(out)["frames"] == 400
    second = [p for p in find_recordings(out) if p.name.startswith("run-001")]
    assert second
    assert not first & {s for p in second for s in Recording(p).summary()["seeds"]}, "seeds reused"

    # already there: nothing to do
    capsys.readouterr()
    assert collect.main(["--steps", "300", "--out", str(out), *ARGS]) == 0
    assert "already holds 400" in capsys.readouterr().out
    assert inspect_path(out)["frames"] == 400


def test_collect_bad_map_fails_fast(tmp_path, capsys):
    assert collect.main(["--steps", "10", "--out", str(tmp_path / "d"), "--map", "E9M9"]) == 2
    assert "unknown map" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flags", [["--workers", "0", "--steps", "10"], ["--workers", "1", "--steps", "0"]])
def test_collect_refuses_no_workers_or_no_steps(tmp_path, capsys, flags):
    from training import collect

    assert collect.main([*flags, "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "at least 1" in err and not (tmp_path / "d").exists()


def test_a_sigkilled_collect_takes_its_workers_along_and_loses_no_written_step(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "d"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    p = subprocess.Popen([sys.executable, "-m", "training.collect", "--steps", "1000000", "--out", str(out),
                          "--workers", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def frames() -> int:
        try:
            return sum(len(Recording(r)) for r in find_recordings(out))
        except RecordingError:  # a shard being created
            return 0

    deadline = time.time() + 120
    while time.time() < deadline and frames() < 200:
        time.sleep(0.5)
    workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert workers, "no workers running"
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.time() + 30
    alive = list(workers)
    while alive and time.time() < deadline:
        alive = [w for w in alive if os.path.exists(f"/proc/{w}") and
                 open(f"/proc/{w}/stat").read().split()[2] != "Z"]
        time.sleep(0.2)
    assert not alive, f"workers {alive} outlived their collect"
    n = sum(len(Recording(r)) for r in find_recordings(out))  # every shard still reads
    assert n >= 200
    assert collect.main(["--steps", str(n + 50), "--out", str(out), "--workers", "1"]) == 0
    assert sum(len(Recording(r)) for r in find_recordings(out)) == n + 50


def test_idle_play_stands_still_in_the_real_game_and_a_bad_share_is_one_line(tmp_path, capsys):
    import numpy as np

    out = tmp_path / "idle"
    assert collect.main(["--steps", "300", "--out", str(out), "--workers", "1", "--heldout", "0",
                         "--episode-tics", "700", "--idle", "0.5", "--seed", "4"]) == 0
    rec = Recording(find_recordings(out / "train")[0])
    frames = np.asarray(rec.frames[:]).astype(np.int16)
    same = (np.abs(frames[1:, :96] - frames[:-1, :96]).max((1, 2, 3)) == 0).mean()
    assert same > 0.2  # the view stops once the slide after a stop dies out (plain play: ~0.6%)
    capsys.readouterr()
    assert collect.main(["--steps", "10", "--out", str(tmp_path / "d"), "--idle", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--idle" in err and not (tmp_path / "d").exists()
