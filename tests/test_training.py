"""Each training stage end to end on tiny settings, on real collected data, in tmp_path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from neuraldoom.checkpoint import Checkpoint
from training import evaluate, export, train_autoencoder, train_diffusion

TINY_AE = ["--latent-channels", "4", "--encoder-channels", "8", "--decoder-channels", "8"]
TINY_DM = ["--context", "4", "--block-out-channels", "8", "16", "--attention-heads", "2",
           "--cross-attention-dim", "16", "--batch", "4", "--max-frames", "300"]


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


def test_decoder_only_keeps_the_encoder(tiny_ae, tiny_dataset, tmp_path):
    import torch
    from diffusers import AutoencoderTiny

    from neuraldoom.checkpoint import load_model_dir

    out = tmp_path / "dec"
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(out), "--init-from",
                                   str(tiny_ae / "autoencoder"), "--decoder-only", "--steps", "3", "--batch", "2",
                                   "--eval-every", "3", "--eval-frames", "4"]) == 0
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
    assert [json.loads(x)["step"] for x in (tiny_run / "log.jsonl").read_text().splitlines()] == [2, 4]


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

    _, meta = load_state(state)  # the state on disk is whole, never half-written
    saved = meta["step"]
    assert saved >= 1
    r = subprocess.run(cmd[:-len(TINY_DM) - 4] + ["--steps", str(saved + 2), "--save-every", "0", *TINY_DM],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming at step {saved}" in r.stdout
    assert load_state(state)[1]["step"] == saved + 2


def test_evaluate_reports_model_and_baselines(tiny_run, tiny_dataset, tmp_path, capsys):
    out = tmp_path / "eval"
    assert evaluate.main(["--checkpoint", str(tiny_run / "checkpoint"), "--data", str(tiny_dataset),
                          "--out", str(out), "--samples", "4", "--rollouts", "2", "--rollout-steps", "5"]) == 0
    rep = json.loads((out / "report.json").read_text())
    for k in ("tf_psnr", "tf_psnr_nocfg", "tf_ssim", "copy_last_psnr", "mean_frame_psnr", "ae_psnr", "hud_psnr",
              "ae_hud_psnr", "n_samples"):
        assert isinstance(rep[k], (int, float)), k
    for k in ("ar_psnr", "ar_copy_last_psnr", "ar_sharpness"):
        assert len(rep[k]) == 5
    assert rep["n_samples"] == 4
    assert (out / "ar_psnr.png").stat().st_size > 0 and (out / "grid.png").stat().st_size > 0
    assert "copy-last-frame PSNR" in capsys.readouterr().out


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


def test_bench_prints_the_table_and_the_summary_line(tiny_checkpoint, capsys):
    from neuraldoom import bench

    assert bench.main(["--checkpoint", str(tiny_checkpoint), "--frames", "2", "--no-compile"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("fps=") and " eager_fps=" in last and " real_fps=" in last
    assert all(float(kv.split("=")[1]) > 0 for kv in last.split())
