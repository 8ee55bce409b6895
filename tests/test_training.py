"""Each training stage end to end on tiny settings, on real collected data, in tmp_path."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from neuraldoom.checkpoint import Checkpoint
from neuraldoom.engine import NeuralEngine
from training import compare, evaluate, export, train_autoencoder, train_diffusion

TINY_AE = ["--latent-channels", "4", "--encoder-channels", "8", "--decoder-channels", "8"]
TINY_DM = ["--context", "4", "--block-out-channels", "8", "16", "--attention-heads", "2",
           "--cross-attention-dim", "16", "--batch", "4", "--max-frames", "300", "--no-compile"]


@pytest.fixture(scope="module")
def tiny_ae(tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("ae")
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(out), "--steps", "6", "--batch", "4",
                                   "--eval-every", "3", "--eval-frames", "8", *TINY_AE]) == 0
    return out


def test_autoencoder_stage_trains_logs_and_resumes(tiny_ae, tiny_dataset, capsys):
    log = [json.loads(x) for x in (tiny_ae / "ae_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [3, 6] and all("hud_psnr" in r for r in log)
    assert (tiny_ae / "autoencoder" / "diffusion_pytorch_model.safetensors").exists()
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(tiny_ae), "--steps", "8",
                                   "--batch", "4", "--eval-every", "4", "--eval-frames", "8", *TINY_AE]) == 0
    assert "resuming at step 6" in capsys.readouterr().out


def test_autoencoder_resume_keeps_its_weights_when_the_model_folder_is_lost(tiny_ae, tiny_dataset, tmp_path):
    """A kill between the two renames of the folder swap leaves no autoencoder/: the state file alone resumes."""
    import shutil

    import torch
    from diffusers import AutoencoderTiny

    from neuraldoom.checkpoint import load_model_dir

    run = tmp_path / "run"
    shutil.copytree(tiny_ae, run)
    before = load_model_dir(AutoencoderTiny, run / "autoencoder").state_dict()
    os.replace(run / "autoencoder", run / "autoencoder.old")  # the swap's first rename happened, not the second
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(run), "--steps", "20", "--lr", "0",
                                   "--batch", "2", "--eval-every", "20", "--eval-frames", "4", *TINY_AE]) == 0
    after = load_model_dir(AutoencoderTiny, run / "autoencoder").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "encoder" in k or "decoder" in k)


def test_autoencoder_resume_with_other_architecture_is_one_line(tiny_ae, tiny_dataset, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_ae, run)
    flags = ["--latent-channels", "8", "--encoder-channels", "8", "--decoder-channels", "8"]
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(run), "--steps", "9", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--latent-channels 4" in err


def test_a_4x_autoencoder_trains_and_a_mismatched_one_is_one_line(tiny_dataset, tmp_path, capsys):
    import numpy as np
    from diffusers import AutoencoderTiny

    from neuraldoom import autoencoder as AE
    from neuraldoom.checkpoint import load_model_dir

    four = ["--encoder-fold", "4", "--encoder-blocks", "1", "--decoder-fold", "2", "--decoder-blocks", "1", "1"]
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(tmp_path / "x4"), "--steps", "2",
                                   "--batch", "2", "--eval-every", "2", "--eval-frames", "4", *TINY_AE, *four]) == 0
    ae = load_model_dir(AutoencoderTiny, tmp_path / "x4" / "autoencoder")
    assert AE.downsampling(ae) == 4 and AE.latent_hw(ae, 120, 160) == (32, 40)
    frames = np.zeros((2, 120, 160, 3), np.uint8)
    z = AE.encode(ae, frames)
    assert z.shape == (2, 4, 32, 40) and AE.decode(ae, z, 120, 160).shape == frames.shape
    bad = ["--encoder-fold", "4", "--encoder-blocks", "1", "1"]  # 8x in, 4x out (the default decoder)
    capsys.readouterr()
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(tmp_path / "bad"), *TINY_AE, *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "downsamples 8x" in err


def test_autoencoder_refuses_negative_latent_noise(tiny_dataset, tmp_path, capsys):
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(tmp_path / "r"),
                                   "--latent-noise", "-1"]) == 2
    assert "--latent-noise" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--latent-noise", "0.3"]])
def test_decoder_only_keeps_the_encoder(tiny_ae, tiny_dataset, tmp_path, flags):
    import torch
    from diffusers import AutoencoderTiny

    from neuraldoom.checkpoint import load_model_dir

    out = tmp_path / "dec"
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(out), "--init-from",
                                   str(tiny_ae / "autoencoder"), "--decoder-only", "--steps", "3", "--batch", "2",
                                   "--eval-every", "3", "--eval-frames", "4", *flags]) == 0
    a = load_model_dir(AutoencoderTiny, tiny_ae / "autoencoder")
    b = load_model_dir(AutoencoderTiny, out / "autoencoder")
    assert all(torch.equal(x, y) for x, y in zip(a.encoder.parameters(), b.encoder.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.decoder.parameters(), b.decoder.parameters(), strict=True))


@pytest.fixture(scope="module")
def tiny_run(tiny_ae, tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("dm")
    assert train_diffusion.main(["--data", str(tiny_dataset), "--autoencoder", str(tiny_ae / "autoencoder"),
                                 "--out", str(out), "--steps", "4", "--eval-every", "2", *TINY_DM]) == 0
    return out


def test_diffusion_stage_writes_a_playable_checkpoint(tiny_run):
    from neuraldoom.actions import Action
    from neuraldoom.engine import NeuralEngine

    ck = Checkpoint(tiny_run / "checkpoint")
    assert ck.config["notes"]["steps"] == 4 and ck.denoiser_cfg.context == 4
    eng = NeuralEngine(ck, compile=False)
    assert eng.step(Action.of("MOVE_FORWARD")).shape == (120, 160, 3)
    log = [json.loads(x) for x in (tiny_run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]
    # the shipped (EMA) weights' held-out loss is logged beside the training weights': they are not the same model
    assert all(np.isfinite(r["held_loss_ema"]) and r["held_loss_ema"] != r["held_loss"] for r in log)


def test_held_out_evaluation_leaves_the_training_untouched(tiny_ae, tiny_dataset, tmp_path):
    from neuraldoom.checkpoint import load_state

    states = []
    for every in ("1", "1000"):  # the EMA weights swapped in and back at every step, or never
        out = tmp_path / every
        assert train_diffusion.main(["--data", str(tiny_dataset), "--autoencoder", str(tiny_ae / "autoencoder"),
                                     "--out", str(out), "--steps", "3", "--eval-every", every, *TINY_DM]) == 0
        states.append(load_state(out / "train_state.safetensors")[0])
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_diffusion_resumes_after_sigkill(tiny_ae, tiny_dataset, tmp_path):
    out = tmp_path / "dm"
    cmd = [sys.executable, "-m", "training.train_diffusion", "--data", str(tiny_dataset), "--autoencoder",
           str(tiny_ae / "autoencoder"), "--out", str(out), "--steps", "100000", "--save-every", "0", *TINY_DM]
    env = {**os.environ, "PYTHONPATH": str(os.path.dirname(os.path.dirname(__file__)))}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / "train_state.safetensors"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (state.exists() and (out / "checkpoint").exists()):
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    from neuraldoom.checkpoint import load_state

    before, meta = load_state(state)  # the state on disk is whole, never half-written
    saved = meta["step"]
    assert saved >= 1
    # resumed with a zero learning rate: two more steps are taken and the weights stay the saved ones
    r = subprocess.run(cmd[:-len(TINY_DM) - 4] + ["--steps", str(saved + 2), "--save-every", "0", "--lr", "0",
                                                  *TINY_DM], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming at step {saved}" in r.stdout
    after, meta2 = load_state(state)
    assert meta2["step"] == saved + 2
    weights = [k for k in before if k.startswith("model.")]
    assert weights and all(torch.equal(before[k], after[k]) for k in weights)


def test_evaluate_reports_model_and_baselines(tiny_run, tiny_dataset, tmp_path, capsys):
    out = tmp_path / "eval"
    assert evaluate.main(["--checkpoint", str(tiny_run / "checkpoint"), "--data", str(tiny_dataset),
                          "--out", str(out), "--samples", "4", "--rollouts", "2", "--rollout-steps", "5",
                          "--still", "2", "--still-steps", "3", "--free-steps", "4"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["free_steps"] == [1, 2, 3, 4]
    assert sorted(rep["free"]) == ["sticky/0", "sticky/1", "straight/0", "straight/1"]
    for run in rep["free"].values():
        assert len(run["sharpness"]) == len(run["colour_cast"]) == 4 and all(x > 0 for x in run["sharpness"])
        assert run["close_wall"] is None  # 4 steps: no 10th step to count
    for k in ("real_close_wall", "tf_close_wall", "ar_close_wall", "ar_real_close_wall"):
        assert 0 <= rep[k] <= 1, k
    from PIL import Image

    assert Image.open(out / "free.png").size == (5 * 160, 4 * 120)  # the start and 4 steps, a row per run
    assert rep["n_still"] == 2 and len(rep["still_psnr"]) == len(rep["still_sharpness"]) == 3
    assert isinstance(rep["still_ae_psnr"], float) and (out / "still.png").stat().st_size > 0
    for k in ("tf_psnr", "tf_psnr_nocfg", "tf_ssim", "copy_last_psnr", "mean_frame_psnr", "ae_psnr", "hud_psnr",
              "ae_hud_psnr", "n_samples"):
        assert isinstance(rep[k], (int, float)), k
    for k in ("ar_psnr", "ar_copy_last_psnr", "ar_sharpness"):
        assert len(rep[k]) == 5
    assert rep["n_samples"] == 4
    assert (rep["ar_copy_last_statusbar_acc"] is None) == (rep["ar_statusbar_acc"] is None)
    if rep["ar_statusbar_acc"] is not None:  # the real game's frames: the held bar's reads are a fraction
        assert 0 <= rep["ar_copy_last_statusbar_acc"] <= 1
    assert (out / "ar_psnr.png").stat().st_size > 0 and (out / "grid.png").stat().st_size > 0
    assert sum(v["n"] for v in rep["tf_by_motion"].values()) == 4
    moved = 4 - rep["tf_by_motion"].get("still", {"n": 0})["n"]  # the turn's split holds the steps the view changed
    assert sum(v["n"] for v in rep["tf_by_turn"].values()) == moved
    assert all(0 <= v["sharpness"] < 10 for v in rep["tf_by_turn"].values())
    # the held-out play spends ammo: targets where the bar changes, which a bar held still never reads right
    assert 0 < rep["n_events"] <= 32 and rep["event_copy_last_statusbar_acc"] == 0.0
    assert 0 <= rep["event_statusbar_acc"] <= 1 and set(rep["event_statusbar_fields"]) == {"ammo", "health", "armor"}
    assert np.isfinite(rep["event_move"]) and np.isfinite(rep["event_move_median"])
    assert Image.open(out / "events.png").size[0] == 3 * 160
    assert "copy-last-frame PSNR" in capsys.readouterr().out
    if rep["ar_statusbar_acc"] is not None:  # each rollout's first miss (or none), one per rollout
        assert len(rep["ar_statusbar_misses"]) == rep["n_rollouts"]
    # the per-frame errors behind the set PSNRs, kept for paired comparisons
    assert len(rep["tf_mse"]) == len(rep["tf_copy_last_mse"]) == 4
    assert evaluate.M.psnr_from_mse(float(np.mean(rep["tf_mse"]))) == pytest.approx(rep["tf_psnr"])
    assert len(rep["ar_mse"]) == rep["n_rollouts"] and all(len(r) == 5 for r in rep["ar_mse"])
    alive0 = [r[0] is not None for r in rep["ar_mse"]]
    first = [r[0] for r in rep["ar_mse"] if r[0] is not None]
    assert sum(alive0) == rep["ar_alive"][0]
    assert evaluate.M.psnr_from_mse(float(np.mean(first))) == pytest.approx(rep["ar_psnr"][0])
    # a checkpoint compared with itself on the same targets: no difference, and an interval of none
    assert compare.main([str(out), str(out / "report.json")]) == 0
    printed = capsys.readouterr().out
    assert "teacher-forced PSNR" in printed and "+0.00  [+0.00, +0.00]" in printed


def test_evaluate_takes_several_rollouts_from_one_episode_where_asked(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    def rollouts(per: str) -> list:
        out = tmp_path / f"per{per}"
        assert evaluate.main(["--checkpoint", str(tiny_checkpoint), "--data", str(tiny_dataset), "--out", str(out),
                              "--samples", "2", "--rollouts", "6", "--rollout-steps", "5", "--still", "0",
                              "--events", "0", "--per-episode", per]) == 0
        return json.loads((out / "report.json").read_text())["ar_copy_last_mse"]

    one, three = rollouts("1"), rollouts("3")
    episodes = len(one)  # one rollout per held-out episode long enough
    assert 1 <= episodes < 6 and len(three) == min(6, 3 * episodes)
    assert len({tuple(r) for r in three}) == len(three)  # other starts: other frames held still
    assert {tuple(r) for r in one} <= {tuple(r) for r in three}  # each episode's first start is the same
    assert evaluate.main(["--checkpoint", str(tiny_checkpoint), "--data", str(tiny_dataset), "--out",
                          str(tmp_path / "bad"), "--per-episode", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--per-episode" in err


def _report(rng: np.random.Generator, tf_scale: float, ar_scale: float, n: int = 64, rollouts: int = 8,
            steps: int = 16) -> dict:
    """A report as training.evaluate writes it: copy-last's errors fixed by the seed, the model's scaled."""
    base = np.random.default_rng(0)
    cl, acl = base.uniform(200, 400, n), base.uniform(200, 600, (rollouts, steps))
    ar = acl * ar_scale * rng.uniform(0.8, 1.2, acl.shape)
    ar_l, acl_l = ar.tolist(), acl.tolist()
    ar_l[0][-3:] = acl_l[0][-3:] = [None] * 3  # a rollout that reached its episode's end
    ok = (base.random((rollouts, steps)) < 0.5).tolist()
    return {"tf_mse": (cl * tf_scale * rng.uniform(0.8, 1.2, n)).tolist(), "tf_copy_last_mse": cl.tolist(),
            "ar_mse": ar_l, "ar_copy_last_mse": acl_l, "ar_statusbar_ok": ok}


def test_compare_sees_a_real_difference_and_not_noise():
    rng = np.random.default_rng(1)
    a, b = _report(rng, 0.8, 0.9), _report(rng, 0.5, 0.9)  # B's teacher-forced errors far lower, AR alike
    rows = {r[0]: r for r in compare.compare(a, b, resamples=400)}
    name, va, vb, d, lo, hi = rows["teacher-forced PSNR"]
    assert d == pytest.approx(vb - va) and d > 1.5 and 0 < lo < d < hi  # 10*log10(0.8/0.5) ~ 2 dB, seen
    _, _, _, d, lo, hi = rows["autoregressive PSNR, steps 1-16"]
    assert lo < 0 < hi and abs(d) < 0.5  # the same model up to noise: not seen
    assert rows["status bar read right, autoregressive (%)"][3] == 0  # the same reads
    assert "least autoregressive gain over copy-last" in rows and "autoregressive PSNR, step 8" in rows


def test_compare_refuses_reports_on_other_targets(tmp_path, capsys):
    rng = np.random.default_rng(1)
    a, b = _report(rng, 0.8, 0.9), _report(rng, 0.8, 0.9)
    b["tf_copy_last_mse"] = (np.array(b["tf_copy_last_mse"]) + 1).tolist()  # other targets
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not evaluated on the same targets" in err
    (tmp_path / "old.json").write_text(json.dumps({"tf_psnr": 20.0}))  # a report from before the errors were kept
    assert compare.main([str(tmp_path / "old.json"), str(tmp_path / "a.json")]) == 2
    assert "re-evaluate" in capsys.readouterr().err


def test_first_misses_name_the_step_field_and_kind_of_each_rollouts_first_wrong_read():
    R, T = 4, 6
    shown = np.tile(np.array([46, 100, 0]), (R, T, 2, 1))
    shown[1, 3:, :, 0] = 45  # a shot at step 3 ...
    shown[1, 3, 0, 0] = 46  # ... whose step may still show the old count
    reads = shown[:, :, -1].copy()
    reads[1, 3:, 0] = 46  # rollout 1 keeps the old count: a missed change, wrong from step 4 (step 3 may show 46)
    reads[2, 2:, 1] = -1  # rollout 2's health smears: unreadable
    reads[3, 5, 0] = 44  # rollout 3 counts a shot the game did not make
    ok = (reads[:, :, None] == shown).any(2)
    alive = np.ones((R, T), bool)
    alive[3, 5] = False  # ... past its episode's end: not a miss
    misses = evaluate.first_misses(reads, shown, ok, alive)
    assert misses[0] is None and misses[3] is None
    assert misses[1] == {"step": 5, "field": "ammo", "shown": 45, "read": 46, "kind": "missed", "cause": "shot"}
    assert misses[2] == {"step": 3, "field": "health", "shown": 100, "read": -1, "kind": "unreadable"}
    alive[3, 5] = True
    assert evaluate.first_misses(reads, shown, ok, alive)[3]["kind"] == "spurious"
    shown[0, 4:, :, 1] = 101  # rollout 0 walks over a health bonus its bar never draws: the world's change
    ok = (reads[:, :, None] == shown).any(2)
    assert evaluate.first_misses(reads, shown, ok, alive)[0] == {
        "step": 5, "field": "health", "shown": 101, "read": 100, "kind": "missed", "cause": "world"}


def test_miss_strip_shows_real_over_model_bars_around_each_first_miss():
    R, T = 3, 6
    real = np.zeros((R, T, 120, 160, 3), np.uint8)
    gen = np.zeros_like(real)
    real[:, :] = np.arange(T, dtype=np.uint8)[None, :, None, None, None]  # frame t painted t
    gen[:, :] = 100 + np.arange(T, dtype=np.uint8)[None, :, None, None, None]
    alive = np.ones((R, T), bool)
    alive[1, 4:] = False  # rollout 1 reaches its episode's end after 4 steps
    assert evaluate.miss_strip(real, gen, alive, [None] * R) is None
    strip = evaluate.miss_strip(real, gen, alive, [None, {"step": 2}, None], around=(-3, 0, 1, 8))
    from neuraldoom.metrics import hud_top

    bar = 120 - hud_top(120)
    assert strip.shape == (2 * bar, 4 * 160, 3)
    assert [strip[0, 160 * i, 0] for i in range(4)] == [0, 1, 2, 3]  # clamped to the rollout's alive steps
    assert [strip[bar, 160 * i, 0] for i in range(4)] == [100, 101, 102, 103]


def test_motion_names_what_a_step_did_to_the_view():
    from neuraldoom import actions as A

    view = np.random.default_rng(0).integers(0, 255, (120, 160, 3), dtype=np.uint8)
    other = view.copy()
    other[:10] = 0
    bar_only = view.copy()
    bar_only[-5:] = 0  # only the status bar changed: the view stood still
    assert evaluate.motion(A.Action.of("MOVE_FORWARD", turn=4.0).code, view, bar_only) == "still"
    assert evaluate.motion(A.Action.of("MOVE_FORWARD", turn=4.0).code, view, other) == "turn"
    assert evaluate.motion(A.Action.of("MOVE_FORWARD").code, view, other) == "move"
    assert evaluate.motion(A.Action.of("ATTACK").code, view, other) == "other"
    assert evaluate.turn_speed(A.Action.of("MOVE_FORWARD", turn=-8.0).code, view, other) == 8.0
    assert evaluate.turn_speed(A.Action.of("MOVE_FORWARD").code, view, other) == 0.0
    assert evaluate.turn_speed(A.Action.of("MOVE_FORWARD", turn=4.0).code, view, bar_only) is None


def test_by_motion_splits_gain_and_sharpness_by_kind_and_leaves_out_none():
    rng = np.random.default_rng(0)
    real = rng.integers(0, 255, (4, 120, 160, 3), dtype=np.uint8)
    prev = np.roll(real, 3, axis=2)
    gen = real.copy()
    gen[1:] = 128  # the model drew all but the first target as flat grey
    rows = evaluate.by_motion([8.0, 8.0, 0.0, None], gen, prev, real)
    assert list(rows) == ["0.0", "8.0"] and [v["n"] for v in rows.values()] == [1, 2]
    assert rows["0.0"]["sharpness"] == 0.0 and 0.4 < rows["8.0"]["sharpness"] < 0.6  # one of two drawn flat
    assert rows["8.0"]["psnr"] > rows["8.0"]["copy_last_psnr"]  # one target exact
    gen[0, -10:] = 0  # the status bar's rows only: no change on the view rows
    on_view = evaluate.by_motion([8.0], gen[:1], prev[:1], real[:1], view=True)["8.0"]
    assert on_view["psnr"] > 100 and on_view["sharpness"] == 1.0  # exact on the view rows
    assert evaluate.by_motion([8.0], gen[:1], prev[:1], real[:1])["8.0"]["psnr"] < 30


def test_export_swaps_a_decoder_only_with_the_same_encoder(tiny_run, tiny_ae, tmp_path, capsys):
    out = tmp_path / "shipped"
    assert export.main(["--checkpoint", str(tiny_run / "checkpoint"), "--autoencoder",
                        str(tiny_ae / "autoencoder"), "--out", str(out)]) == 0
    Checkpoint(out)
    other = tmp_path / "other_ae"
    from neuraldoom import autoencoder as AE
    from neuraldoom.config import AutoencoderConfig

    AE.build_autoencoder(AutoencoderConfig(latent_channels=4, encoder_channels=8,
                                           decoder_channels=8)).save_pretrained(str(other))
    assert export.main(["--checkpoint", str(tiny_run / "checkpoint"), "--autoencoder", str(other),
                        "--out", str(tmp_path / "bad")]) == 2
    assert "another encoder" in capsys.readouterr().err


def test_export_sets_the_shipped_guidance(tiny_run, tmp_path, capsys):
    src = Checkpoint(tiny_run / "checkpoint")
    out = tmp_path / "g1"
    assert export.main(["--checkpoint", str(tiny_run / "checkpoint"), "--guidance", "1.0", "--out", str(out)]) == 0
    ck = Checkpoint(out)
    assert src.sampler_cfg.cfg != 1.0 and ck.sampler_cfg.cfg == 1.0
    assert all(torch.equal(x, y) for x, y in zip(src.denoiser.state_dict().values(),
                                                 ck.denoiser.state_dict().values(), strict=True))
    capsys.readouterr()
    assert export.main(["--checkpoint", str(out), "--guidance", "-1", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--guidance" in err and not (tmp_path / "bad").exists()


def test_export_half_stores_the_teacher_in_float16_and_keeps_students_consistent(tiny_run, tmp_path, capsys):
    import copy

    from neuraldoom.checkpoint import save_checkpoint, weights_digest

    src = Checkpoint(tiny_run / "checkpoint")
    half = tmp_path / "half"
    assert export.main(["--checkpoint", str(tiny_run / "checkpoint"), "--half", "--out", str(half)]) == 0
    unet_bytes = [sum(f.stat().st_size for f in (d / "unet").glob("*.safetensors")) for d in (src.path, half)]
    assert unet_bytes[1] < 0.55 * unet_bytes[0]
    ck = Checkpoint(half)
    for x, y in zip(src.denoiser.parameters(), ck.denoiser.parameters(), strict=True):
        assert y.dtype == torch.float32 and torch.equal(y, x.half().float())  # rounded once, played in float32
    # students distilled from the float32 teacher would no longer match it: refused, one line, nothing written
    withs = tmp_path / "withs"
    student = (copy.deepcopy(src.denoiser), {"base": weights_digest(src.denoiser), "teacher": "4-step DDIM"})
    save_checkpoint(withs, src.ae, src.denoiser, src.game, src.denoiser_cfg, src.sampler_cfg, src.context_frames,
                    src.context_actions, students={1: student})
    capsys.readouterr()
    assert export.main(["--checkpoint", str(withs), "--half", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--half" in err and not (tmp_path / "bad").exists()
    # a student of the rounded teacher travels with it, and exporting it again changes nothing
    student = (copy.deepcopy(ck.denoiser), {"base": weights_digest(ck.denoiser), "teacher": "4-step DDIM"})
    save_checkpoint(withs, ck.ae, ck.denoiser, ck.game, ck.denoiser_cfg, ck.sampler_cfg, ck.context_frames,
                    ck.context_actions, students={1: student}, half=True)
    again = tmp_path / "again"
    assert export.main(["--checkpoint", str(withs), "--half", "--out", str(again)]) == 0
    assert sorted(Checkpoint(again).students) == [1]
    assert weights_digest(Checkpoint(again).denoiser) == weights_digest(ck.denoiser)


def test_export_sets_the_deadband_that_play_then_uses(tiny_run, tiny_checkpoint, tmp_path):
    out = tmp_path / "db"
    assert export.main(["--checkpoint", str(tiny_run / "checkpoint"), "--deadband", "0.3", "--out", str(out)]) == 0
    ck = Checkpoint(out)
    assert Checkpoint(tiny_run / "checkpoint").sampler_cfg.deadband == 0.0 and ck.sampler_cfg.deadband == 0.3
    assert ck.denoiser.delta and NeuralEngine(ck, compile=False).sampler.deadband == 0.3  # the default: a delta model
    frame = tmp_path / "frame"
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--deadband", "0.3", "--out", str(frame)]) == 0
    assert not Checkpoint(frame).denoiser.delta
    assert NeuralEngine(Checkpoint(frame), compile=False).sampler.deadband == 0.0  # a frame model: no change to drop
    kept = tmp_path / "kept"  # no --deadband: the checkpoint's own travels on
    assert export.main(["--checkpoint", str(out), "--out", str(kept)]) == 0
    assert Checkpoint(kept).sampler_cfg.deadband == 0.3


def test_export_sets_the_steps_the_teacher_skips_and_play_runs_the_rest(tiny_run, tmp_path, capsys):
    out = tmp_path / "skip"
    assert export.main(["--checkpoint", str(tiny_run / "checkpoint"), "--skip", "1", "--out", str(out)]) == 0
    ck = Checkpoint(out)
    assert ck.sampler_cfg.steps == 4 and ck.sampler_cfg.skip == 1
    eng = NeuralEngine(ck, compile=False, teacher=True)
    assert [t for t, _, _ in eng.sampler.plan] == [749, 499, 249] and eng.label.startswith("3 of 4 steps")
    assert len(NeuralEngine(ck, compile=False, steps=2, teacher=True).sampler.plan) == 2  # another plan: all of it
    assert export.main(["--checkpoint", str(out), "--out", str(tmp_path / "kept")]) == 0
    assert Checkpoint(tmp_path / "kept").sampler_cfg.skip == 1
    assert export.main(["--checkpoint", str(out), "--skip", "4", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--skip" in err[0] and not (tmp_path / "bad").exists()


def continued(data, init, out, *extra: str) -> list[str]:
    """train_diffusion's arguments for two tiny steps continuing `init` into `out`, then `extra`."""
    return ["--data", str(data), "--init-from", str(init), "--out", str(out), "--steps", "2", "--batch", "2",
            "--max-frames", "300", "--eval-every", "2", "--no-compile", *extra]


