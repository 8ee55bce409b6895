"""The blind A/B test: clip pairs, the automatic rater, the answers file and the Wilson interval."""

from __future__ import annotations

import json

import numpy as np
import pygame
import pytest

from neuraldoom import abtest, cli
from neuraldoom.actions import NOOP


def test_wilson_interval_on_known_counts():
    z2 = 1.96**2
    assert abtest.wilson(0, 10) == pytest.approx((0.0, z2 / (10 + z2)))  # closed forms at k = 0 and k = n
    assert abtest.wilson(10, 10) == pytest.approx((10 / (10 + z2), 1.0))
    assert abtest.wilson(58, 100) == pytest.approx((0.4821, 0.6720), abs=1e-4)  # the paper's 58%
    assert abtest.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert abtest.wilson(0, 0) == (0.0, 1.0)


def test_summarize_counts_answers_that_picked_the_real_clip():
    rows = [{"real_is": r, "answer": a} for r, a in (("A", "A"), ("B", "A"), ("B", "B"), ("A", "B"), ("A", "A"))]
    s = abtest.summarize(rows)
    assert (s["answers"], s["correct"], s["fraction"]) == (5, 3, 0.6)
    assert s["ci95"] == pytest.approx(list(abtest.wilson(3, 5)))


def clip(real_is: str) -> abtest.Clip:
    rng = np.random.default_rng(0)
    sharp = rng.integers(0, 256, (3, 120, 160, 3), dtype=np.uint8)
    flat = np.full_like(sharp, 128)
    return abtest.Clip(0, 1, 0, [NOOP] * 3, sharp, flat, real_is)


def test_sharper_rater_picks_the_sharp_clip_in_either_order():
    assert abtest.sharper_rater(clip("A")) == "A"
    assert abtest.sharper_rater(clip("B")) == "B"
    c = clip("B")
    assert np.array_equal(c.b, c.real) and np.array_equal(c.a, c.neural)


def test_auto_abtest_appends_every_answer(tiny_checkpoint, tmp_path):
    answers = tmp_path / "ab" / "answers.jsonl"
    s = abtest.run_abtest(tiny_checkpoint, clips=3, seconds=0.3, answers=answers, auto=True, seed=1)
    rows = abtest.read_answers(answers)
    assert len(rows) == 3 == s["answers"] and s["frames"] == 5  # 0.3 s at 17.5 steps/s
    for r in rows:
        assert r["answer"] in "AB" and r["real_is"] in "AB" and r["correct"] == (r["answer"] == r["real_is"])
        assert r["rater"] == "auto-sharpness" and r["frames"] == 5 and len(r["actions"]) == 5
    assert s["correct"] == sum(r["correct"] for r in rows)
    assert s["ci95"] == pytest.approx(list(abtest.wilson(s["correct"], 3)))
    again = abtest.run_abtest(tiny_checkpoint, clips=2, seconds=0.3, answers=answers, auto=True, seed=2)
    assert again["answers"] == 2 and len(answers.read_text().splitlines()) == 5, "answers are appended"
    assert len({r["session"] for r in abtest.read_answers(answers)}) == 2


def test_clips_from_a_recording_use_its_actions(recorded, tiny_checkpoint, tmp_path):
    path, _, acts = recorded
    answers = tmp_path / "answers.jsonl"
    got = []

    def rater(c, i, n):
        got.append(c)
        return "A"

    s = abtest.run_abtest(tiny_checkpoint, clips=2, seconds=0.3, answers=answers, seed=3, recording=path, rater=rater)
    assert s["answers"] == 2
    codes = [[a.buttons, a.turn] for a in acts]
    for c, row in zip(got, abtest.read_answers(answers), strict=True):
        start = 0 if c.seed == 11 else 40  # the recorded episodes: seed 11 rows 0-39, seed 12 rows 40-69
        assert row["actions"] == codes[start + c.start:start + c.start + 5]
        assert c.real.shape == c.neural.shape == (5, 120, 160, 3)


def test_human_rater_reads_keys(tmp_path):
    rater = abtest.HumanRater(120, 160, scale=1, headless=True)
    try:
        pygame.event.post(pygame.event.Event(pygame.KEYDOWN, key=pygame.K_2, mod=0))
        assert rater(clip("A"), 1, 1) == "B"
        pygame.event.post(pygame.event.Event(pygame.KEYDOWN, key=pygame.K_a, mod=0))
        assert rater(clip("A"), 1, 1) == "A"
        pygame.event.post(pygame.event.Event(pygame.KEYDOWN, key=pygame.K_ESCAPE, mod=0))
        assert rater(clip("A"), 1, 1) is None
    finally:
        rater.close()


def test_cli_abtest_auto(tiny_checkpoint, tmp_path, capsys):
    answers = tmp_path / "a.jsonl"
    rc = cli.main(["abtest", "--auto", "--clips", "2", "--seconds", "0.2", "--seed", "0", "--no-compile",
                   "--checkpoint", str(tiny_checkpoint), "--answers", str(answers)])
    out = capsys.readouterr().out
    assert rc == 0 and "real game picked" in out and "95% CI" in out, out
    assert len([json.loads(x) for x in answers.read_text().splitlines()]) == 2
    rc = cli.main(["abtest", "--auto", "--clips", "0", "--checkpoint", str(tiny_checkpoint)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--clips" in err[0]


@pytest.mark.parametrize("where, contains", [("afile/sub/answers.jsonl", "is a file, not a folder"),
                                             ("adir", "it is a folder"),
                                             ("/proc/neuraldoom-abtest/answers.jsonl", "cannot append answers to")])
def test_answers_where_they_cannot_be_written_is_one_line(tiny_checkpoint, tmp_path, capsys, where, contains):
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "adir").mkdir()
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    answers = where if where.startswith("/") else str(tmp_path / where)
    rc = cli.main(["abtest", "--auto", "--clips", "1", "--seconds", "0.2", "--seed", "0", "--no-compile",
                   "--checkpoint", str(tiny_checkpoint), "--answers", answers])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("neuraldoom: ") and contains in err[0], err
    assert (tmp_path / "afile").read_text() == "keep me"
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_human_rater_plays_a_then_b_then_asks(tmp_path, monkeypatch):
    rater = abtest.HumanRater(120, 160, scale=1, headless=True)
    shown = []
    real_draw = abtest.PairView.draw

    def draw(view, win):
        real_draw(view, win)
        shown.append(view.timeline[view.pos][1] if view.pos < len(view.timeline) else "question")
        if len(shown) == 23:  # at the question: Space replays, then answer 1 during clip A
            pygame.event.post(pygame.event.Event(pygame.KEYDOWN, key=pygame.K_SPACE, mod=0))
        if len(shown) == 25:
            pygame.event.post(pygame.event.Event(pygame.KEYDOWN, key=pygame.K_1, mod=0))

    monkeypatch.setattr(abtest.PairView, "draw", draw)
    try:
        assert rater(clip("A"), 2, 5) == "A"
    finally:
        rater.close()
    gap = round(0.4 * 17.5)
    assert shown[:3] == ["clip A   (2/5)"] * 3 and shown[3:3 + gap] == ["end of clip A"] * gap
    assert shown[3 + gap:6 + gap] == ["clip B   (2/5)"] * 3 and shown[6 + gap:6 + 2 * gap] == ["end of clip B"] * gap
    assert 6 + 2 * gap == 20 and shown[20:23] == ["question"] * 3
    assert shown[23:] == ["clip A   (2/5)"] * 2, "Space replays from clip A; 1 answers during the clip"
