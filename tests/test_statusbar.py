"""The status-bar reader: the shipped templates read a real headless game; fit/save/load round-trips."""

from __future__ import annotations

import numpy as np
import pytest

from neuraldoom import statusbar as S
from neuraldoom.actions import Action, StickyRandomPolicy
from neuraldoom.config import GameConfig
from neuraldoom.game import RealGame

ATTACK = Action.of("ATTACK").buttons


@pytest.fixture(scope="module")
def played():
    """Random play with ATTACK held most steps, two episodes, long enough to shoot the pistol dry."""
    rng = np.random.default_rng(5)
    policy = StickyRandomPolicy(rng)
    frames, variables, episode = [], [], []
    with RealGame(GameConfig()) as g:
        for ep, (seed, n) in enumerate(((21, 600), (22, 200))):
            g.reset(seed)
            for t in range(n):
                if t:
                    a = policy()
                    g.step(Action(a.buttons | ATTACK, a.turn) if rng.random() < 0.8 else a)
                    if g.done:
                        break
                frames.append(g.frame.copy())
                variables.append(g.variables.copy())
                episode.append(ep)
    return np.stack(frames), S.shown_values(np.stack(variables), np.array(episode))


def test_default_reader_reads_a_real_game(played):
    frames, values = played
    ammo = values[:, 0, 0]
    assert len(np.unique(ammo[ammo >= 0])) > 10, "the pistol should have fired"
    assert (ammo == S.EMPTY).any(), "the pistol should have run dry (fist: empty ammo field)"
    acc = S.read_accuracy(S.default_reader(), frames, values)
    assert acc["all"] >= 0.99, acc


def test_fit_save_load_round_trip(played, tmp_path):
    frames, values = played
    reader = S.StatusBarReader().fit(frames[::4], values[::4])
    path = reader.save(tmp_path / "sb.safetensors")
    loaded = S.StatusBarReader.load(path)
    assert np.array_equal(loaded.templates, reader.templates, equal_nan=True)
    assert np.array_equal(loaded.max_dist, reader.max_dist)
    assert np.array_equal(loaded.read(frames), reader.read(frames))
    assert S.read_accuracy(loaded, frames, values)["all"] >= 0.99


def test_values_and_cells_round_trip():
    values = np.array([0, 7, 10, 99, 100, 105, 200, 999, S.EMPTY])
    assert S.decode(S.value_classes(values)).tolist() == values.tolist()
    B = S.BLANK
    # a gap, leading zeros, an unreadable cell: no number
    assert S.decode(np.array([[1, B, 3], [0, 1, 2], [B, 0, 5], [B, -1, 5]])).tolist() == [S.UNREADABLE] * 4


def test_what_is_no_number_does_not_read_as_one(played):
    frames, _ = played
    reader = S.default_reader()
    noise = frames[:8].copy()
    noise[:, S.ROWS[0]:S.ROWS[1]] = np.random.default_rng(0).integers(0, 256, noise[:, S.ROWS[0]:S.ROWS[1]].shape)
    assert (reader.read(noise) == S.UNREADABLE).all()
    grey = frames[:8].copy()
    grey[:, S.ROWS[0]:S.ROWS[1]] = 128  # the digits painted over: three empty fields
    assert (reader.read(grey) == S.EMPTY).all()


def test_evaluate_autoencoder_reports_the_status_bar(played):
    import torch

    from neuraldoom import autoencoder as AE
    from neuraldoom.config import AutoencoderConfig
    from training.evaluate import evaluate_autoencoder

    torch.manual_seed(0)
    ae = AE.build_autoencoder(AutoencoderConfig(latent_channels=4, encoder_channels=8, decoder_channels=8))
    frames, values = played
    ev = evaluate_autoencoder(ae, frames[:6], values[:6])
    assert {"psnr", "ssim", "hud_psnr", "sharpness", "statusbar_acc", "statusbar_fields"} <= set(ev)
    assert ev["statusbar_acc"] == 0.0 and set(ev["statusbar_fields"]) == set(S.FIELDS)  # untrained: mush
    assert evaluate_autoencoder(ae, frames[:6])["statusbar_acc"] == 0.0  # truth read off the real frames


def test_wrong_frame_size_raises():
    reader = S.default_reader()
    for shape in ((2, 240, 320, 3), (120, 160, 3), (2, 120, 160)):
        with pytest.raises(ValueError, match="160x120"):
            reader.read(np.zeros(shape, np.uint8))


def test_bar_changes_flags_the_frames_whose_numbers_change(played):
    frames, values = played
    one = np.zeros(len(frames), int)
    flags = S.bar_changes(frames, one)
    ammo = values[:, 0, 0]  # a frame shows the ammo of the row before (shown_values)
    assert flags[1:][ammo[1:] != ammo[:-1]].all() and not flags[0]
    assert not flags[1:][~(values[1:] != values[:-1]).any((1, 2))].any()  # nothing changed: nothing flagged
    assert 0 < flags.mean() < 0.3
    k = int(np.flatnonzero(flags)[0])
    assert not S.bar_changes(frames, (np.arange(len(frames)) >= k).astype(int))[k]  # a new episode is no change
    assert not S.bar_changes(frames[:, :96], one).any()  # no status bar to read
    shots = S.bar_changes(frames, one, ("ammo",))  # the ammo count alone: the shots, not the damage taken
    assert shots[1:][ammo[1:] != ammo[:-1]].all() and not (shots & ~flags).any()
    assert not shots[1:][~(values[1:, :, 0] != values[:-1, :, 0]).any(1)].any()
    with pytest.raises(ValueError, match="ammo, health, armor"):
        S.bar_changes(frames, one, ("ammo", "keys"))
