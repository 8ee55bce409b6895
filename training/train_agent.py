"""Train the PPO agent whose every game step becomes training data (GameNGen §4; docs/DESIGN.md §3).

    python -m training.train_agent --steps 200000 --envs 4 --out data/agent

Several headless games run in `SubprocVecEnv` processes; each env records every model step it plays
into OUT/recordings/{train,heldout}/run-RRR-envEE (split by episode, like training.collect). The agent is
stable-baselines3 PPO: one small Nature-CNN (512-d) on the frame, another on the automap, concatenated
with the last 32 executed actions, into 2-layer MLP actor and critic heads.

Resumable: rerunning with the same OUT loads OUT/agent.safetensors (weights, optimizer, step count: no
pickle, the model is rebuilt from its flags) and appends
new recording shards (run index + 1); --steps is the total wanted. Every --eval-every agent steps the
episodes finished since the last report are summarised (mean reward, kills, map coverage in grid cells)
into OUT/eval.json and OUT/eval.png. Those are the training episodes themselves (the recorded ones):
separate evaluation games would cost CPU the data does not get.

Steps: --steps counts agent decisions over all envs (SB3 timesteps); each is held for --hold model
steps, so the recordings hold about hold x steps frames.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 2 threads on busy cores collapse SB3 ~10x

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv  # noqa: E402
from torch import nn  # noqa: E402
from tqdm import tqdm  # noqa: E402

from neuraldoom.agent_env import AgentEnv, AgentEnvConfig  # noqa: E402
from neuraldoom.checkpoint import (  # noqa: E402
    CheckpointError,
    load_optimizer,
    load_state,
    optimizer_tensors,
    save_state,
)
from neuraldoom.config import EPISODE_TICS, GameConfig, parse_args  # noqa: E402
from neuraldoom.game import GameError, RealGame  # noqa: E402
from neuraldoom.recording import RecordingError, open_dataset  # noqa: E402
from training.trainer import check_same_architecture  # noqa: E402


@dataclass(frozen=True)
class TrainAgentConfig:
    out: str = "data/agent"
    steps: int = 100_000  # total agent decisions over all envs (SB3 timesteps)
    envs: int = 8  # parallel games (paper: 8; 2-4 on a 2-core machine)
    wad: str = "freedoom1.wad"
    scenario: str = ""
    map: str = "E1M1"
    frame_skip: int = 2  # tics per model step (= per recorded frame)
    episode_tics: int = EPISODE_TICS  # episode timeout (1 minute), as in training.collect
    hold: int = 4  # model steps per agent decision
    repeat_prob: float = 0.5  # env repeats the previous action instead of the chosen one
    obs_scale: int = 2  # observation = 160x120 frame / obs_scale (2: 80x60, ~3x faster than 160x120)
    history: int = 32  # past actions in the observation
    heldout: float = 0.1  # fraction of episodes recorded as heldout
    # PPO, the paper's values (docs/DESIGN.md §3)
    lr: float = 1e-4
    gamma: float = 0.99
    ent_coef: float = 0.1
    epochs: int = 10
    batch_size: int = 64
    n_steps: int = 128  # rollout length per env
    gae_lambda: float = 0.95
    features: int = 512  # per-image CNN output (Mnih et al. 2015)
    hidden: int = 256  # width of the 2-layer actor and critic MLPs
    save_every: int = 4096  # agent steps between atomic saves of OUT/agent.safetensors
    eval_every: int = 4096  # agent steps between eval.json/eval.png reports
    seed: int = 0
    vec: str = "subproc"  # "subproc" (one process per game) or "dummy" (all in this process)


class AgentFeatures(BaseFeaturesExtractor):
    """Nature-CNN per image (screen, automap) -> 512 each, concatenated with the flat action history."""

    def __init__(self, space: gym.spaces.Dict, features: int = 512) -> None:
        hist = int(np.prod(space["actions"].shape))
        super().__init__(space, 2 * features + hist)
        self.cnns = nn.ModuleDict()
        for key in ("screen", "automap"):
            c, h, w = space[key].shape
            cnn = nn.Sequential(nn.Conv2d(c, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                                nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
            with torch.no_grad():
                n = cnn(torch.zeros(1, c, h, w)).shape[1]
            self.cnns[key] = nn.Sequential(cnn, nn.Linear(n, features), nn.ReLU())

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        # images arrive as float in [0, 1] (SB3 divides uint8 image spaces by 255)
        parts = [self.cnns[k](obs[k]) for k in ("screen", "automap")]  # (B, 512) each
        return torch.cat([*parts, obs["actions"].flatten(1)], 1)  # (B, 1024 + 32*13)


def env_config(c: TrainAgentConfig) -> AgentEnvConfig:
    game = replace(GameConfig(), wad=c.wad, scenario=c.scenario, map=c.map, frame_skip=c.frame_skip,
                   episode_timeout=c.episode_tics, automap=True)
    return AgentEnvConfig(game=game, hold=c.hold, repeat_prob=c.repeat_prob, history=c.history,
                          obs_scale=c.obs_scale, heldout=c.heldout)


def make_env(cfg: AgentEnvConfig, record_dir: str, shard: str, seed: int) -> AgentEnv:
    torch.set_num_threads(1)
    return AgentEnv(cfg, record_dir, shard=shard, seed=seed)


def next_run(out: Path) -> int:
    """Run index for new recording shards: one past the highest already under OUT/recordings."""
    runs = [int(m.group(1)) for p in (out / "recordings").glob("*/run-*") if (m := re.match(r"run-(\d+)", p.name))]
    return max(runs, default=-1) + 1


AGENT_FILE = "agent.safetensors"
ARCHITECTURE = ("features", "hidden", "history", "obs_scale")  # what the policy's shapes depend on


def saved_steps(path: Path) -> int:
    """num_timesteps of a saved agent, read from the state file's metadata."""
    return int(load_state(path)[1]["num_timesteps"])