def test_continued_training_keeps_the_checkpoints_guidance(tiny_checkpoint, tiny_dataset, tmp_path):
    g2 = tmp_path / "g2"
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--guidance", "2.0", "--out", str(g2)]) == 0
    out = tmp_path / "more"
    assert train_diffusion.main(continued(tiny_dataset, g2, out)) == 0
    assert Checkpoint(out / "checkpoint").sampler_cfg.cfg == 2.0


def test_continued_training_can_take_on_the_action_path(tiny_checkpoint, tiny_dataset, tmp_path):
    out = tmp_path / "aemb"
    assert train_diffusion.main(continued(tiny_dataset, tiny_checkpoint, out, "--action-embed")) == 0
    ck = Checkpoint(out / "checkpoint")
    assert ck.denoiser_cfg.action_embed and ck.denoiser.action_embed
    assert ck.denoiser.unet.time_embedding.cond_proj.weight.any()  # trained away from its zero start


@pytest.mark.parametrize("flag", [["--only-cross-attention"], ["--cross-only-levels", "1"]])
def test_continued_training_can_drop_self_attention(tiny_checkpoint, tiny_dataset, tmp_path, flag):
    from neuraldoom.actions import NOOP

    out = tmp_path / "xattn"
    assert train_diffusion.main(continued(tiny_dataset, tiny_checkpoint, out, *flag)) == 0
    ck = Checkpoint(out / "checkpoint")
    # the tiny UNet's two levels: level 1 is the only one with attention, so both flags drop it there
    assert ck.denoiser.unet.config.only_cross_attention in (True, [False, True])
    assert ck.denoiser_cfg.only_cross_attention or ck.denoiser_cfg.cross_only_levels == (1,)
    assert NeuralEngine(ck, compile=False).step(NOOP).shape == (120, 160, 3)  # it plays


