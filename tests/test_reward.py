"""The agent's reward: one test per term on crafted game-variable sequences (GameNGen appendix A.5)."""

from __future__ import annotations

import numpy as np
import pytest

from neuraldoom.game import GAME_VARIABLES
from neuraldoom.reward import TERMS, RewardConfig, VisitedCells, reward


def vars_(**kw: float) -> np.ndarray:
    """A game-variable vector: full health, pistol with 50 bullets, at (0, 0), overridden by kw."""
    base = {"HEALTH": 100, "SELECTED_WEAPON": 2, "SELECTED_WEAPON_AMMO": 50, "AMMO2": 50}
    v = np.zeros(len(GAME_VARIABLES), np.float32)
    for k, x in {**base, **kw}.items():
        v[GAME_VARIABLES.index(k)] = x
    return v


def only(prev: np.ndarray, cur: np.ndarray, term: str, cells: VisitedCells | None = None) -> float:
    """The transition's value for `term`, asserting every other term is 0 and the total is their sum."""
    cells = VisitedCells() if cells is None else cells  # (an empty tracker is falsy)
    cells.visit(prev[GAME_VARIABLES.index("POSITION_X")], prev[GAME_VARIABLES.index("POSITION_Y")])
    total, terms = reward(prev, cur, cells)
    assert set(terms) == set(TERMS)
    others = {k: v for k, v in terms.items() if k != term and v != 0}
    assert not others, f"{term}: unexpected other terms {others}"
    assert total == pytest.approx(terms[term])
    return terms[term]


def test_nothing_happens_is_zero():
    total, terms = reward(vars_(), vars_(), VisitedCells())
    assert total == 0 and all(v == 0 for v in terms.values())


def test_player_hit():
    assert only(vars_(), vars_(HITS_TAKEN=1), "player_hit") == -100
    assert only(vars_(HITS_TAKEN=2), vars_(HITS_TAKEN=5), "player_hit") == -300


def test_player_death_once():
    assert only(vars_(), vars_(DEAD=1), "death") == -5000
    assert only(vars_(DEAD=1), vars_(DEAD=1), "death") == 0  # dead stays dead: paid once


def test_enemy_hit():
    assert only(vars_(), vars_(HITCOUNT=1), "enemy_hit") == 300


def test_enemy_kill():
    assert only(vars_(KILLCOUNT=1), vars_(KILLCOUNT=3), "enemy_kill") == 2000


def test_item_pickup():
    assert only(vars_(), vars_(ITEMCOUNT=1), "pickup") == 100


def test_secret_found():
    assert only(vars_(), vars_(SECRETCOUNT=1), "secret") == 500


def test_counters_falling_score_nothing():
    """A new episode resets the counters: never a negative kill or hit reward."""
    _, terms = reward(vars_(KILLCOUNT=4, HITCOUNT=9, HITS_TAKEN=3, ITEMCOUNT=2), vars_(), VisitedCells())
    assert all(terms[k] == 0 for k in ("enemy_kill", "enemy_hit", "player_hit", "pickup"))


def test_new_area_with_l1_distance_bonus():
    cells = VisitedCells(cell_size=64)
    start = vars_(POSITION_X=10, POSITION_Y=10)
    # same cell as the start: nothing
    assert only(start, vars_(POSITION_X=60, POSITION_Y=30), "new_area", cells) == 0
    # next cell east: L1 = 1 -> 20 * (1 + 0.5)
    assert only(start, vars_(POSITION_X=70, POSITION_Y=10), "new_area", cells) == 30
    # again: visited already
    assert only(start, vars_(POSITION_X=100, POSITION_Y=50), "new_area", cells) == 0
    # 3 east, 2 south (negative y) of the start: L1 = 5 -> 20 * 3.5
    assert only(start, vars_(POSITION_X=200, POSITION_Y=-100), "new_area", cells) == 70
    assert len(cells) == 3


def test_health_delta():
    assert only(vars_(HEALTH=100), vars_(HEALTH=75), "health") == -250
    assert only(vars_(HEALTH=50), vars_(HEALTH=60), "health") == 100


def test_armor_delta():
    assert only(vars_(ARMOR=0), vars_(ARMOR=100), "armor") == 1000
    assert only(vars_(ARMOR=100), vars_(ARMOR=90), "armor") == -100


def test_ammo_delta_asymmetric():
    assert only(vars_(AMMO2=50), vars_(AMMO2=49), "ammo") == -1  # a shot costs 1
    assert only(vars_(AMMO2=50), vars_(AMMO2=60), "ammo") == 100  # a clip pays 10 per bullet
    assert only(vars_(AMMO3=0), vars_(AMMO3=8), "ammo") == 80  # shells count too


def test_weapon_switch_is_not_an_ammo_change():
    # the selected weapon's ammo jumps on a switch; the pools do not
    prev, cur = vars_(SELECTED_WEAPON=2, SELECTED_WEAPON_AMMO=50), vars_(SELECTED_WEAPON=3, SELECTED_WEAPON_AMMO=8)
    assert reward(prev, cur, VisitedCells())[0] == 0


def test_terms_add_up_and_config_scales():
    cfg = RewardConfig(enemy_kill=1.0, enemy_hit=2.0)
    total, terms = reward(vars_(), vars_(KILLCOUNT=1, HITCOUNT=1, HEALTH=90), VisitedCells(), cfg)
    assert terms["enemy_kill"] == 1 and terms["enemy_hit"] == 2 and terms["health"] == -100
    assert total == pytest.approx(sum(terms.values()))
