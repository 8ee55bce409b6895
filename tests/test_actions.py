"""Action <-> ViZDoom vector <-> integer codes: the one action representation every part shares."""

from __future__ import annotations

import numpy as np
import pytest

from neuraldoom import actions as A
from neuraldoom.actions import Action, ActionError


def every_action() -> list[Action]:
    return [Action(b, t) for b in range(1 << A.NUM_BUTTONS) for t in range(A.NUM_TURNS)]


def test_vizdoom_round_trip_covers_every_action():
    for a in every_action():
        vec = a.to_vizdoom()
        assert len(vec) == A.NUM_BUTTONS + 1
        assert set(vec[:-1]) <= {0.0, 1.0}
        assert vec[-1] == A.TURN_BUCKETS[a.turn]
        assert Action.from_vizdoom(vec) == a
        assert Action.from_vizdoom(np.asarray(vec)) == a


def test_codes_round_trip_and_shape():
    acts = every_action()
    codes = A.encode(acts)
    assert codes.shape == (len(acts), 2) and codes.dtype == np.int64
    assert A.decode(codes) == acts
    assert A.encode([]).shape == (0, 2)


def test_of_sets_named_bits_in_button_order():
    a = Action.of("MOVE_FORWARD", "ATTACK", turn=4.0)
    assert a.pressed() == ("MOVE_FORWARD", "ATTACK")
    assert a.buttons == (1 << 0) | (1 << 4)
    assert a.turn_degrees == 4.0
    assert str(a) == "move_forward+attack+turn+4"
    assert str(A.NOOP) == "noop"
    assert A.button_bits(A.encode([a]))[0].tolist() == [1, 0, 0, 0, 1, 0]


@pytest.mark.parametrize(
    "deg, expected",
    [(0.0, 0.0), (0.7, 0.0), (0.8, 1.5), (-1.0, -1.5), (3.0, 4.0), (-5.9, -4.0), (6.1, 8.0), (100.0, 8.0),
     (-100.0, -8.0)],
)
def test_turn_bucket_snaps_to_nearest(deg, expected):
    assert A.TURN_BUCKETS[A.turn_bucket(deg)] == expected


def test_from_vizdoom_snaps_turn():
    vec = [1, 0, 0, 0, 0, 0, 3.2]
    assert Action.from_vizdoom(vec) == Action.of("MOVE_FORWARD", turn=4.0)


@pytest.mark.parametrize("n", [0, A.NUM_BUTTONS, A.NUM_BUTTONS + 2])
def test_wrong_length_vector_is_refused(n):
    with pytest.raises(ActionError, match="expected"):
        Action.from_vizdoom([0.0] * n)


@pytest.mark.parametrize("buttons, turn", [(-1, A.NO_TURN), (1 << A.NUM_BUTTONS, A.NO_TURN), (0, -1),
                                           (0, A.NUM_TURNS)])
def test_out_of_range_is_refused(buttons, turn):
    with pytest.raises(ActionError, match="out of range"):
        Action(buttons, turn)


def test_bad_codes_and_names_are_refused():
    with pytest.raises(ActionError):
        A.decode(np.zeros((3, 3), np.int64))
    with pytest.raises(ActionError):
        A.decode(np.array([[99, 0]]))
    with pytest.raises(ActionError, match="unknown button"):
        Action.of("JUMP")


def test_agent_action_set_is_valid_and_distinct():
    acts = A.all_actions()
    assert len(set(acts)) == len(acts) == 7 * 3 * 5
    assert A.NOOP in acts


def test_sticky_random_policy_is_seeded_and_sticky():
    def run(seed: int) -> list[Action]:
        p = A.StickyRandomPolicy(np.random.default_rng(seed), repeat=0.8)
        return [p() for _ in range(500)]

    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a != c
    repeats = sum(x == y for x, y in zip(a, a[1:], strict=False)) / (len(a) - 1)
    assert repeats > 0.75  # held actions, like a human
    assert sum(x.buttons & 1 for x in a) > 100  # it mostly walks forward


def test_sticky_random_policy_idles_in_long_still_runs_and_idle_zero_draws_as_before():
    def run(idle: float, n: int = 4000) -> list[Action]:
        p = A.StickyRandomPolicy(np.random.default_rng(5), repeat=0.8, idle=idle)
        return [p() for _ in range(n)]

    plain = run(0.0)
    rng = np.random.default_rng(5)  # idle 0 is the default policy, draw for draw
    old = A.StickyRandomPolicy(rng, repeat=0.8)
    assert plain == [old() for _ in range(4000)]
    runs, length = [], 0
    for x in run(0.15):
        if x == A.NOOP:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    still = sum(runs) / 4000
    assert 0.25 < still < 0.6  # 0.15 x 20 steps against 0.85 x 5: about 40% of the steps
    assert np.mean(runs) > 10  # held ~1 s, long enough for the view to stop sliding
    assert sum(x == A.NOOP for x in plain) / 4000 < 0.1


def test_sticky_random_policy_without_turns_is_the_same_play_without_turning():
    turning = A.StickyRandomPolicy(np.random.default_rng(3), repeat=0.8)
    straight = A.StickyRandomPolicy(np.random.default_rng(3), repeat=0.8, turns=False)
    a, b = [turning() for _ in range(2000)], [straight() for _ in range(2000)]
    assert all(x.turn == A.NO_TURN for x in b)
    assert [x.buttons for x in a] == [x.buttons for x in b]  # the same draws: only the turn is dropped
    assert sum(x.turn != A.NO_TURN for x in a) > 1000  # the collection turns most steps
