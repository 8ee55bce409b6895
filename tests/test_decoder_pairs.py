"""The decoder's fine-tune on what play asks it to draw: the play sampler's latents beside the real frames."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderTiny

from neuraldoom import autoencoder as AE
from neuraldoom.checkpoint import Checkpoint, load_model_dir
from neuraldoom.recording import open_dataset
from neuraldoom.sampler import DDIMSampler, FrameBounds, denoiser_pass
from training import decoder_pairs, train_autoencoder
from training import latents as L


def make_pairs(ckpt, data, out, *extra: str) -> int:
    return decoder_pairs.main(["--checkpoint", str(ckpt), "--data", str(data), "--out", str(out), "--count", "8",
                               "--batch", "2", "--chunk", "4", "--latents", str(out.parent / "cache"),
                               "--precision", "fp32", *extra])


def test_pairs_are_the_play_samplers_latents_beside_their_real_training_frames(tiny_checkpoint, tiny_dataset,
                                                                               tmp_path):
    out = tmp_path / "pairs"
    assert make_pairs(tiny_checkpoint, tiny_dataset, out) == 0
    z, f = decoder_pairs.open_pairs(out)
    assert z.shape[0] == f.shape[0] == 8 and z.dtype == np.float16 and f.dtype == np.uint8
    ck = Checkpoint(tiny_checkpoint)
    lat = L.build(ck.ae, tiny_dataset / "train", tmp_path / "cache" / "train", 0)
    train_frames = np.concatenate([np.asarray(r.frames) for r in open_dataset(tiny_dataset / "train")])
    # each pair's frame is the training frame of its row, and its latent is the sampler's from that row's context
    rows = lat.targets[torch.from_numpy(np.random.default_rng(0).integers(0, len(lat), 8))]
    assert all(np.array_equal(f[i], train_frames[int(r)]) for i, r in enumerate(rows))
    cfg = ck.sampler_cfg
    sampler = DDIMSampler(ck.denoiser, cfg.steps, cfg.cfg, cfg.deadband, FrameBounds.from_config(cfg))
    noise = torch.randn((8, *lat.z.shape[1:]), generator=torch.Generator().manual_seed(0))[:2]
    _, ctx, codes = lat.window(rows[:2], ck.denoiser_cfg.context, ck.denoiser.reads)
    with torch.no_grad():
        want = sampler.sample(noise, ctx, codes, denoiser_pass(ck.denoiser))
    assert torch.allclose(torch.from_numpy(np.asarray(z[:2], np.float32)), want, atol=1e-3)
    assert not torch.allclose(want, lat.z[rows[:2]].float(), atol=2e-2)  # a sample, not the real latent


def test_a_killed_run_continues_to_the_same_pairs_and_another_command_starts_over(tiny_checkpoint, tiny_dataset,
                                                                                  tmp_path):
    out = tmp_path / "pairs"
    assert make_pairs(tiny_checkpoint, tiny_dataset, out) == 0
    whole = [np.array(x) for x in decoder_pairs.open_pairs(out)]
    meta = json.loads((out / "meta.json").read_text())
    zs = np.load(out / "latents.npy", mmap_mode="r+")
    zs[4:] = 0  # as if killed after the first chunk
    zs.flush()
    del zs
    (out / "meta.json").write_text(json.dumps({**meta, "done": 4}))
    assert [len(x) for x in decoder_pairs.open_pairs(out)] == [4, 4]
    assert make_pairs(tiny_checkpoint, tiny_dataset, out) == 0
    assert all(np.array_equal(a, b) for a, b in zip(whole, decoder_pairs.open_pairs(out), strict=True))
    assert make_pairs(tiny_checkpoint, tiny_dataset, out, "--seed", "1") == 0
    assert not np.array_equal(whole[1], decoder_pairs.open_pairs(out)[1])


@pytest.mark.parametrize("bad", [["--count", "0"], ["--batch", "8", "--chunk", "4"]])
def test_bad_pair_arguments_are_one_line(tiny_checkpoint, tiny_dataset, tmp_path, capsys, bad):
    assert make_pairs(tiny_checkpoint, tiny_dataset, tmp_path / "p", *bad) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("decoder_pairs:") and "\n" not in err


def fine_tune(ckpt, data, out, *extra: str) -> int:
    return train_autoencoder.main(["--data", str(data), "--out", str(out), "--init-from", str(ckpt / "autoencoder"),
                                   "--decoder-only", "--steps", "30", "--batch", "4", "--lr", "3e-2",
                                   "--eval-every", "30", "--eval-frames", "4", "--precision", "fp32", *extra])


def test_the_decoder_learns_to_draw_the_real_frames_from_the_pairs(tiny_checkpoint, tiny_dataset, tmp_path):
    pairs = tmp_path / "pairs"
    assert make_pairs(tiny_checkpoint, tiny_dataset, pairs) == 0
    z, f = (np.array(x) for x in decoder_pairs.open_pairs(pairs))

    def error(folder) -> float:
        ae = load_model_dir(AutoencoderTiny, folder)
        return float(((AE.decode(ae, torch.from_numpy(z.astype(np.float32)), 120, 160) / 255.0 - f / 255.0) ** 2)
                     .mean())

    assert fine_tune(tiny_checkpoint, tiny_dataset, tmp_path / "with", "--pairs", str(pairs), "--pair-share",
                     "1") == 0
    assert fine_tune(tiny_checkpoint, tiny_dataset, tmp_path / "without") == 0
    before = error(tiny_checkpoint / "autoencoder")
    assert error(tmp_path / "with" / "autoencoder") < 0.8 * min(before, error(tmp_path / "without" / "autoencoder"))
    a = load_model_dir(AutoencoderTiny, tiny_checkpoint / "autoencoder")
    b = load_model_dir(AutoencoderTiny, tmp_path / "with" / "autoencoder")
    assert all(torch.equal(x, y) for x, y in zip(a.encoder.parameters(), b.encoder.parameters(), strict=True))


@pytest.mark.parametrize("flags", [["--pair-share", "0.5"], ["--decoder-only", "--pair-share", "0"],
                                   ["--decoder-only", "--pair-share", "1.5"]])
def test_pairs_need_a_decoder_fine_tune_and_a_share(tiny_checkpoint, tiny_dataset, tmp_path, capsys, flags):
    assert train_autoencoder.main(["--data", str(tiny_dataset), "--out", str(tmp_path / "d"), "--init-from",
                                   str(tiny_checkpoint / "autoencoder"), "--pairs", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "--pairs" in err and "\n" not in err


def test_pairs_of_another_encoder_or_none_are_one_line(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    pairs = tmp_path / "pairs"
    assert make_pairs(tiny_checkpoint, tiny_dataset, pairs) == 0
    meta = json.loads((pairs / "meta.json").read_text())
    meta["made_by"]["encoder"] = "0" * 16
    (pairs / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    for folder in (pairs, tmp_path / "nothing"):
        assert fine_tune(tiny_checkpoint, tiny_dataset, tmp_path / "d", "--pairs", str(folder)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("train_autoencoder:") and "\n" not in err
