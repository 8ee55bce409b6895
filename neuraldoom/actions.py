"""One action representation for every source: keyboard and mouse, the PPO agent, random play, the model.

An `Action` is the set of buttons held plus a turn bucket. The real game receives it as a ViZDoom
button vector; the model receives it as integers (button bits + turn bucket) that it embeds as one
token: the sum of learned per-button embeddings and a turn embedding (docs/DESIGN.md §6), so combinations
rarely seen in training still mean something.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Order matters: it is the bit order of Action.buttons, recorded in every recording and checkpoint.
BUTTONS: tuple[str, ...] = (
    "MOVE_FORWARD",
    "MOVE_BACKWARD",
    "MOVE_LEFT",  # strafe
    "MOVE_RIGHT",
    "ATTACK",
    "USE",
)
# Turning, in degrees per game tic (positive = right). ViZDoom applies TURN_LEFT_RIGHT_DELTA on every
# tic of a multi-tic step, so these are per tic, not per step. ±4°/tic is about DOOM's keyboard turn.
TURN_BUCKETS: tuple[float, ...] = (-8.0, -4.0, -1.5, 0.0, 1.5, 4.0, 8.0)
NO_TURN = TURN_BUCKETS.index(0.0)
NUM_BUTTONS = len(BUTTONS)
NUM_TURNS = len(TURN_BUCKETS)


class ActionError(ValueError):
    """An action vector that does not fit the button set."""


@dataclass(frozen=True)
class Action:
    """Buttons held (bitmask in BUTTONS order) and a turn bucket index into TURN_BUCKETS."""

    buttons: int = 0
    turn: int = NO_TURN

    def __post_init__(self) -> None:
        if not 0 <= self.buttons < (1 << NUM_BUTTONS):
            raise ActionError(f"buttons bitmask {self.buttons} out of range for {NUM_BUTTONS} buttons")
        if not 0 <= self.turn < NUM_TURNS:
            raise ActionError(f"turn bucket {self.turn} out of range 0..{NUM_TURNS - 1}")

    @classmethod
    def of(cls, *names: str, turn: float = 0.0) -> Action:
        """Action.of("MOVE_FORWARD", "ATTACK", turn=4.0) — turn in degrees per tic, snapped to a bucket."""
        bits = 0
        for n in names:
            if n not in BUTTONS:
                raise ActionError(f"unknown button {n!r}; known: {', '.join(BUTTONS)}")
            bits |= 1 << BUTTONS.index(n)
        return cls(bits, turn_bucket(turn))

    @property
    def code(self) -> np.ndarray:
        """[buttons bitmask, turn bucket] int64: how recordings, the ring buffer and the model hold it."""
        return np.array([self.buttons, self.turn], np.int64)

    @classmethod
    def from_code(cls, code: np.ndarray | list[int]) -> Action:
        return cls(int(code[0]), int(code[1]))

    def pressed(self) -> tuple[str, ...]:
        return tuple(b for i, b in enumerate(BUTTONS) if self.buttons >> i & 1)

    @property
    def turn_degrees(self) -> float:
        return TURN_BUCKETS[self.turn]

    def to_vizdoom(self) -> list[float]:
        """The vector for DoomGame.make_action over BUTTONS + [TURN_LEFT_RIGHT_DELTA]."""
        return [float(self.buttons >> i & 1) for i in range(NUM_BUTTONS)] + [self.turn_degrees]

    @classmethod
    def from_vizdoom(cls, vec: list[float] | np.ndarray) -> Action:
        vec = list(vec)
        if len(vec) != NUM_BUTTONS + 1:
            # make_action itself would silently pad or truncate: refuse instead.
            raise ActionError(f"action vector has {len(vec)} values, expected {NUM_BUTTONS + 1}")
        bits = sum(1 << i for i, v in enumerate(vec[:NUM_BUTTONS]) if v)
        return cls(bits, turn_bucket(float(vec[-1])))

    def __str__(self) -> str:
        parts = [b.lower() for b in self.pressed()]
        if self.turn != NO_TURN:
            parts.append(f"turn{self.turn_degrees:+g}")
        return "+".join(parts) or "noop"


NOOP = Action()


def turn_bucket(degrees_per_tic: float) -> int:
    """The nearest turn bucket to a turn rate."""
    return int(np.argmin([abs(degrees_per_tic - b) for b in TURN_BUCKETS]))


def encode(actions: list[Action]) -> np.ndarray:
    """Actions -> (T, 2) int64 [buttons bitmask, turn bucket], the model's and the recordings' encoding."""
    return np.array([a.code for a in actions], dtype=np.int64).reshape(-1, 2)


def decode(codes: np.ndarray) -> list[Action]:
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] != 2:
        raise ActionError(f"action codes must have shape (T, 2), got {codes.shape}")
    return [Action.from_code(c) for c in codes]


def button_bits(codes: np.ndarray) -> np.ndarray:
    """(..., 2) codes -> (..., NUM_BUTTONS) 0/1 multi-hot, for embedding as a sum of button vectors."""
    b = np.asarray(codes)[..., 0]
    return (b[..., None] >> np.arange(NUM_BUTTONS)) & 1


def all_actions() -> list[Action]:
    """The agent's discrete action set: movement x attack/use x turn, kept small but human-like."""
    moves = [0, 1, 2, 4, 8, 1 | 4, 1 | 8]  # none, fwd, back, strafe l/r, fwd+strafe
    extras = [0, 16, 32]  # none, attack, use
    turns = [NO_TURN - 2, NO_TURN - 1, NO_TURN, NO_TURN + 1, NO_TURN + 2]
    return [Action(m | e, t) for m in moves for e in extras for t in turns]


class StickyRandomPolicy:
    """Exploration for data collection: hold an action, with probability `repeat` keep it next step.

    New actions favour moving forward and turning, so random play actually travels through the map.
    With `idle` > 0 a new action is, with that probability, standing still (NOOP) held with probability
    `idle_repeat` a step (0.95: ~1 s): players stand still, and a model that never saw a still view long
    enough to stop sliding lets a still scene dissolve. idle = 0 draws exactly as before.
    turns=False: the same draws with every turn dropped (a player who only walks, strafes and fires: far
    from the collection's three turning steps in four, the play a model must also survive).
    """

    def __init__(self, rng: np.random.Generator, repeat: float = 0.8, idle: float = 0.0,
                 idle_repeat: float = 0.95, turns: bool = True) -> None:
        self.rng = rng
        self.repeat = repeat
        self.idle = idle
        self.idle_repeat = idle_repeat
        self.turns = turns
        self.last = NOOP
        self.idling = False

    def __call__(self) -> Action:
        if self.rng.random() < (self.idle_repeat if self.idling else self.repeat):
            return self.last
        self.idling = bool(self.idle) and self.rng.random() < self.idle
        if self.idling:
            self.last = NOOP
            return self.last
        r = self.rng.random
        bits = 0
        if r() < 0.6:
            bits |= 1  # forward
        elif r() < 0.25:
            bits |= 2  # back
        if r() < 0.25:
            bits |= 4 if r() < 0.5 else 8  # strafe
        if r() < 0.25:
            bits |= 16  # attack
        if r() < 0.08:
            bits |= 32  # use (doors)
        turn = int(self.rng.choice(NUM_TURNS, p=[0.1, 0.15, 0.1, 0.3, 0.1, 0.15, 0.1]))
        self.last = Action(bits, turn if self.turns else NO_TURN)
        return self.last
