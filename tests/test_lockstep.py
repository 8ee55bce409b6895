"""Lockstep: the real game and the neural engine fed the same actions; the side-by-side window, headless."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pygame
import pytest
import torch

from neuraldoom import actions as A
from neuraldoom import autoencoder as AE
from neuraldoom import cli, client, sidebyside
from neuraldoom import metrics as M
from neuraldoom.checkpoint import Checkpoint
from neuraldoom.engine import NeuralEngine
from neuraldoom.game import RealGame
from neuraldoom.lockstep import Lockstep
from neuraldoom.replay import run_replay


@pytest.fixture
def ckpt(tiny_checkpoint):
    return Checkpoint(tiny_checkpoint)


@pytest.fixture
def pair(ckpt):
    p = Lockstep(RealGame(replace(ckpt.game, episode_timeout=0)), NeuralEngine(ckpt, compile=False, seed=0))
    yield p
    p.close()


def real_frames(cfg, seed, actions):
    """An independent real game: reset(seed), then the actions; every frame."""
    with RealGame(cfg) as g:
        out = [g.reset(seed).copy()]
        out += [g.step(a).copy() for a in actions]
    return np.stack(out)


def _reference_ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Textbook SSIM: a full 2-D 11x11 Gaussian window in float64, per channel."""
    import torch
    import torch.nn.functional as F

    g = np.exp(-((np.arange(11) - 5) ** 2) / (2 * 1.5**2))
    w = torch.as_tensor(np.outer(g, g) / np.outer(g, g).sum())[None, None].repeat(3, 1, 1, 1)
    x = torch.as_tensor(a.reshape(-1, *a.shape[-3:])).permute(0, 3, 1, 2).double()
    y = torch.as_tensor(b.reshape(-1, *b.shape[-3:])).permute(0, 3, 1, 2).double()
    mx, my = F.conv2d(x, w, groups=3), F.conv2d(y, w, groups=3)
    sxx, syy = F.conv2d(x * x, w, groups=3) - mx**2, F.conv2d(y * y, w, groups=3) - my**2
    sxy = F.conv2d(x * y, w, groups=3) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    return float((((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx**2 + my**2 + c1) * (sxx + syy + c2))).mean())


def test_ssim_matches_the_textbook_definition():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    for x, y in ((a, b), (a, (a // 2 + 60).astype(np.uint8)), (a, a), (np.stack([a, b]), np.stack([b, b]))):
        assert M.ssim(x, y) == pytest.approx(_reference_ssim(x, y), abs=1e-5)
    assert M.ssim(a, a) == pytest.approx(1.0)


def test_both_engines_get_the_same_actions(pair):
    seen: dict[str, list[A.Action]] = {"real": [], "neural": []}
    for name, eng in (("real", pair.real), ("neural", pair.neural)):
        def spy(a, orig=eng.step, name=name):
            seen[name].append(a)
            return orig(a)
        eng.step = spy
    pair.reset(5)
    n = pair.n
    assert seen["real"] == [A.NOOP] * (n - 1) and seen["neural"] == [], "warm-up runs the real game only"
    seen["real"].clear()
    policy = A.StickyRandomPolicy(np.random.default_rng(1), repeat=0.5)
    acts = [policy() for _ in range(12)]
    ticks = [pair.step(a) for a in acts]
    assert seen["real"] == acts and seen["neural"] == acts
    assert [t.action for t in ticks] == acts
    # the real side is exactly the real game for that seed and those actions
    ref = real_frames(pair.real.cfg, 5, [A.NOOP] * (n - 1) + acts)
    assert np.array_equal(np.stack([t.real for t in ticks]), ref[n:])
    for t in ticks:
        assert t.neural.shape == t.real.shape and t.neural.dtype == np.uint8
        assert t.psnr == pytest.approx(M.psnr(t.neural, t.real))
        assert t.ssim == pytest.approx(M.ssim(t.neural, t.real), abs=1e-6)


def test_reset_fills_the_neural_context_with_the_encoded_real_frames(pair, ckpt):
    tick = pair.reset(7)
    n = pair.n
    ref = real_frames(pair.real.cfg, 7, [A.NOOP] * (n - 1))
    assert np.array_equal(tick.real, ref[-1]) and np.array_equal(tick.neural, ref[-1])
    assert tick.psnr == M.psnr(ref[-1], ref[-1])
    torch.testing.assert_close(pair.neural.z, AE.encode(ckpt.ae, ref))
    noop = [A.NOOP.buttons, A.NOOP.turn]
    assert pair.neural.actions.tolist() == [noop] * n


def test_resync_resets_the_error(pair, ckpt):
    pair.reset(3)
    policy = A.StickyRandomPolicy(np.random.default_rng(2), repeat=0.5)
    drift = [pair.step(policy()) for _ in range(10)]
    assert drift[-1].psnr < 60  # an untrained model drifts at once
    tick = pair.resync()
    assert tick.psnr > 140 and np.array_equal(tick.neural, tick.real)
    frames, codes = pair.context()
    assert np.array_equal(frames[-1], drift[-1].real) and len(frames) == pair.n
    torch.testing.assert_close(pair.neural.z, AE.encode(ckpt.ae, frames))
    assert pair.neural.actions.tolist() == codes.tolist()
    # the first step after a re-sync is exactly what a fresh engine given the same real context produces
    state = pair.neural.gen.get_state()
    a = A.Action.of("MOVE_FORWARD", turn=4.0)
    after = pair.step(a)
    fresh = NeuralEngine(ckpt, compile=False)
    fresh.set_context(frames, codes)
    fresh.gen.set_state(state)
    expect = fresh.step(a)
    assert np.array_equal(after.neural, expect)
    assert after.psnr == pytest.approx(M.psnr(expect, after.real))


def test_side_by_side_window_headless_records_a_replayable_session(pair, tmp_path):
    def post(k):
        return pygame.event.Event(pygame.KEYDOWN, key=k, mod=0)

    script = {3: [post(pygame.K_r)], 5: [post(pygame.K_l)], 6: [post(pygame.K_TAB)], 7: [post(pygame.K_l)]}
    for i in range(8, 13):  # single-step the rest (ticks 9..13): paused, one tick per N
        script[i] = [post(pygame.K_n)]
    ticks = []

    def on_step(i, tick):
        ticks.append(tick)
        for e in script.get(i, []):
            pygame.event.post(e)

    opts = client.ClientOptions(engine_name="both", seed=9, headless=True, frames=14, input="random",
                                record=tmp_path / "sbs")
    stats = sidebyside.run(pair, opts, on_step=on_step)
    assert stats["steps"] == 14 and stats["resyncs"] == 1 and stats["quit"] == "frames"
    assert len(ticks) == 14 and stats["psnr_mean"] is not None
    # the recording holds the real game, warm-up included: it replays byte for byte in the real game
    rep = run_replay(tmp_path / "sbs", "real")
    assert rep["frames"] == pair.n - 1 + 14
    assert rep["identical_frames"] == rep["frames"]


def test_cli_play_side_by_side(tiny_checkpoint, capsys):
    rc = cli.main(["play", "--side-by-side", "--headless", "--frames", "6", "--input", "random", "--seed", "2",
                   "--no-compile", "--checkpoint", str(tiny_checkpoint)])
    out = capsys.readouterr().out
    assert rc == 0 and "side by side, 6 steps" in out, out
