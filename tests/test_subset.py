"""training.subset: the first whole episodes of a recording, as train/ and heldout/ both."""

from __future__ import annotations

import numpy as np

from neuraldoom.recording import Recording, find_recordings
from training.subset import main as subset


def test_subset_holds_the_first_whole_episodes_in_both_splits(tiny_dataset, tmp_path):
    src = Recording(find_recordings(tiny_dataset / "train")[0])
    eps = src.episodes()
    assert len(eps) >= 2
    out = tmp_path / "fit"
    assert subset(["--data", str(tiny_dataset), "--recording", src.path.name, "--episodes", "2",
                   "--out", str(out)]) == 0
    n = eps[1][1]
    for split in ("train", "heldout"):
        r = Recording(out / split / src.path.name)
        assert len(r) == n < len(src)
        assert r.episodes() == eps[:2]
        assert np.array_equal(np.asarray(r.frames), np.asarray(src.frames[:n]))
        assert np.array_equal(np.asarray(r.steps), np.asarray(src.steps[:n]))
        assert r.game == src.game
    assert not list(tmp_path.glob(".fit*"))  # no temporary folder left behind


def test_subset_bad_input_is_one_line_and_exit_2(tiny_dataset, tmp_path, capsys):
    name = find_recordings(tiny_dataset / "train")[0].name
    out = tmp_path / "fit"
    cases = [
        (["--recording", "no-such-run"], "not a recording"),
        (["--recording", name, "--episodes", "1000"], "whole episodes"),
        (["--recording", name, "--episodes", "0"], "at least 1"),
    ]
    for extra, msg in cases:
        assert subset(["--data", str(tiny_dataset), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1
        assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert subset(["--data", str(tiny_dataset), "--out", str(out), "--recording", name]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"  # nothing of the user's is touched
