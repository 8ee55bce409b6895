"""The PPO agent's world: a gymnasium Env around `RealGame` with our reward, actions and recording.

One agent step = the chosen action held for `hold` model steps (each `frame_skip` tics), so play looks
human (GameNGen §4 / appendix: actions are held, repeats are likely). Human-like repeats: with
probability `repeat_prob` the env ignores the agent's choice and repeats the previous executed action.
This lives in the env's dynamics rather than as a logit bias, so PPO's stored log-probs stay exact
and the policy sees the executed history in its observation anyway.

**Every model step is recorded** through `RecordingWriter` at the game's resolution (160x120): row t =
frame t, the executed action, the game variables and that step's reward. That is the training corpus of
the autoencoder and denoiser (docs/DESIGN.md §3), covering the agent from clumsy to skilled.

Observation (channels first, uint8 images, smaller than the recorded frame if `obs_scale` > 1):
  screen  (3, H/s, W/s)   the frame
  automap (1, H/s, W/s)   the automap of what the player has seen (not rotated), grey
  actions (history, 13)   the last executed actions: 6 button bits + one-hot of 7 turn buckets
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import vizdoom as vzd

from . import actions as A
from .config import EPISODE_TICS, GameConfig
from .game import GAME_VARIABLES, RealGame
from .recording import RecordingWriter
from .reward import TERMS, RewardConfig, VisitedCells, reward

ACTION_FEATURES = A.NUM_BUTTONS + A.NUM_TURNS  # 13 per past action


@dataclass(frozen=True)
class AgentEnvConfig:
    game: GameConfig = GameConfig(automap=True, episode_timeout=EPISODE_TICS)
    reward: RewardConfig = RewardConfig()
    hold: int = 4  # model steps each agent action is held for (4 x frame_skip 2 = 8 tics)
    repeat_prob: float = 0.5  # chance the env repeats the previous action instead of the chosen one
    history: int = 32  # past actions in the observation (GameNGen: 32)
    obs_scale: int = 2  # observation = game frame downscaled by this factor (160x120 -> 80x60)
    reward_scale: float = 0.01  # what PPO sees; recordings keep the raw reward
    heldout: float = 0.1  # fraction of episodes recorded into heldout/ instead of train/


def action_features(action: A.Action) -> np.ndarray:
    """(13,) float32: button bits + turn one-hot, the shared action representation (docs/DESIGN.md §6)."""
    f = np.zeros(ACTION_FEATURES, np.float32)
    f[: A.NUM_BUTTONS] = [action.buttons >> i & 1 for i in range(A.NUM_BUTTONS)]
    f[A.NUM_BUTTONS + action.turn] = 1.0
    return f


def downscale(img: np.ndarray, s: int) -> np.ndarray:
    """(H, W, C) uint8 -> (C, H/s, W/s) uint8 by averaging s x s blocks."""
    H, W, C = img.shape
    if s > 1:
        img = img[: H - H % s, : W - W % s].reshape(H // s, s, W // s, s, C).mean((1, 3))
    return np.ascontiguousarray(np.asarray(img, np.float32).round().astype(np.uint8).transpose(2, 0, 1))


class AgentEnv(gym.Env):
    """Gymnasium env over the real game; records every model step into RECORD_DIR/{train,heldout}/SHARD."""

    metadata = {"render_modes": []}

    def __init__(self, cfg: AgentEnvConfig = AgentEnvConfig(), record_dir: str | Path | None = None,
                 shard: str = "shard", seed: int = 0, recording_extra: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.game_cfg = replace(cfg.game, automap=True)
        self.actions = A.all_actions()
        self.action_space = gym.spaces.Discrete(len(self.actions))
        h, w = self.game_cfg.height // cfg.obs_scale, self.game_cfg.width // cfg.obs_scale
        self.observation_space = gym.spaces.Dict({
            "screen": gym.spaces.Box(0, 255, (3, h, w), np.uint8),
            "automap": gym.spaces.Box(0, 255, (1, h, w), np.uint8),
            "actions": gym.spaces.Box(0.0, 1.0, (cfg.history, ACTION_FEATURES), np.float32),
        })
        self.game = RealGame(self.game_cfg)
        # RealGame's automap shows the whole map and every thing (OBJECTS): the agent gets only what it has
        # seen, untextured, so the map is a memory of where it has been. Settable after init.
        self.game.game.set_automap_mode(vzd.AutomapMode.NORMAL)
        self.game.game.set_automap_render_textures(False)
        self.rng = np.random.default_rng(seed)
        self.record_dir = Path(record_dir) if record_dir is not None else None
        self.shard = shard
        self.recording_extra = recording_extra or {}
        self.writers: dict[str, RecordingWriter] = {}
        self.writer: RecordingWriter | None = None
        self.history = np.zeros((cfg.history, ACTION_FEATURES), np.float32)
        self.prev_action: A.Action | None = None
        self.cells = VisitedCells(cfg.reward.cell_size)
        self.vars = np.zeros(len(GAME_VARIABLES), np.float32)
        self.stats: dict[str, float] = {}

    # -- recording -------------------------------------------------------------------------------
    def _writer_for_episode(self, ep_seed: int) -> RecordingWriter | None:
        if self.record_dir is None:
            return None
        split = "heldout" if self.rng.random() < self.cfg.heldout else "train"
        if split not in self.writers:  # created lazily: no empty shards
            self.writers[split] = RecordingWriter(
                self.record_dir / split / self.shard, self.game_cfg, engine="real",
                extra={"policy": "ppo_agent", "hold": self.cfg.hold, "repeat_prob": self.cfg.repeat_prob,
                       **self.recording_extra})
        w = self.writers[split]
        w.new_episode(ep_seed)
        return w

    # -- gymnasium -------------------------------------------------------------------------------
    def _obs(self) -> dict[str, np.ndarray]:
        s = self.cfg.obs_scale
        am = self.game.automap if self.game.automap is not None else np.zeros_like(self.game.frame)
        grey = am.astype(np.float32).mean(-1, keepdims=True)
        return {"screen": downscale(self.game.frame, s), "automap": downscale(grey, s),
                "actions": self.history.copy()}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        ep_seed = int(self.rng.integers(2**31 - 1))
        self.game.reset(ep_seed)
        self.writer = self._writer_for_episode(ep_seed)
        self.vars = self.game.variables.copy()
        self.cells = VisitedCells(self.cfg.reward.cell_size)
        self.cells.visit(self.vars[GAME_VARIABLES.index("POSITION_X")], self.vars[GAME_VARIABLES.index("POSITION_Y")])
        self.history[:] = 0.0
        self.prev_action = None
        self.stats = {"reward": 0.0, "frames": 0, **dict.fromkeys(TERMS, 0.0)}
        return self._obs(), {}

    def step(self, index: int):
        chosen = self.actions[int(index)]
        repeated = self.prev_action is not None and self.rng.random() < self.cfg.repeat_prob
        action = self.prev_action if repeated else chosen
        assert action is not None
        total, frames = 0.0, 0
        for _ in range(self.cfg.hold):
            frame, prev = self.game.frame, self.vars
            self.game.step(action)
            if self.game.done:  # the last state is gone, but the variables can still be read
                g = self.game.game
                cur = np.array([g.get_game_variable(getattr(vzd.GameVariable, v)) for v in GAME_VARIABLES],
                               np.float32)
            else:
                cur = self.game.variables.copy()
            r, terms = reward(prev, cur, self.cells, self.cfg.reward)
            if self.writer is not None:
                self.writer.add(frame, action, prev, r)
            self.vars = cur
            total += r
            frames += 1
            self.stats["frames"] += 1
            for k, v in terms.items():
                self.stats[k] += v
            if self.game.done:
                break
        self.stats["reward"] += total
        self.prev_action = action
        self.history = np.roll(self.history, -1, 0)
        self.history[-1] = action_features(action)
        info: dict[str, Any] = {"repeated": repeated, "frames": frames}
        terminated = truncated = False
        if self.game.done:
            g = self.game.game
            truncated = bool(g.is_episode_timeout_reached()) and not g.is_player_dead()
            terminated = not truncated
            if self.writer is not None:
                self.writer.flush()
            info["episode_stats"] = {**self.stats, "kills": float(self.vars[GAME_VARIABLES.index("KILLCOUNT")]),
                                     "cells": len(self.cells)}
        return self._obs(), total * self.cfg.reward_scale, terminated, truncated, info

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.writers = {}
        if getattr(self, "game", None) is not None:
            self.game.close()


__all__ = ["AgentEnv", "AgentEnvConfig", "ACTION_FEATURES", "action_features", "downscale"]