def save_model(model: PPO, out: Path, cfg: TrainAgentConfig) -> None:
    """The policy's weights, its optimizer and the step count as safetensors + JSON (no pickle), atomically."""
    tensors, meta = optimizer_tensors(model.policy.optimizer)
    first: dict[int, str] = {}  # SB3 shares one features extractor between actor and critic: save it once
    for k, v in model.policy.state_dict().items():
        if first.setdefault(v.data_ptr(), k) == k:
            tensors[f"policy.{k}"] = v
    save_state(out / AGENT_FILE, tensors, {**meta, "num_timesteps": model.num_timesteps, "args": asdict(cfg)})


def load_model(model: PPO, path: Path, cfg: TrainAgentConfig) -> None:
    """Into a PPO built from the config: the saved weights, optimizer and step count; a saved agent of
    another architecture is one line (CheckpointError)."""
    tensors, meta = load_state(path)
    check_same_architecture(meta.get("args", {}), cfg, ARCHITECTURE, path)
    saved = {k[7:]: v for k, v in tensors.items() if k.startswith("policy.")}
    sd = model.policy.state_dict()
    aliases: dict[int, list[str]] = {}
    for k, v in sd.items():
        aliases.setdefault(v.data_ptr(), []).append(k)
    full = {k: next((saved[a] for a in aliases[v.data_ptr()] if a in saved), None) for k, v in sd.items()}
    missing = [k for k, v in full.items() if v is None]
    if missing:
        raise CheckpointError(f"{path} lacks the policy's {missing[0]}")
    model.policy.load_state_dict(full)
    load_optimizer(model.policy.optimizer, tensors, meta)
    model.num_timesteps = int(meta["num_timesteps"])


