"""Shared test setup: pygame without a display, the repository importable from subprocesses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ["SDL_VIDEODRIVER"] = "dummy"  # before anything imports pygame
os.environ["PYGAME_HIDE_SUPPORT_PROMPT"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# the package's OpenMP setting (passive waiting: the workers share the cores) before a test module loads torch
import neuraldoom  # noqa: E402, F401


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state, fixed by the first Accelerator built (its precision): a
    trainer that asks for bf16 after another test built an fp32 one would fail, in this order only."""
    yield
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for `python -m neuraldoom.cli …` in a subprocess: the repo on the path, headless."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture
def small_game_cfg():
    """The default game (freedoom1 E1M1, 160x120, frame_skip 2) with a short episode timeout."""
    from neuraldoom.config import GameConfig

    return GameConfig(episode_timeout=200)


@pytest.fixture
def recorded(tmp_path, small_game_cfg):
    """A real recording of 2 episodes (seeds 11 and 12), 40 + 30 steps, written by RecordingWriter."""
    import numpy as np

    from neuraldoom.actions import StickyRandomPolicy
    from neuraldoom.game import RealGame
    from neuraldoom.recording import RecordingWriter

    path = tmp_path / "rec"
    policy = StickyRandomPolicy(np.random.default_rng(0))
    frames, acts = [], []
    with RealGame(small_game_cfg) as game, RecordingWriter(path, small_game_cfg, flush_every=8) as w:
        for seed, n in ((11, 40), (12, 30)):
            frame = game.reset(seed)
            w.new_episode(seed)
            for _ in range(n):
                a = policy()
                w.add(frame, a, game.variables)
                frames.append(frame.copy())
                acts.append(a)
                frame = game.step(a)
    return path, frames, acts


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """A real collected dataset: 1 game, 400 steps of sticky-random play, train and heldout splits."""
    from training import collect

    out = tmp_path_factory.mktemp("data") / "e1m1"
    assert collect.main(["--steps", "400", "--out", str(out), "--workers", "1", "--episode-tics", "160",
                         "--heldout", "0.3", "--seed", "3"]) == 0
    return out


TINY_DENOISER = dict(context=4, block_out_channels=(8, 16), attention_heads=2, cross_attention_dim=16, target="frame")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_dataset, tmp_path_factory):
    """A complete, tiny checkpoint built from scratch (untrained weights) on the tiny dataset."""
    import numpy as np
    import torch

    from neuraldoom import autoencoder as AE
    from neuraldoom.checkpoint import save_checkpoint
    from neuraldoom.config import AutoencoderConfig, DenoiserConfig, SamplerConfig
    from neuraldoom.denoiser import build_denoiser
    from neuraldoom.recording import open_dataset

    torch.manual_seed(0)
    rec = open_dataset(tiny_dataset / "train")[0]
    ae = AE.build_autoencoder(AutoencoderConfig(latent_channels=4, encoder_channels=8, decoder_channels=8))
    dcfg = DenoiserConfig(**TINY_DENOISER)
    den = build_denoiser(dcfg, 4, AE.latent_hw(ae, 120, 160))
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    frames = np.asarray(rec.frames[:4])
    actions = np.concatenate([[[0, 3]], rec.actions[:3]])
    save_checkpoint(path, ae, den, rec.game, dcfg, SamplerConfig(), frames, actions, {"test": True})
    return path
