"""The PPO agent: its env on the real engine (reward terms, action holding, recording) and the training
script end to end on tiny settings, including resume."""

from __future__ import annotations

import json

import numpy as np

from neuraldoom import actions as A
from neuraldoom.agent_env import ACTION_FEATURES, AgentEnv, AgentEnvConfig
from neuraldoom.config import GameConfig
from neuraldoom.game import RealGame
from neuraldoom.recording import open_dataset
from neuraldoom.reward import VisitedCells, reward

# ViZDoom's `basic` scenario: one monster in front of the player, the episode ends when it dies.
BASIC = GameConfig(scenario="basic", wad="freedoom2.wad", map="map01", episode_timeout=300)


def strafe_and_fire(t: int) -> A.Action:
    """Fire while sweeping left then right, so the shot crosses the monster wherever it spawned."""
    return A.Action.of("ATTACK", "MOVE_LEFT" if (t // 15) % 2 == 0 else "MOVE_RIGHT")


def test_firing_at_a_monster_yields_hit_and_kill_rewards():
    got = {"enemy_hit": 0.0, "enemy_kill": 0.0, "ammo": 0.0}
    with RealGame(BASIC) as g:
        g.reset(0)  # seed 0: measured to kill within ~16 steps; deterministic per seed
        cells = VisitedCells()
        prev = g.variables.copy()
        for t in range(60):
            g.step(strafe_and_fire(t))
            cur = g.variables.copy()
            _, terms = reward(prev, cur, cells)
            for k in got:
                got[k] += terms[k]
            prev = cur
            if g.done:
                break
    assert got["enemy_hit"] >= 300, got
    assert got["enemy_kill"] >= 1000, got
    assert got["ammo"] < 0, got  # shots cost ammo


def test_env_holds_actions_records_every_step_and_sees_the_kill(tmp_path):
    cfg = AgentEnvConfig(game=BASIC, hold=3, repeat_prob=0.0, heldout=0.0)
    index = {a: i for i, a in enumerate(A.all_actions())}
    env = AgentEnv(cfg, tmp_path / "rec", shard="s0", seed=0)
    obs, _ = env.reset(seed=0)
    assert obs["screen"].shape == (3, 60, 80) and obs["screen"].dtype == np.uint8
    assert obs["automap"].shape == (1, 60, 80)
    assert obs["actions"].shape == (32, ACTION_FEATURES) and not obs["actions"].any()
    stats, steps, frames = [], 0, 0
    for _ in range(4):  # the monster spawns at random; a few sweeps always got it in measurements
        for t in range(100):
            obs, r, term, trunc, info = env.step(index[strafe_and_fire(t // 2)])
            steps += 1
            frames += info["frames"]
            if term or trunc:
                stats.append(info["episode_stats"])
                env.reset()
                break
        if any(s["enemy_kill"] > 0 for s in stats):
            break
    env.close()
    assert any(s["enemy_kill"] >= 1000 and s["enemy_hit"] >= 300 for s in stats), stats
    assert obs["actions"][-1, A.BUTTONS.index("ATTACK")] == 1  # history holds the executed action
    (rec,) = open_dataset(tmp_path / "rec")
    assert rec.path.parent.name == "train" and len(rec) == frames
    assert frames <= 3 * steps and frames > 3 * (steps - len(stats) - 1)  # each choice held for 3 steps
    acts = rec.actions[:3]
    assert (acts == acts[0]).all()
    # the recorded reward of the last transition of the killing episode includes the kill
    assert rec.steps["reward"].sum() >= 1000


def test_train_agent_end_to_end_and_resume(tmp_path):
    from training.train_agent import main, saved_steps

    out = tmp_path / "agent"
    common = ["--envs", "2", "--out", str(out), "--n-steps", "32", "--epochs", "2", "--episode-tics", "120",
              "--save-every", "64", "--eval-every", "64"]
    assert main(["--steps", "128", *common]) == 0
    recs = open_dataset(out / "recordings")
    n1 = sum(len(r) for r in recs)
    assert n1 >= 128, n1  # every model step recorded: hold x agent steps, less episode ends
    assert {r.path.name for r in recs} <= {"run-000-env00", "run-000-env01"}
    assert recs[0].meta["policy"] == "ppo_agent" and recs[0].game.height == 120
    assert (out / "agent.safetensors").exists() and not list(out.glob("*.tmp"))
    log = json.loads((out / "eval.json").read_text())
    assert log and {"reward", "kills", "cells", "steps", "recorded_frames"} <= set(log[-1])
    assert log[-1]["recorded_frames"] == n1
    assert (out / "eval.png").exists()

    # rerun: continues from the saved agent and appends new shards
    assert main(["--steps", "192", "--vec", "dummy", *common]) == 0  # in-process games: same env, faster
    recs = open_dataset(out / "recordings")
    assert any(r.path.name.startswith("run-001-") for r in recs)
    assert sum(len(r) for r in recs) >= n1 + 64
    assert saved_steps(out / "agent.safetensors") >= 192
    # done already: a third run does nothing
    assert main(["--steps", "192", *common]) == 0


def test_agent_resumes_after_sigkill_with_the_saved_weights(tmp_path, capsys):
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch

    from neuraldoom.checkpoint import load_state
    from training.train_agent import main

    out = tmp_path / "agent"
    common = ["--envs", "1", "--vec", "dummy", "--out", str(out), "--n-steps", "32", "--epochs", "1",
              "--episode-tics", "120", "--save-every", "32", "--eval-every", "100000", "--features", "32",
              "--batch-size", "32", "--hidden", "16"]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    p = subprocess.Popen([sys.executable, "-m", "training.train_agent", "--steps", "1000000", *common], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / "agent.safetensors"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not state.exists():
            time.sleep(0.2)
        time.sleep(2.0)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    saved, meta = load_state(state)  # whole, whenever the kill came
    steps = meta["num_timesteps"]
    assert steps >= 32
    # resume with a zero learning rate: more steps are taken, the weights stay the saved ones exactly
    assert main(["--steps", str(steps + 32), "--lr", "0", *common]) == 0
    assert f"resuming at {steps} steps" in capsys.readouterr().out
    after, meta2 = load_state(state)
    assert meta2["num_timesteps"] >= steps + 32
    policy = [k for k in saved if k.startswith("policy.")]
    assert policy and all(torch.equal(saved[k], after[k]) for k in policy)
    # another architecture on the same folder: one line, exit 2
    assert main(["--steps", str(steps + 64), *common[:-1], "24"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_agent: ") and "--hidden 16" in err and err.count("\n") == 1