def test_a_level_without_attention_is_refused(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    assert train_diffusion.main(continued(tiny_dataset, tiny_checkpoint, tmp_path / "x", "--cross-only-levels",
                                          "0")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cross_only_levels" in err[0]


def test_a_status_bar_denoiser_is_trained_on_its_rows_and_pasted_over_play(tiny_checkpoint, tiny_dataset, tmp_path):
    from neuraldoom.actions import NOOP
    from neuraldoom.checkpoint import CheckpointError

    bar = tmp_path / "bar"
    assert train_diffusion.main(continued(tiny_dataset, tiny_checkpoint, bar, "--rows", "28", "29", "32",
                                          "--event-share", "0.5", "--digit-weight", "10", "--event-after", "1",
                                          "--view-weight", "0.5")) == 0
    alone = Checkpoint(bar / "checkpoint")
    assert alone.denoiser_cfg.rows == (28, 29, 32) and tuple(alone.denoiser.unet.config.sample_size) == (4, 40)
    with pytest.raises(CheckpointError, match="export --bar"):  # its rows alone do not play
        NeuralEngine(alone, compile=False)
    out = tmp_path / "with-bar"
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--bar", str(bar / "checkpoint"), "--out", str(out)]) == 0
    again = tmp_path / "again"  # a re-export carries it, as it carries the students
    assert export.main(["--checkpoint", str(out), "--out", str(again)]) == 0
    ck = Checkpoint(again)
    # the bar's deadband: the frame's unless set apart, and play's bar sampler uses it
    assert NeuralEngine(ck, compile=False).bar_sampler.deadband == ck.sampler_cfg.deadband
    banded = tmp_path / "banded"
    assert export.main(["--checkpoint", str(again), "--bar-deadband", "0.5", "--out", str(banded)]) == 0
    assert Checkpoint(banded).sampler_cfg.bar_deadband == 0.5
    eng = NeuralEngine(Checkpoint(banded), compile=False)  # (a frame target has no change to drop: 0)
    assert eng.bar_sampler.deadband == (0.5 if ck.bar.delta else 0.0)
    assert eng.sampler.deadband == ck.sampler_cfg.deadband
    assert ck.bar is not None and ck.bar_cfg.rows == (28, 29, 32)
    for p, q in zip(ck.bar.parameters(), alone.denoiser.parameters(), strict=True):  # float16 on disk
        assert torch.allclose(p, q, atol=2e-3, rtol=2e-3)
    plain = NeuralEngine(Checkpoint(tiny_checkpoint), compile=False, seed=5)
    with_bar = NeuralEngine(ck, compile=False, seed=5)
    z0, z1 = plain.next_latent(NOOP), with_bar.next_latent(NOOP)
    # the rows above FIRST are the main denoiser's, as without the bar (the same noise and, at the first step, the
    # same ring); the bar's rows are its own
    assert torch.equal(z0[:, :, :29], z1[:, :, :29]) and not torch.allclose(z0[:, :, 29:], z1[:, :, 29:])
    assert with_bar.step(NOOP).shape == (120, 160, 3)
    one = NeuralEngine(ck, compile=False, seed=5, cores=1)  # the bar after the frame on one core: the same numbers
    assert torch.equal(one.next_latent(NOOP), z1)
    # --init-from a checkpoint that carries a bar for these rows continues that bar, not the frame denoiser
    more = tmp_path / "more"
    assert train_diffusion.main(continued(tiny_dataset, again, more, "--rows", "28", "29", "32", "--lr", "0")) == 0
    for p, q in zip(Checkpoint(more / "checkpoint").denoiser.parameters(), ck.bar.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)  # not moved (rate 0): the bar it started from
    assert not all(torch.allclose(p, q, atol=1e-6) for p, q in zip(ck.denoiser.parameters(), ck.bar.parameters(),
                                                                   strict=True))  # which is not the frame's
    # other rows (more of the view above the bar as context) start from the carried bar's weights too
    taller = tmp_path / "taller"
    assert train_diffusion.main(continued(tiny_dataset, again, taller, "--rows", "24", "29", "32", "--lr", "0")) == 0
    grown = Checkpoint(taller / "checkpoint")
    assert grown.denoiser_cfg.rows == (24, 29, 32) and tuple(grown.denoiser.unet.config.sample_size) == (8, 40)
    for p, q in zip(grown.denoiser.parameters(), ck.bar.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_export_play_like_ships_another_checkpoints_sampler_and_bar(tiny_checkpoint, tiny_dataset, tiny_run, tmp_path,
                                                                     capsys):
    """A denoiser trained from scratch on a shipped checkpoint's autoencoder plays the way that checkpoint does."""
    bar = tmp_path / "bar"
    assert train_diffusion.main(continued(tiny_dataset, tiny_checkpoint, bar, "--rows", "28", "29", "32")) == 0
    shipped = tmp_path / "shipped"
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--bar", str(bar / "checkpoint"), "--guidance", "1.0",
                        "--skip", "1", "--deadband", "0.3", "--bar-deadband", "0.5", "--out", str(shipped)]) == 0
    fresh = tmp_path / "fresh"  # other weights of the same encoder (the tiny checkpoint's untrained ones, moved)
    assert train_diffusion.main(continued(tiny_dataset, tiny_checkpoint, fresh)) == 0
    out = tmp_path / "out"
    assert export.main(["--checkpoint", str(fresh / "checkpoint"), "--play-like", str(shipped), "--skip", "2",
                        "--out", str(out)]) == 0
    ck, like = Checkpoint(out), Checkpoint(shipped)
    assert ck.sampler_cfg == replace(like.sampler_cfg, skip=2)  # its settings, the flags still on top
    assert (ck.sampler_cfg.cfg, ck.sampler_cfg.deadband, ck.sampler_cfg.bar_deadband) == (1.0, 0.3, 0.5)
    assert ck.bar is not None and all(torch.equal(p, q) for p, q in zip(ck.bar.parameters(), like.bar.parameters(),
                                                                         strict=True))
    assert all(torch.equal(p, q) for p, q in zip(ck.denoiser.parameters(),
                                                 Checkpoint(fresh / "checkpoint").denoiser.parameters(), strict=True))
    capsys.readouterr()  # another encoder's denoiser is refused: the bar and the bounds would not fit its latents
    assert export.main(["--checkpoint", str(tiny_run / "checkpoint"), "--play-like", str(shipped), "--out",
                        str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another encoder" in err[0] and not (tmp_path / "bad").exists()
    for flag, src in (("--play-like", shipped), ("--bar", bar / "checkpoint")):
        rescaled = tmp_path / f"rescaled{flag}"  # the same encoder's weights under another latent scale
        shutil.copytree(src, rescaled)
        cfg = json.loads((rescaled / "autoencoder" / "config.json").read_text())
        cfg["scaling_factor"] *= 2
        (rescaled / "autoencoder" / "config.json").write_text(json.dumps(cfg))
        assert export.main(["--checkpoint", str(fresh / "checkpoint"), flag, str(rescaled), "--out",
                            str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "normalization" in err[0] and not (tmp_path / "bad").exists()


def test_the_benchs_default_row_is_what_play_runs_for_an_unguided_teacher(tiny_checkpoint, tmp_path, monkeypatch):
    from neuraldoom import bench

    out = tmp_path / "cfg1"
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--guidance", "1.0", "--out", str(out)]) == 0
    monkeypatch.setattr(bench, "usable_cores", lambda: 2)
    ck = Checkpoint(out)
    (v,) = [v for v in bench.variants(ck, [False], [ck.sampler_cfg.steps], True) if v.default]
    play = NeuralEngine(ck, compile=False, cores=2, parallel="auto")  # as `python main.py` builds it
    assert (v.cores, v.parallel) == (2, "decode") and play.pipeline and not play.split


@pytest.mark.parametrize("rows", [["28", "29", "31"], ["29", "28", "32"], ["28"]])
def test_status_bar_rows_that_are_not_a_region_are_refused(tiny_checkpoint, tiny_dataset, tmp_path, capsys, rows):
    assert train_diffusion.main(continued(tiny_dataset, tiny_checkpoint, tmp_path / "x", "--rows", *rows)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rows" in err[0]


def test_export_refuses_a_whole_frame_denoiser_as_the_bar(tiny_checkpoint, tmp_path, capsys):
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--bar", str(tiny_checkpoint), "--out",
                        str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "whole frames" in err[0]


def test_continued_training_can_take_on_the_turn_warp(tiny_checkpoint, tiny_dataset, tmp_path):
    from neuraldoom import actions as A

    out = tmp_path / "warp"
    assert train_diffusion.main(continued(tiny_dataset, tiny_checkpoint, out, "--turn-warp")) == 0
    ck, before = Checkpoint(out / "checkpoint"), Checkpoint(tiny_checkpoint)
    assert ck.denoiser_cfg.turn_warp == tuple(d * ck.game.frame_skip for d in A.TURN_BUCKETS)
    assert 0 < ck.denoiser_cfg.warp_rows <= ck.denoiser.unet.config.sample_size[0]
    assert ck.denoiser.state_dict().keys() == before.denoiser.state_dict().keys()  # the same weights, warped
    assert ck.denoiser.grids is not None and before.denoiser.grids is None
    assert ck.denoiser_cfg.warp_mode == "bicubic"
    # and a warped one continues with the other resampling, which its checkpoint keeps
    assert train_diffusion.main(continued(tiny_dataset, out / "checkpoint", tmp_path / "nearest", "--turn-warp",
                                          "--warp-mode", "nearest", "--warp-fill", "last")) == 0
    ck = Checkpoint(tmp_path / "nearest" / "checkpoint")
    assert ck.denoiser_cfg.warp_mode == "nearest" and ck.denoiser.warp_mode == "nearest"
    assert ck.denoiser_cfg.warp_fill == "last" and ck.denoiser.unseen is not None


def test_the_learned_motion_trains_resumes_and_is_grafted_into_a_denoiser(tiny_checkpoint, tiny_dataset, tmp_path,
                                                                           capsys):
    from neuraldoom.checkpoint import load_model_dir
    from neuraldoom.flow import FlowNet
    from training import train_flow

    flow_out = tmp_path / "flow"
    common = ["--data", str(tiny_dataset), "--autoencoder", str(tiny_checkpoint / "autoencoder"), "--out",
              str(flow_out), "--batch", "4", "--width", "8", "--eval-every", "2", "--max-frames", "300"]
    assert train_flow.main([*common, "--steps", "3"]) == 0
    assert "learned motion" in capsys.readouterr().out
    first = load_model_dir(FlowNet, flow_out / "flow")
    assert first.out.weight.abs().sum() > 0  # trained away from its zero start (the turn warp alone)
    log = [json.loads(line) for line in (flow_out / "log.jsonl").read_text().splitlines()]
    assert {"held_copy", "held_turn", "held_flow"} <= set(log[-1])
    assert train_flow.main([*common, "--steps", "3"]) == 0  # done: a rerun resumes at the end, same weights
    again = load_model_dir(FlowNet, flow_out / "flow")
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), again.parameters(), strict=True))
    assert train_flow.main([*common[:-6], "--width", "16", "--steps", "4"]) == 2  # another architecture
    assert "--width" in capsys.readouterr().err

    out = tmp_path / "moved"
    dm = ["--data", str(tiny_dataset), "--init-from", str(tiny_checkpoint), "--steps", "2", "--batch", "2",
          "--max-frames", "300", "--eval-every", "2", "--no-compile"]
    assert train_diffusion.main([*dm, "--out", str(tmp_path / "x"), "--flow", str(flow_out / "flow")]) == 2
    assert "--turn-warp --warp-fill last" in capsys.readouterr().err
    assert train_diffusion.main([*dm, "--out", str(out), "--turn-warp", "--warp-fill", "last", "--flow",
                                 str(flow_out / "flow")]) == 0
    ck = Checkpoint(out / "checkpoint")
    assert ck.denoiser_cfg.flow and ck.denoiser.flow is not None
    assert all(torch.equal(p, q) for p, q in zip(ck.denoiser.flow.parameters(), first.parameters(), strict=True))
    # continued without --flow, the checkpoint keeps its motion
    assert train_diffusion.main([*dm[:3], str(out / "checkpoint"), *dm[4:], "--out", str(tmp_path / "more")]) == 0
    kept = Checkpoint(tmp_path / "more" / "checkpoint").denoiser.flow
    assert all(torch.equal(p, q) for p, q in zip(kept.parameters(), first.parameters(), strict=True))


def test_bench_prints_the_table_and_the_summary_line(tiny_checkpoint, capsys):
    from neuraldoom import bench

    assert bench.main(["--checkpoint", str(tiny_checkpoint), "--frames", "2", "--no-compile"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("fps=") and " eager_fps=" in last and " real_fps=" in last
    assert all(float(kv.split("=")[1]) > 0 for kv in last.split())


def test_diffusion_resume_with_other_architecture_is_one_line(tiny_run, tiny_ae, tiny_dataset, capsys):
    flags = [f if f != "16" else "32" for f in TINY_DM]  # another --block-out-channels
    assert train_diffusion.main(["--data", str(tiny_dataset), "--autoencoder", str(tiny_ae / "autoencoder"),
                                 "--out", str(tiny_run), "--steps", "6", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "block-out-channels" in err


@pytest.mark.parametrize("flags", [["--reference", "noisy"], ["--clean-share", "1.5"], ["--hud-weight", "0"],
                                   ["--event-share", "1.5"], ["--event-after", "-1"], ["--event-before", "-1"],
                                   ["--view-weight", "-1"],
                                   ["--drift", "-1"], ["--drift-share", "2"],
                                   ["--timesteps", "some"], ["--warp-mode", "cubic", "--turn-warp"],
                                   ["--warp-mode", "nearest"], ["--warp-fill", "zeros", "--turn-warp"],
                                   ["--warp-fill", "last"], ["--digit-scope", "some"],
                                   ["--event-fields", "ammo", "keys"], ["--digit-fields", "frags"],
                                   ["--own-unroll", "0"], ["--own-unroll", "9"], ["--wall-share", "2"]])
def test_diffusion_refuses_a_bad_training_option_in_one_line(tiny_ae, tiny_dataset, tmp_path, capsys, flags):
    assert train_diffusion.main(["--data", str(tiny_dataset), "--autoencoder", str(tiny_ae / "autoencoder"),
                                 "--out", str(tmp_path / "run"), "--steps", "2", *flags, *TINY_DM]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flags[0] in err
    assert not (tmp_path / "run" / "train_state.safetensors").exists()


def test_plan_timesteps_train_only_the_levels_the_sampler_uses(tiny_checkpoint, monkeypatch):
    from diffusers import DDPMScheduler

    from neuraldoom.sampler import DDIMSampler

    ck = Checkpoint(tiny_checkpoint)
    den = ck.denoiser
    levels = torch.tensor([t for t, _, _ in DDIMSampler(den, 4, 1.0).plan])
    assert levels.tolist() == [999, 749, 499, 249]
    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", prediction_type="v_prediction")
    seen = []
    add_noise = sched.add_noise
    monkeypatch.setattr(sched, "add_noise", lambda x, e, t: seen.append(t) or add_noise(x, e, t))
    c, hw = den.unet.config.out_channels, tuple(den.unet.config.sample_size)
    z, ctx = torch.randn(16, c, *hw), torch.randn(16, den.context, c, *hw)
    codes = torch.zeros(16, den.context + 1, 2, dtype=torch.long)
    cfg = ck.denoiser_cfg
    with torch.no_grad():
        for lv in (levels, None):
            train_diffusion.diffusion_loss(den, sched, (z, ctx, codes), cfg, 0.0, torch.Generator().manual_seed(0),
                                           torch.device("cpu"), "clean", levels=lv)
    assert set(seen[0].tolist()) <= set(levels.tolist()) and len(set(seen[0].tolist())) > 1
    assert not set(seen[1].tolist()) <= set(levels.tolist())  # the default: the whole schedule


def test_importance_timesteps_draw_where_the_gradient_is_noisy_and_weigh_back_to_the_uniform_loss(tiny_checkpoint):
    p = train_diffusion.importance_probs(1000, (1.0, 4.0, 9.0, 16.0))
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))
    assert torch.all(p[:250] == p[0]) and torch.all(p[750:] == p[999])
    torch.testing.assert_close(p[999] / p[0], torch.tensor(4.0))  # proportional to the energy's square root
    t = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert abs(float((1.0 / (1000 * p[t])).mean()) - 1.0) < 0.01  # E[1/(T p)] = 1: the expectation is kept

    ck = Checkpoint(tiny_checkpoint)
    den, cfg = ck.denoiser, ck.denoiser_cfg
    sched = train_diffusion.noise_schedule(cfg)
    c, hw = den.unet.config.out_channels, tuple(den.unet.config.sample_size)
    g = torch.Generator().manual_seed(3)
    z, ctx = torch.randn(4, c, *hw, generator=g), torch.randn(4, den.context, c, *hw, generator=g)
    codes = torch.zeros(4, den.context + 1, 2, dtype=torch.long)
    one = torch.zeros(1000)
    one[600] = 1.0  # every sample at t = 600, weighted 1/(1000 * 1)

    def loss(**kw) -> float:
        gen = torch.Generator().manual_seed(0)
        return float(train_diffusion.diffusion_loss(den, sched, (z, ctx, codes), cfg, 0.0, gen, torch.device("cpu"),
                                                    "clean", **kw))
    with torch.no_grad():
        assert loss(probs=one, t_weight=1 / (1000 * one)) == pytest.approx(loss(levels=torch.tensor([600])) / 1000,
                                                                         rel=1e-5)


def test_lognormal_timesteps_and_min_snr_weights(tiny_checkpoint):
    sched = train_diffusion.noise_schedule(Checkpoint(tiny_checkpoint).denoiser_cfg)
    sig = train_diffusion.sigmas(sched)
    p = train_diffusion.lognormal_probs(sched, mean=0.0, std=1.0)
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))
    t = torch.multinomial(p, 100_000, replacement=True, generator=torch.Generator().manual_seed(0))
    ls = sig[t].log()
    assert abs(float(ls.mean())) < 0.03 and abs(float(ls.std()) - 1.0) < 0.03  # ln sigma ~ N(0, 1) as asked
    shipped = train_diffusion.lognormal_probs(sched)
    assert float(shipped[750:].sum()) < 0.05 < float(shipped[:250].sum())  # the loud levels seldom drawn

    w = train_diffusion.min_snr_weights(sched, 5.0)
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))
    snr = 1 / sig**2
    raw = torch.minimum(snr, torch.tensor(5.0, dtype=snr.dtype)) / (snr + 1)
    torch.testing.assert_close(w.double() / w[500].double(), raw / raw[500], rtol=1e-5, atol=1e-9)
    top = int(torch.argmax(w))
    assert abs(float(snr[top]) - 5.0) < 1.0  # the weight peaks where SNR = gamma
    assert float(w[999]) < 1e-3 * float(w[top])  # pure noise counts for next to nothing


def test_train_diffusion_refuses_bad_noise_level_options(tmp_path, tiny_checkpoint, capsys):
    for bad in (["--timesteps", "edm"], ["--snr-gamma", "-1"], ["--offset-noise", "-0.1"]):
        rc = train_diffusion.main(["--data", str(tmp_path), "--init-from", str(tiny_checkpoint),
                                   "--out", str(tmp_path / "run"), *bad])
        assert rc == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and any(f in err[0] for f in ("--timesteps", "--snr-gamma", "--offset-noise"))


def test_offset_noise_moves_each_channels_mean_and_is_off_at_zero():
    shape = (4096, 3, 8, 10)
    plain = train_diffusion.training_noise(shape, 0.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(plain, torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    off = train_diffusion.training_noise(shape, 0.5, torch.Generator().manual_seed(0))
    torch.testing.assert_close(off - plain, (off - plain).mean((2, 3), keepdim=True).expand(shape))  # a constant
    means = off.mean((2, 3))  # white noise alone: std 1/sqrt(80) = 0.11; with the offset sqrt(0.25 + 0.0125)
    assert abs(float(means.std()) - (0.25 + 1 / 80) ** 0.5) < 0.02
    assert abs(float(plain.mean((2, 3)).std()) - (1 / 80) ** 0.5) < 0.01


def test_the_status_bar_rows_and_their_loss_weight(tiny_checkpoint):
    from diffusers import DDPMScheduler

    assert train_diffusion.hud_rows(16, 8, 120).nonzero().flatten().tolist() == [12, 13, 14]  # pixels 96-119
    ck = Checkpoint(tiny_checkpoint)
    den, cfg = ck.denoiser.eval(), ck.denoiser_cfg
    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", prediction_type="v_prediction")
    g = torch.Generator().manual_seed(0)
    C, h, w = 4, 16, 20
    batch = (torch.randn(2, C, h, w, generator=g), torch.randn(2, den.context, C, h, w, generator=g),
             torch.randint(0, 7, (2, den.context + 1, 2), generator=g))

    def loss(weight):
        with torch.no_grad():
            return float(train_diffusion.diffusion_loss(den, sched, batch, cfg, 0.0, torch.Generator().manual_seed(1),
                                                        torch.device("cpu"), weight=weight))

    plain = loss(None)
    assert loss(torch.full((h, w), 3.0)) == pytest.approx(plain, rel=1e-6)  # normalised: a uniform weight is none
    assert train_diffusion.loss_weights((h, w), 8, (120, 160), 1.0, 1.0) is None
    hud_w = train_diffusion.loss_weights((h, w), 8, (120, 160), 10.0, 1.0)
    hud = loss(hud_w)
    assert hud != pytest.approx(plain, rel=1e-3)
    # per-sample weights (--digit-scope events): the same weight on every sample is the (h, w) one; a weight
    # on the first sample alone is another loss
    assert loss(torch.stack([hud_w, hud_w])) == pytest.approx(hud, rel=1e-6)
    first = loss(torch.stack([hud_w, torch.ones(h, w)]))
    assert first != pytest.approx(hud, rel=1e-3) and first != pytest.approx(plain, rel=1e-3)


def test_the_number_cells_weighted_are_the_ones_the_digits_are_drawn_in():
    # 4x latents of a 160x120 frame padded to 128 rows: digit rows 102-111 are latent rows 25-27, and the
    # ammo, health and armor cells (x 1-22, 24-45, 90-111) are latent columns 0-5, 6-11 and 22-27
    cells = train_diffusion.number_cells((32, 40), 4, (120, 160))
    assert cells.nonzero()[:, 0].unique().tolist() == [25, 26, 27]
    assert cells.nonzero()[:, 1].unique().tolist() == [*range(0, 12), *range(22, 28)]
    w = train_diffusion.loss_weights((32, 40), 4, (120, 160), 2.0, 30.0)
    assert w[cells].eq(30).all() and w[28, 30] == 2 and w[0, 0] == 1  # numbers, the rest of the bar, the view
    assert not train_diffusion.number_cells((16, 20), 8, (96, 128)).any()  # no reader: nothing weighted
    ammo = train_diffusion.number_cells((32, 40), 4, (120, 160), ("ammo",))
    assert ammo.nonzero()[:, 1].unique().tolist() == [*range(0, 6)] and not (ammo & ~cells).any()
    w = train_diffusion.loss_weights((32, 40), 4, (120, 160), 1.0, 30.0, ("ammo",))
    assert w[ammo].eq(30).all() and w[cells & ~ammo].eq(1).all()
    bar = train_diffusion.bar_weights(w, (16, 25, 32), 40, 0.1)  # a bar reading the view's rows 16-24
    assert bar.shape == (16, 40) and torch.equal(bar[9:], w[25:]) and bar[:9].eq(0.1).all()
    assert train_diffusion.bar_weights(None, (24, 25, 32), 40, 1.0) is None  # all alike
    stacked = train_diffusion.bar_weights(torch.stack([w, w]), (24, 25, 32), 40, 0.0)  # per sample
    assert stacked.shape == (2, 8, 40) and stacked[:, 0].eq(0).all() and torch.equal(stacked[1, 1:], w[25:])


def test_number_moves_reads_how_far_the_numbers_went_from_the_old_to_the_new():
    from neuraldoom import autoencoder as AE
    from neuraldoom.config import AutoencoderConfig

    torch.manual_seed(0)
    ae = AE.build_autoencoder(AutoencoderConfig(latent_channels=4, encoder_channels=8, decoder_channels=8)).eval()
    rng = np.random.default_rng(0)
    prev = rng.integers(0, 256, (2, 120, 160, 3), dtype=np.uint8)
    real = prev.copy()
    real[:, 100:114] = 255 - real[:, 100:114]  # the numbers' rows change, the view does not
    rec = AE.decode(ae, AE.encode(ae, np.concatenate([prev, real])), 120, 160).astype(np.float32)
    old, new = rec[:2], rec[2:]
    np.testing.assert_allclose(evaluate.number_moves(ae, prev, real, old), 0, atol=1e-6)  # the old count copied
    np.testing.assert_allclose(evaluate.number_moves(ae, prev, real, new), 1, atol=1e-6)  # the new one drawn
    np.testing.assert_allclose(evaluate.number_moves(ae, prev, real, (old + new) / 2), 0.5, atol=1e-5)
    assert evaluate.number_moves(ae, prev[:, :96, :128], real[:, :96, :128], old[:, :96, :128]) is None


def test_drift_offsets_are_smooth_casts_on_a_share_of_the_batch():
    g = torch.Generator().manual_seed(0)
    assert not train_diffusion.drift_offsets((8, 4, 16, 20), 0.5, 0.0, g).any()
    off = train_diffusion.drift_offsets((256, 4, 16, 20), 0.5, 0.5, g)
    moved = off.flatten(1).abs().amax(1) > 0
    assert 0.35 < moved.float().mean() < 0.65
    assert off.abs().amax() < 0.5 * 4  # a few stds of N(0, 1) at most
    # smooth: neighbouring cells differ far less than the offset itself
    assert (off[..., 1:] - off[..., :-1]).abs().mean() < 0.1 * off[moved].abs().mean()


def test_drift_enters_the_context_and_the_reference_alike(tiny_checkpoint):
    from dataclasses import replace

    from diffusers import DDPMScheduler

    from neuraldoom.denoiser import Denoiser

    ck = Checkpoint(tiny_checkpoint)
    cfg = replace(ck.denoiser_cfg, target="delta", delta_scale=0.4)
    den = Denoiser(ck.denoiser.unet, ck.denoiser.action_encoder, cfg).eval()
    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", prediction_type="v_prediction")
    g = torch.Generator().manual_seed(0)
    C, h, w = 4, 16, 20
    target = torch.randn(2, C, h, w, generator=g)
    ctx = torch.randn(2, den.context, C, h, w, generator=g)
    codes = torch.randint(0, 7, (2, den.context + 1, 2), generator=g)

    def loss(batch, **kw):
        with torch.no_grad():
            return float(train_diffusion.diffusion_loss(den, sched, batch, cfg, 0.0, gen, torch.device("cpu"),
                                                        "clean", **kw))

    gen = torch.Generator().manual_seed(1)
    drifted = loss((target, ctx, codes), drift=0.5, drift_share=1.0)
    gen = torch.Generator().manual_seed(1)
    off = train_diffusion.drift_offsets(target.shape, 0.5, 1.0, gen)
    # the same draws by hand: an offset context whose target is the real next frame (the change and the way back)
    assert drifted == pytest.approx(loss((target, ctx + off[:, None], codes)), rel=1e-6)
    gen = torch.Generator().manual_seed(1)
    train_diffusion.drift_offsets(target.shape, 0.5, 1.0, gen)
    assert drifted != pytest.approx(loss((target + off, ctx + off[:, None], codes)), rel=1e-3)


def test_the_status_bar_events_are_the_rows_whose_numbers_change(tiny_ae, tiny_dataset, tmp_path):
    import numpy as np
    from diffusers import AutoencoderTiny

    from neuraldoom import statusbar as SB
    from neuraldoom.checkpoint import load_model_dir
    from neuraldoom.recording import open_dataset
    from training import latents as L

    ae = load_model_dir(AutoencoderTiny, tiny_ae / "autoencoder")
    data = L.build(ae, tiny_dataset / "train", tmp_path / "latents", 0, events=SB.FIELDS)
    recs = [r for r in open_dataset(tiny_dataset / "train") if len(r)]
    shown = np.concatenate([SB.frame_values(r) for r in recs])
    read = np.concatenate([SB.default_reader().read(r.frames) for r in recs])
    maybe = (shown[1:] != shown[:-1]).any((1, 2))  # the variables changed around the step: it may show
    seen = (read[1:] != read[:-1]).any(1)  # the bar reads other numbers than the frame before
    targets = data.targets.numpy()
    events = set(data.event_targets.tolist())
    assert events and events <= set(targets.tolist())  # random play spends ammo within 400 steps
    assert all(seen[i - 1] == (i in events) for i in targets)  # within episodes: a target has a row before
    assert all(maybe[i - 1] for i in events) and sum(maybe[i - 1] for i in targets) > len(events)

    before = data.event_targets.clone()
    data.follow_events(0)
    assert torch.equal(data.event_targets, before)
    data.follow_events(2)
    after, ep, rows = set(data.event_targets.tolist()), data.ep_start.numpy(), set(targets.tolist())
    assert events < after <= rows
    for i in after - events:  # one or two steps after an event of its own episode
        assert any(i - j in events and ep[i - j] == ep[i] for j in (1, 2))
    for i in events:  # every target that follows one within two steps
        assert all(i + j in after for j in (1, 2) if i + j in rows and ep[i + j] == ep[i])

    data.event_targets = before.clone()
    data.follow_events(0, 3)  # and the three that lead up to each, within its episode
    lead = set(data.event_targets.tolist())
    assert events < lead <= rows
    for i in lead - events:
        assert any(i + j in events and ep[i + j] == ep[i] for j in (1, 2, 3))
    for i in events:
        assert all(i - j in lead for j in (1, 2, 3) if i - j in rows and ep[i - j] == ep[i])


def test_close_wall_tells_a_wall_seen_from_up_close_from_a_view_with_floor_or_colour(tiny_dataset):
    from neuraldoom import metrics as M
    from neuraldoom.recording import open_dataset

    rng = np.random.default_rng(0)
    stone = np.clip(110 + rng.normal(0, 12, (120, 160, 1)), 0, 255).repeat(3, -1).astype(np.uint8)
    floor = stone.copy()
    floor[60:100] = 30  # a dark floor below the horizon
    brown = stone.copy()
    brown[..., 2] //= 2  # a wooden wall: not neutral
    dark = (stone // 4).astype(np.uint8)  # an unlit wall: not mid grey
    bar_only = stone.copy()
    bar_only[101:] = 0  # what lies in the status bar's rows does not count
    got = M.close_wall(np.stack([stone, floor, brown, dark, bar_only]))
    assert got.tolist() == [True, False, False, False, True]
    # the real game's start view (a room) is none, and chunks give what one pass gives
    real = np.asarray(open_dataset(tiny_dataset / "train")[0].frames[:64])
    assert not M.close_wall(real[:1]).any()
    assert (M.close_wall(real, chunk=5) == M.close_wall(real)).all()


def test_a_wall_share_draws_close_wall_targets_that_much_less(tiny_ae, tiny_dataset, tmp_path):
    import torch
    from diffusers import AutoencoderTiny

    from neuraldoom import metrics as M
    from neuraldoom.checkpoint import load_model_dir
    from neuraldoom.recording import open_dataset
    from training import latents as L

    ae = load_model_dir(AutoencoderTiny, tiny_ae / "autoencoder")
    data = L.build(ae, tiny_dataset / "train", tmp_path / "latents", 0, walls=True)
    frames = np.concatenate([np.asarray(r.frames) for r in open_dataset(tiny_dataset / "train") if len(r)])
    assert data.wall.numpy().tolist() == M.close_wall(frames).tolist()
    data.wall[data.targets[::3]] = True  # the tiny play may face no wall: mark a third of the targets
    data.open_targets = data.targets[~data.wall[data.targets]]
    plain = data.targets[torch.randint(0, len(data), (4000,), generator=torch.Generator().manual_seed(3))]
    assert data.draw(4000, torch.Generator().manual_seed(3)).tolist() == plain.tolist()  # 1: as recorded
    walls = [float(data.wall[data.draw(4000, torch.Generator().manual_seed(3), s)].float().mean()) for s in (0.5, 0)]
    share = float(data.wall[plain].float().mean())
    assert walls[0] == pytest.approx(share / 2, abs=0.03) and walls[1] == 0
    assert set(data.draw(4000, torch.Generator().manual_seed(3), 0).tolist()) <= set(data.targets.tolist())


def test_experiment_trains_a_delta_variant_evaluates_and_appends_a_row(tiny_ae, tiny_dataset, tmp_path):
    from training import experiment

    table = tmp_path / "EXPERIMENTS.md"
    argv = ["--name", "delta", "--data", str(tiny_dataset), "--autoencoder", str(tiny_ae / "autoencoder"),
            "--minutes", "0.05", "--out", str(tmp_path / "exp"), "--table", str(table), "--samples", "4",
            "--rollouts", "1", "--rollout-steps", "8", "--still", "0", "--", "--target", "delta", "--reads", "2",
            "--reference", "clean", "--clean-share", "0.5", "--own-frames", "0.5", "--schedule", "cosine",
            "--hud-weight", "4", "--event-share", "0.5", "--timesteps", "plan", "--digit-weight", "30",
            "--digit-scope", "events", "--event-fields", "ammo", "--digit-fields", "ammo", *TINY_DM]
    assert experiment.main(argv) == 0
    ck = Checkpoint(tmp_path / "exp" / "delta" / "checkpoint")
    assert ck.config["notes"]["timesteps"] == "plan" and ck.config["notes"]["event_fields"] == ["ammo"]
    assert ck.denoiser_cfg.target == "delta" and ck.denoiser_cfg.reads == 2 and ck.denoiser_cfg.delta_scale > 0
    # the budget is spent: no more training, one more evaluated row, with free play under its own header
    assert experiment.main(argv[:argv.index("--")] + ["--free-steps", "4"] + argv[argv.index("--"):]) == 0
    lines = table.read_text().splitlines()
    rows = [x for x in lines if x.startswith("| delta, CFG 1.5 |")]
    assert len(rows) == 2 and rows[0].split("|")[3] == rows[1].split("|")[3]  # same samples seen
    assert "--target delta" in rows[0] and "--free-steps 4" in rows[1]
    heads = [i for i, x in enumerate(lines) if x.startswith("| variant | budget |")]
    assert len(heads) == 2 and "free play 4" in lines[heads[1]] and "free play" not in lines[heads[0]]
    for h in heads:  # every row has its header's columns
        assert lines[h + 2].count("|") == lines[h].count("|") == lines[h + 1].count("|")
    assert re.search(r"\| \d\.\d\d–\d\.\d\d / \d+ \|", rows[1])  # the free-play cell


def test_pipeline_runs_every_stage_on_a_tiny_budget(tmp_path):
    """The one-shot command prepared for a lent GPU, end to end on the CPU with tiny budgets."""
    from training import pipeline

    out = tmp_path / "gpu"
    argv = ["--out", str(out), "--frames", "400", "--workers", "1", "--ae-minutes", "0.02", "--dec-minutes", "0.01",
            "--dm-minutes", "0.03", "--ae-batch", "4", "--batch", "4", "--latent-channels", "4",
            "--block-out-channels", "8", "16", "--rollouts", "1", "--rollout-steps", "8",
            "--extra-collect", "--episode-tics 160 --heldout 0.3 --seed 3",
            "--extra-ae", "--encoder-channels 8 --decoder-channels 8 --eval-frames 8 --eval-every 5",
            "--extra-dm", "--context 4 --attention-heads 2 --cross-attention-dim 16 --max-frames 300 --no-compile",
            "--extra-eval", "--samples 8 --still 0 --events 4"]
    assert pipeline.main(argv) == 0
    ck = Checkpoint(out / "checkpoint")
    assert ck.denoiser_cfg.target == "delta"
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["tf_psnr"] > 0 and len(report["ar_psnr"]) == 8


def test_pipeline_continues_a_checkpoint_and_compares_it_with_its_start(tiny_checkpoint, tmp_path, capsys):
    """--init-from: the checkpoint's game collected, its autoencoder kept, its denoiser trained on, a student
    distilled, and both the start and the result evaluated on the same held-out play."""
    from training import pipeline

    out = tmp_path / "gpu"
    argv = ["--out", str(out), "--init-from", str(tiny_checkpoint), "--frames", "400", "--workers", "1",
            "--dm-minutes", "0.03", "--batch", "4", "--student-minutes", "0.02", "--rollouts", "1",
            "--rollout-steps", "4", "--max-frames", "300", "--extra-eval", "--samples 8 --still 0 --events 4",
            "--extra-collect", "--episode-tics 160 --heldout 0.3 --seed 3"]
    assert pipeline.main(argv) == 0
    assert not (out / "ae").exists() and not (out / "dec").exists()
    start, ck = Checkpoint(tiny_checkpoint), Checkpoint(out / "checkpoint")
    assert ck.game == start.game and ck.denoiser_cfg == start.denoiser_cfg
    for x, y in zip(ck.ae.state_dict().values(), start.ae.state_dict().values(), strict=True):
        assert torch.equal(x, y)  # the autoencoder is the start's
    assert any(not torch.equal(x, y) for x, y in zip(ck.denoiser.state_dict().values(),
                                                      start.denoiser.state_dict().values(), strict=True))
    assert 1 in ck.student_models()  # the new teacher's own student, carried
    both = [json.loads((out / d / "report.json").read_text()) for d in ("eval-start", "eval")]
    assert both[0]["copy_last_psnr"] == both[1]["copy_last_psnr"]  # the same held-out targets
    table = (out / "compare.txt").read_text()
    assert "teacher-forced" in table and table in capsys.readouterr().out
    assert pipeline.main([*argv[:2], "--init-from", str(tmp_path / "nothing")]) == 2


def test_pipeline_fresh_trains_a_new_denoiser_on_the_checkpoints_autoencoder(tiny_checkpoint, tmp_path, capsys):
    """--fresh: the checkpoint's game and autoencoder, a denoiser started over (here with the turn warp, which
    must be trained from its first step), shipped with the checkpoint's sampler settings."""
    from training import pipeline

    start = tmp_path / "start"  # a start with sampler settings of its own, to see them travel
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--guidance", "1.0", "--skip", "1", "--out",
                        str(start)]) == 0
    out = tmp_path / "gpu"
    argv = ["--out", str(out), "--init-from", str(start), "--fresh", "--frames", "400", "--workers", "1",
            "--dm-minutes", "0.03", "--batch", "4", "--rollouts", "1", "--rollout-steps", "4", "--max-frames", "300",
            "--extra-dm", "--context 4 --block-out-channels 8 16 --attention-heads 2 --cross-attention-dim 16 "
                          "--turn-warp --no-compile",
            "--extra-eval", "--samples 8 --still 0 --events 4",
            "--extra-collect", "--episode-tics 160 --heldout 0.3 --seed 3"]
    assert pipeline.main(argv) == 0
    was, ck = Checkpoint(start), Checkpoint(out / "checkpoint")
    assert ck.game == was.game and ck.sampler_cfg == was.sampler_cfg
    assert ck.denoiser_cfg.turn_warp and not was.denoiser_cfg.turn_warp  # a new denoiser, not the start's
    for x, y in zip(ck.ae.state_dict().values(), was.ae.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert "teacher-forced" in (out / "compare.txt").read_text()
    capsys.readouterr()
    assert pipeline.main(["--out", str(tmp_path / "bad"), "--fresh"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--init-from" in err[0]


def test_a_split_without_frames_is_one_line_not_a_traceback(tiny_checkpoint, tmp_path, capsys):
    """A short collection can leave the held-out split empty (it gets whole episodes): one line, exit 2."""
    from training import collect

    data = tmp_path / "short"
    assert collect.main(["--steps", "100", "--out", str(data), "--workers", "1", "--heldout", "0"]) == 0
    capsys.readouterr()
    assert train_diffusion.main(["--data", str(data), "--init-from", str(tiny_checkpoint), "--out",
                                 str(tmp_path / "dm"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "heldout holds no frames" in err and "Traceback" not in err


def test_decoder_fine_tune_with_a_discriminator_resumes_it(tiny_ae, tiny_dataset, tmp_path, capsys):
    from neuraldoom.checkpoint import load_state

    out = tmp_path / "dec"
    argv = ["--data", str(tiny_dataset), "--out", str(out), "--init-from", str(tiny_ae / "autoencoder"),
            "--decoder-only", "--batch", "2", "--eval-every", "3", "--eval-frames", "4", "--adv-weight", "0.1",
            "--grad-weight", "0.5"]
    assert train_autoencoder.main([*argv, "--steps", "3"]) == 0
    tensors, meta = load_state(out / "dec_state.safetensors")
    disc = {k: v for k, v in tensors.items() if k.startswith("disc.")}
    assert disc and any(k.startswith("dopt.") for k in tensors) and meta["step"] == 3
    assert train_autoencoder.main([*argv, "--steps", "4"]) == 0
    assert "resuming at step 3" in capsys.readouterr().out
    after, _ = load_state(out / "dec_state.safetensors")
    assert any(not torch.equal(after[k], v) for k, v in disc.items())  # the discriminator kept training


def test_rollout_strip_writes_the_shown_steps(tiny_checkpoint, tmp_path, capsys):
    from PIL import Image

    from training import rollout_strip

    out = tmp_path / "strip.png"
    assert rollout_strip.main(["--checkpoint", str(tiny_checkpoint), "--out", str(out), "--steps", "6",
                               "--show", "0", "3", "6"]) == 0
    assert Image.open(out).size == (3 * 160, 120)
    assert "0, 3, 6" in capsys.readouterr().out
    assert rollout_strip.main(["--checkpoint", str(tmp_path / "none"), "--out", str(out)]) == 2
    straight = tmp_path / "straight.png"
    assert rollout_strip.main(["--checkpoint", str(tiny_checkpoint), "--out", str(straight), "--steps", "6",
                               "--show", "0", "3", "6", "--policy", "straight"]) == 0
    assert Image.open(straight).size == (3 * 160, 120)
    capsys.readouterr()
    assert rollout_strip.main(["--checkpoint", str(tiny_checkpoint), "--out", str(out), "--policy", "drunk"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--policy" in err


def test_rollout_strip_real_row_is_the_real_game_on_the_same_actions(tiny_checkpoint, tmp_path, capsys):
    from dataclasses import replace

    from PIL import Image

    from neuraldoom import actions as A
    from neuraldoom.checkpoint import Checkpoint
    from neuraldoom.game import RealGame
    from training import rollout_strip

    out = tmp_path / "real.png"
    assert rollout_strip.main(["--checkpoint", str(tiny_checkpoint), "--out", str(out), "--steps", "5",
                               "--show", "0", "5", "--real", "--seed", "3"]) == 0
    strip = np.asarray(Image.open(out))
    assert strip.shape == (2 * 120, 2 * 160, 3)
    assert "dB vs real" in capsys.readouterr().out
    # the bottom row, replayed by hand: the policy's first draws are the warm-up, the next 5 the shown steps
    ckpt = Checkpoint(tiny_checkpoint)
    draw = A.StickyRandomPolicy(np.random.default_rng(3))
    game = RealGame(replace(ckpt.game, episode_timeout=0))
    try:
        game.reset(3)
        for _ in range(ckpt.denoiser_cfg.context - 1):
            frame = game.step(draw()).copy()
        warm = frame
        for _ in range(5):
            frame = game.step(draw()).copy()
    finally:
        game.close()
    assert np.array_equal(strip[120:, :160], warm) and np.array_equal(strip[120:, 160:], frame)
    assert np.array_equal(strip[:120, :160], warm)  # step 0: both engines show the last real frame
    assert not np.array_equal(warm, frame)


def test_colour_cast_reads_a_tinted_view_not_the_status_bar():
    from neuraldoom.metrics import hud_top
    from training.rollout_strip import colour_cast

    grey = np.full((120, 160, 3), 60, np.uint8)
    assert colour_cast(grey) == 0
    red = grey.copy()
    red[:hud_top(120), :, 0] = 150
    assert colour_cast(red) == 90
    bar = grey.copy()
    bar[hud_top(120):, :, 0] = 255  # the status bar's red digits are not the view's colour
    assert colour_cast(bar) == 0


def test_diffusion_trains_with_no_warmup(tiny_ae, tiny_dataset, tmp_path):
    assert train_diffusion.main(["--data", str(tiny_dataset), "--autoencoder", str(tiny_ae / "autoencoder"),
                                 "--out", str(tmp_path / "dm"), "--steps", "2", "--warmup", "0", *TINY_DM]) == 0


def test_compare_autoencoders_prints_a_row_each_and_the_pictures(tiny_ae, tiny_dataset, tmp_path, capsys):
    from training import compare_autoencoders

    ae = str(tiny_ae / "autoencoder")
    assert compare_autoencoders.main(["--data", str(tiny_dataset), "--autoencoders", ae, ae, "--names", "a", "b",
                                      "--frames", "16", "--pictures", str(tmp_path / "pics")]) == 0
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith(("| a |", "| b |"))]
    assert len(rows) == 2 and rows[0].split("|")[2:4] == rows[1].split("|")[2:4]  # same model, same numbers
    assert (tmp_path / "pics" / "reconstructions.png").exists() and (tmp_path / "pics" / "statusbar.png").exists()
    assert compare_autoencoders.main(["--data", str(tiny_dataset), "--autoencoders", ae, "--names", "a", "b"]) == 2


def test_diffusion_scales_out_to_two_processes(tiny_checkpoint, tiny_dataset, tmp_path):
    """Two CPU processes (torchrun: `accelerate launch --cpu` starts one process on a CPU machine; on GPUs
    `accelerate launch --multi_gpu`): the main one alone encodes the cache and writes log and checkpoint,
    and a time limit stops both (one stopping alone would leave the other waiting at the all-reduce)."""
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(os.path.dirname(os.path.dirname(__file__))), "OMP_NUM_THREADS": "1"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "training.train_diffusion", "--data",
                        str(tiny_dataset), "--init-from", str(tiny_checkpoint), "--out", str(out), "--steps",
                        "100000", "--minutes", "0.05", "--batch", "2", "--max-frames", "300", "--eval-every", "2",
                        "--no-compile"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("2 process(es)") == 1 and r.stdout.count("train_diffusion: step") == 1
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(2, 2 * len(log) + 1, 2))  # one writer, no duplicates
    assert log[-1]["samples"] == 2 * 2 * log[-1]["step"]  # both processes' batches count
    ck = Checkpoint(out / "checkpoint")
    assert ck.config["notes"]["samples"] >= log[-1]["samples"]
    assert sorted(p.name for p in (out / "latents" / "train").rglob("meta.json")) == ["meta.json"]


def test_cosine_schedule_anneals_over_the_run_and_resumes_where_it_was(tmp_path):
    """The cosine reaches 5% of --lr at the run's end and a resumed run picks up its rate at its step."""
    import torch
    from accelerate import Accelerator

    from training import trainer

    def run_at(step: int, total: int) -> float:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        prog = trainer.Progress(Accelerator(cpu=True), tmp_path / "log.jsonl", total, step, 0, 0.0, 0.0, "t")
        sched = trainer.lr_schedule(opt, "cosine", 10, prog)
        assert sched.get_last_lr()[0] == opt.param_groups[0]["lr"]
        prog.close()
        return opt.param_groups[0]["lr"]

    assert run_at(0, 100) == pytest.approx(0.1)  # warm-up: (0 + 1) / 10
    assert run_at(50, 100) == pytest.approx(0.05 + 0.95 * 0.5)
    assert run_at(100, 100) == pytest.approx(0.05)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    prog = trainer.Progress(Accelerator(cpu=True), tmp_path / "log.jsonl", 100, 60, 0, 0.0, 0.0, "t")
    assert trainer.lr_schedule(opt, "constant", 10, prog).get_last_lr()[0] == 1.0
    prog.close()


def test_probe_reports_the_rows_on_real_held_out_play(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    import json

    import numpy as np

    from neuraldoom import autoencoder as AE
    from neuraldoom import metrics as M
    from neuraldoom.recording import Recording, find_recordings
    from training import probe

    out = tmp_path / "probe"
    argv = ["--checkpoint", str(tiny_checkpoint), "--data", str(tiny_dataset), "--out", str(out), "--samples", "5",
            "--temperatures", "1.0", "0.0"]
    assert probe.main(argv) == 0
    rep = json.loads((out / "probe.json").read_text())
    rows = rep["rows"]
    assert rep["samples"] == 5 and "one-pass mean, all actions of another target" in rows
    assert rows["sample, temperature 1"]["latent_mse"] != rows["sample, temperature 0"]["latent_mse"]
    # the later steps started from the real frame: one row per later step of the plan, and the last one
    # (the least noise) lands nearer the real latent than a sample from pure noise
    late = [k for k in rows if "from the real frame" in k]
    assert len(late) == Checkpoint(tiny_checkpoint).sampler_cfg.steps - 1
    assert rows[late[-1]]["latent_mse"] < rows["sample, temperature 1"]["latent_mse"]
    # the copy-last row is the previous real frame through the autoencoder, against the real frame
    ck = Checkpoint(tiny_checkpoint)
    recs = [r for r in (Recording(p) for p in find_recordings(tiny_dataset / "heldout")) if len(r)]
    targets = [(r, i) for r in recs for s, e in r.episodes() for i in range(s + 1, e)]
    picks = [targets[k] for k in np.random.default_rng(0).choice(len(targets), 5, replace=False)]
    prev = np.stack([np.asarray(r.frames[i - 1]) for r, i in picks])
    real = np.stack([np.asarray(r.frames[i]) for r, i in picks])
    shown = AE.decode(ck.ae, AE.encode(ck.ae, prev), *real.shape[1:3])
    assert rows["copy-last"]["psnr"] == pytest.approx(M.psnr(shown, real), abs=1e-3)
    assert probe.main(argv) == 0 and json.loads((out / "probe.json").read_text()) == rep  # deterministic
    assert probe.main(["--checkpoint", str(tmp_path / "none"), "--data", str(tiny_dataset), "--out", str(out)]) == 2


def test_continued_training_can_widen_the_denoiser(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    from dataclasses import replace

    from neuraldoom.checkpoint import save_checkpoint
    from neuraldoom.denoiser import build_denoiser

    ck = Checkpoint(tiny_checkpoint)
    dcfg = replace(ck.denoiser_cfg, block_out_channels=(32, 64))
    narrow = tmp_path / "narrow"
    save_checkpoint(narrow, ck.ae, build_denoiser(dcfg, 4, tuple(ck.denoiser.unet.config.sample_size)),
                    ck.game, dcfg, ck.sampler_cfg, ck.context_frames, ck.context_actions, {})
    out = tmp_path / "wide"
    argv = continued(tiny_dataset, narrow, out, "--widen", "2")
    assert train_diffusion.main(argv) == 0
    wide = Checkpoint(out / "checkpoint")
    assert wide.denoiser_cfg.block_out_channels == (64, 128)
    assert wide.denoiser.unet.conv_in.weight.shape[0] == 64
    argv[argv.index("--steps") + 1] = "3"
    assert train_diffusion.main(argv) == 0  # resumes the wide run
    assert json.loads((out / "checkpoint" / "config.json").read_text())["notes"]["steps"] == 3
    capsys.readouterr()
    bad = ["--data", str(tiny_dataset), "--init-from", str(tiny_checkpoint), "--out", str(tmp_path / "bad"),
           "--steps", "2", "--widen", "2"]
    assert train_diffusion.main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "groups" in err[0]


def test_continued_training_can_deepen_the_denoiser(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    out = tmp_path / "deep"
    argv = continued(tiny_dataset, tiny_checkpoint, out, "--deepen")
    assert train_diffusion.main(argv) == 0
    layers = Checkpoint(tiny_checkpoint).denoiser_cfg.layers_per_block
    deep = Checkpoint(out / "checkpoint")
    assert deep.denoiser_cfg.layers_per_block == layers + 1
    assert len(deep.denoiser.unet.down_blocks[0].resnets) == layers + 1
    argv[argv.index("--steps") + 1] = "3"
    assert train_diffusion.main(argv) == 0  # resumes the deep run
    assert json.loads((out / "checkpoint" / "config.json").read_text())["notes"]["steps"] == 3
    capsys.readouterr()
    bad = ["--data", str(tiny_dataset), "--autoencoder", str(tiny_checkpoint / "autoencoder"), "--out",
           str(tmp_path / "bad"), "--steps", "2", "--deepen"]
    assert train_diffusion.main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--init-from" in err[0]


def test_export_bounds_play_inside_the_training_frames_statistics(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    """--bounds-from: the quantiles of the cached training frames' channel means and spreads go into the
    sampler config, and the engine's frames stay inside them; a cache of another encoder, an empty folder
    or a bad quantile is one line and exit 2, with nothing written."""
    from neuraldoom import actions as A
    from neuraldoom import autoencoder as AE
    from neuraldoom.config import AutoencoderConfig
    from training import latents as L

    ck = Checkpoint(tiny_checkpoint)
    cache = tmp_path / "cache"
    data = L.build(ck.ae, tiny_dataset / "train", cache, 200)
    out = tmp_path / "bounded"
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--bounds-from", str(cache), "--out", str(out),
                        "--bounds-quantile", "0"]) == 0
    cfg = Checkpoint(out).sampler_cfg
    means, stds = data.z.float().mean((2, 3)), data.z.float().std((2, 3))
    np.testing.assert_allclose(cfg.mean_lo, means.min(0).values, atol=1e-3)  # quantile 0: the extremes
    np.testing.assert_allclose(cfg.mean_hi, means.max(0).values, atol=1e-3)
    np.testing.assert_allclose(cfg.std_hi, stds.max(0).values, atol=1e-3)
    eng = NeuralEngine(Checkpoint(out), compile=False, seed=0)
    eng.reset(0)
    for _ in range(3):
        z = eng.next_latent(A.NOOP)
        assert torch.all(z.mean((2, 3))[0] >= torch.tensor(cfg.mean_lo) - 1e-4)
        assert torch.all(z.mean((2, 3))[0] <= torch.tensor(cfg.mean_hi) + 1e-4)
        assert torch.all(z.std((2, 3))[0] <= torch.tensor(cfg.std_hi) + 1e-4)

    torch.manual_seed(1)
    other = tmp_path / "other"
    L.build(AE.build_autoencoder(AutoencoderConfig(latent_channels=4, encoder_channels=8, decoder_channels=8)),
            tiny_dataset / "train", other, 50)
    (tmp_path / "empty").mkdir()
    for flags, says in [(["--bounds-from", str(other)], "another encoder"),
                        (["--bounds-from", str(tmp_path / "empty")], "no cached latents"),
                        (["--bounds-from", str(cache), "--bounds-quantile", "0.5"], "--bounds-quantile")]:
        capsys.readouterr()
        assert export.main(["--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path / "no"), *flags]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "no").exists()


def test_noise_scale_reads_a_real_gradient_in_bands(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    from training import latents as L
    from training import noise_scale

    ck = Checkpoint(tiny_checkpoint)
    data = L.build(ck.ae, tiny_dataset / "train", tmp_path / "cache", 200)
    rows = noise_scale.noise_scale(ck, data, 24, 2, 0)
    assert [(r["lo"], r["hi"]) for r in rows] == [(0, 500), (500, 1000), (0, 1000)]
    assert rows[-1]["n"] == 24 == rows[0]["n"] + rows[1]["n"]
    for r in rows:  # E|g|^2 = tr(Sigma) (n-1)/n + |mean|^2: a noise under the energy, both positive
        assert 0 < r["noise"] and r["energy"] > 0 and r["signal"] < r["energy"]
    assert rows[0]["energy"] != rows[1]["energy"]
    assert noise_scale.main(["--checkpoint", str(tiny_checkpoint), "--data", str(tiny_dataset), "--samples", "1",
                             "--max-frames", "200", "--cache", str(tmp_path / "cache")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("noise_scale: t in [0, 250) drew 1 samples")