def plot_eval(log: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [e["steps"] for e in log]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3), dpi=80)
    for ax, key, title in zip(axes, ("reward", "kills", "cells"), ("mean episode reward", "kills / episode",
                                                                      "map cells visited / episode"), strict=True):
        ax.plot(x, [e[key] for e in log], marker=".")
        ax.set_title(title)
        ax.set_xlabel("agent steps (x hold = recorded frames)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


class Progress(BaseCallback):
    """Progress bar, periodic atomic saves and episode-statistics reports."""

    def __init__(self, c: TrainAgentConfig, out: Path, total: int) -> None:
        super().__init__()
        self.c, self.out, self.total = c, out, total
        self.eval_path = out / "eval.json"
        self.log: list[dict[str, Any]] = json.loads(self.eval_path.read_text()) if self.eval_path.exists() else []
        try:  # recorded frames over all runs so far
            self.frames = sum(len(r) for r in open_dataset(out / "recordings"))
        except RecordingError:
            self.frames = 0
        self.episodes: list[dict[str, float]] = []

    def _on_training_start(self) -> None:
        self.bar = tqdm(total=self.total, initial=self.num_timesteps, unit="step", desc=f"agent x{self.c.envs}",
                        dynamic_ncols=True)
        self.next_save = self.num_timesteps + self.c.save_every
        self.next_eval = self.num_timesteps + self.c.eval_every
        self.t0, self.s0 = time.time(), self.num_timesteps

    def _on_step(self) -> bool:
        for info in self.locals["infos"]:
            self.frames += int(info.get("frames", 0))
            if "episode_stats" in info:
                self.episodes.append(info["episode_stats"])
        self.bar.update(self.training_env.num_envs)
        if self.num_timesteps >= self.next_save:
            self.next_save += self.c.save_every
            save_model(self.model, self.out, self.c)
        if self.num_timesteps >= self.next_eval:
            self.next_eval += self.c.eval_every
            self.report()
        return True

    def report(self) -> None:
        if not self.episodes:
            return
        eps, self.episodes = self.episodes, []
        mean = {k: float(np.mean([e[k] for e in eps])) for k in eps[0]}
        sps = (self.num_timesteps - self.s0) / max(time.time() - self.t0, 1e-9)
        mean["episode_frames"] = mean.pop("frames")
        self.log.append({**mean, "steps": self.num_timesteps, "recorded_frames": self.frames, "episodes": len(eps),
                         "agent_steps_per_s": sps})
        tmp = self.eval_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.log, indent=1))
        os.replace(tmp, self.eval_path)
        plot_eval(self.log, self.out / "eval.png")
        self.bar.set_postfix(reward=f"{mean['reward']:.0f}", kills=f"{mean['kills']:.1f}",
                             cells=f"{mean['cells']:.0f}")

    def _on_training_end(self) -> None:
        self.bar.close()
        save_model(self.model, self.out, self.c)
        self.report()


def main(argv: list[str] | None = None) -> int:
    c = parse_args(TrainAgentConfig, argv, __doc__)
    torch.set_num_threads(1)
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    ecfg = env_config(c)
    try:
        RealGame(ecfg.game).close()  # fail fast, in this process, on a bad WAD/map
    except GameError as e:
        print(f"train_agent: {e}", file=sys.stderr)
        return 2
    resume = (out / AGENT_FILE).exists()
    try:
        start = saved_steps(out / AGENT_FILE) if resume else 0
    except CheckpointError as e:
        print(f"train_agent: {e}", file=sys.stderr)
        return 2
    if resume and start >= c.steps:
        print(f"train_agent: {out} already holds an agent trained for {start} steps (>= {c.steps})")
        return 0
    run = next_run(out)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(c), indent=2))

    # --- the games: one process each, each recording its own shards ---
    fns = [lambda i=i: make_env(ecfg, str(out / "recordings"), f"run-{run:03d}-env{i:02d}",
                                seed=int(np.random.SeedSequence([c.seed, run, i]).generate_state(1)[0]))
           for i in range(c.envs)]
    venv = SubprocVecEnv(fns) if c.vec == "subproc" else DummyVecEnv(fns)
    venv.seed(c.seed + 1000 * run)

    # --- the agent: new, or resumed with its optimizer and step count ---
    policy_kwargs = {"features_extractor_class": AgentFeatures,
                     "features_extractor_kwargs": {"features": c.features},
                     "net_arch": {"pi": [c.hidden, c.hidden], "vf": [c.hidden, c.hidden]}}
    hyper = {"learning_rate": c.lr, "gamma": c.gamma, "ent_coef": c.ent_coef, "n_epochs": c.epochs,
             "batch_size": c.batch_size, "n_steps": c.n_steps, "gae_lambda": c.gae_lambda}
    model = PPO("MultiInputPolicy", venv, policy_kwargs=policy_kwargs, device="cpu", seed=c.seed + 1000 * run,
                verbose=0, **hyper)
    if resume:
        try:
            load_model(model, out / AGENT_FILE, c)
        except CheckpointError as e:
            venv.close()
            print(f"train_agent: {e}", file=sys.stderr)
            return 2
    start = model.num_timesteps
    todo = c.steps - start
    print(f"train_agent: {'resuming at' if resume else 'starting,'} {start} steps; run {run}, "
          f"{c.envs} games, recording into {out / 'recordings'}")

    # --- learn; every model step of every game is recorded by the envs ---
    cb = Progress(c, out, c.steps)
    t0 = time.time()
    try:
        model.learn(total_timesteps=todo, callback=cb, reset_num_timesteps=False)
    finally:
        venv.close()  # closes the recording shards
    dt = time.time() - t0
    n = model.num_timesteps - start
    print(f"train_agent: {n} agent steps in {dt:.0f}s = {n / dt:.1f} steps/s ({n * c.hold / dt:.0f} recorded "
          f"frames/s at most) with {c.envs} games; model at {out / AGENT_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
