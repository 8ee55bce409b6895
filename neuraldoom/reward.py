"""The agent's reward (GameNGen appendix A.5), computed from two consecutive game-variable vectors.

Pure: no ViZDoom here. `prev` and `cur` are vectors indexed by `config.GAME_VARIABLES`; exploration is
scored by a `VisitedCells` tracker over a grid of the map, kept per episode.

| term          | value                                  | from                              |
|---------------|----------------------------------------|-----------------------------------|
| player_hit    | -100 per hit taken                     | ΔHITS_TAKEN                       |
| death         | -5000                                  | DEAD 0 -> 1                       |
| enemy_hit     | +300 per hit                           | ΔHITCOUNT                         |
| enemy_kill    | +1000 per kill                         | ΔKILLCOUNT                        |
| pickup        | +100 per item                          | ΔITEMCOUNT                        |
| secret        | +500 per secret                        | ΔSECRETCOUNT                      |
| new_area      | +20·(1 + 0.5·L1) per newly visited cell | POSITION_X/Y on a grid            |
| health        | 10·Δ                                   | ΔHEALTH                           |
| armor         | 10·Δ                                   | ΔARMOR                            |
| ammo          | 10·max(0, Δ) + min(0, Δ)               | Δ(AMMO2 + AMMO3): bullets, shells |

Choices the paper leaves open, made here:
- "L1 distance" is the L1 distance, in cells, from the new cell to the episode's starting cell: going
  *far* pays more than filling in cells next to the start.
- Ammo is the sum of the bullet and shell pools, not SELECTED_WEAPON_AMMO, which jumps on every weapon
  switch. Weapon pickups show up through the ammo they carry (weapons do not count in ITEMCOUNT).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import GAME_VARIABLES

_I = {name: i for i, name in enumerate(GAME_VARIABLES)}
TERMS: tuple[str, ...] = ("player_hit", "death", "enemy_hit", "enemy_kill", "pickup", "secret", "new_area",
                          "health", "armor", "ammo")


@dataclass(frozen=True)
class RewardConfig:
    player_hit: float = -100.0
    death: float = -5000.0
    enemy_hit: float = 300.0
    enemy_kill: float = 1000.0
    pickup: float = 100.0
    secret: float = 500.0
    new_area: float = 20.0
    new_area_distance: float = 0.5  # bonus per cell of L1 distance from the start cell
    health: float = 10.0
    armor: float = 10.0
    ammo_gain: float = 10.0
    ammo_loss: float = 1.0
    cell_size: float = 64.0  # map units per grid cell (the player is 32 wide; a corridor ~64-128)


class VisitedCells:
    """Grid cells visited in one episode; `visit` returns the L1 distance (in cells) of a new cell or None."""

    def __init__(self, cell_size: float = 64.0) -> None:
        self.cell_size = cell_size
        self.cells: set[tuple[int, int]] = set()
        self.start: tuple[int, int] | None = None

    def cell(self, x: float, y: float) -> tuple[int, int]:
        return int(np.floor(x / self.cell_size)), int(np.floor(y / self.cell_size))

    def visit(self, x: float, y: float) -> int | None:
        c = self.cell(x, y)
        if self.start is None:
            self.start = c  # the starting cell is visited but not rewarded
            self.cells.add(c)
            return None
        if c in self.cells:
            return None
        self.cells.add(c)
        return abs(c[0] - self.start[0]) + abs(c[1] - self.start[1])

    def __len__(self) -> int:
        return len(self.cells)


def _d(prev: np.ndarray, cur: np.ndarray, name: str) -> float:
    return float(cur[_I[name]] - prev[_I[name]])


def reward(prev: np.ndarray, cur: np.ndarray, cells: VisitedCells,
           cfg: RewardConfig = RewardConfig()) -> tuple[float, dict[str, float]]:
    """(total, per-term) reward of one transition prev -> cur; `cells` is updated with cur's position.

    Counters (hits, kills, items…) only ever rise within an episode; a fall (new episode) scores nothing.
    """
    prev = np.asarray(prev, np.float64)
    cur = np.asarray(cur, np.float64)
    up = lambda name: max(0.0, _d(prev, cur, name))  # noqa: E731
    terms = dict.fromkeys(TERMS, 0.0)
    terms["player_hit"] = cfg.player_hit * up("HITS_TAKEN")
    terms["death"] = cfg.death * float(prev[_I["DEAD"]] == 0 and cur[_I["DEAD"]] != 0)
    terms["enemy_hit"] = cfg.enemy_hit * up("HITCOUNT")
    terms["enemy_kill"] = cfg.enemy_kill * up("KILLCOUNT")
    terms["pickup"] = cfg.pickup * up("ITEMCOUNT")
    terms["secret"] = cfg.secret * up("SECRETCOUNT")
    dist = cells.visit(cur[_I["POSITION_X"]], cur[_I["POSITION_Y"]])
    if dist is not None:
        terms["new_area"] = cfg.new_area * (1.0 + cfg.new_area_distance * dist)
    terms["health"] = cfg.health * _d(prev, cur, "HEALTH")
    terms["armor"] = cfg.armor * _d(prev, cur, "ARMOR")
    ammo = _d(prev, cur, "AMMO2") + _d(prev, cur, "AMMO3")
    terms["ammo"] = cfg.ammo_gain * max(0.0, ammo) + cfg.ammo_loss * min(0.0, ammo)
    return float(sum(terms.values())), terms


__all__ = ["RewardConfig", "VisitedCells", "TERMS", "reward"]
