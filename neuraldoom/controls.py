"""Input sources for the client: keyboard + mouse, or scripted random play, both producing an `Action`.

Key state is kept from the event stream (KEYDOWN/KEYUP, mouse buttons, motion), never from
`pygame.key.get_pressed()`: that one does not see events posted with `pygame.event.post`, which is
how tests (and any scripted driver) feed input. The client passes every event to `handle()`, then asks
for one `action()` per engine step.

Bindings (DOOM-like):
  W / Up      forward            S / Down    back
  A / D       strafe left/right  Left/Right  turn (±4°/tic, DOOM's keyboard turn)
  mouse x     turn (relative mode, overrides the arrow keys when it moves)
  left click / Ctrl   attack     E / Space   use
  Esc quit, F1 overlay/help, P pause, F12 screenshot, M release/capture the mouse
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pygame

from . import actions as A
from .config import MOUSE_SENSITIVITY

# Client commands returned by handle(): the loop acts on them, the engine never sees them.
QUIT, OVERLAY, PAUSE, SCREENSHOT, MOUSE = "quit", "overlay", "pause", "screenshot", "mouse"

KEY_BUTTONS: dict[int, str] = {
    pygame.K_w: "MOVE_FORWARD",
    pygame.K_UP: "MOVE_FORWARD",
    pygame.K_s: "MOVE_BACKWARD",
    pygame.K_DOWN: "MOVE_BACKWARD",
    pygame.K_a: "MOVE_LEFT",
    pygame.K_d: "MOVE_RIGHT",
    pygame.K_LCTRL: "ATTACK",
    pygame.K_RCTRL: "ATTACK",
    pygame.K_e: "USE",
    pygame.K_SPACE: "USE",
}
MOUSE_BUTTONS: dict[int, str] = {1: "ATTACK", 3: "USE"}  # left click fires, right click opens doors
KEY_TURN: dict[int, float] = {pygame.K_LEFT: -4.0, pygame.K_RIGHT: 4.0}  # degrees per tic, + = right
KEY_COMMANDS: dict[int, str] = {
    pygame.K_ESCAPE: QUIT,
    pygame.K_F1: OVERLAY,
    pygame.K_p: PAUSE,
    pygame.K_F12: SCREENSHOT,
    pygame.K_m: MOUSE,
}
HELP = ("WASD/arrows move+turn  mouse turn  click/Ctrl fire  E/Space use\n"
        "Esc quit  F1 overlay/help  P pause  F12 screenshot  M mouse grab")


@dataclass
class KeyboardMouse:
    """Keyboard + mouse -> Action, from the event stream.

    `sensitivity` is degrees of turn per pixel of mouse x-motion; the motion accumulated over one step
    is spread over the step's `frame_skip` tics and snapped to the nearest turn bucket.
    """

    frame_skip: int = 2
    sensitivity: float = MOUSE_SENSITIVITY

    def __post_init__(self) -> None:
        self.keys: set[int] = set()
        self.mouse_buttons: set[int] = set()
        self.dx = 0.0

    def handle(self, event: pygame.event.Event) -> str | None:
        """Update the held state from one event; return a client command (QUIT, PAUSE…) or None."""
        t = event.type
        if t == pygame.QUIT:
            return QUIT
        if t == pygame.KEYDOWN:
            key = getattr(event, "key", None)
            if key in KEY_COMMANDS:
                return KEY_COMMANDS[key]
            self.keys.add(key)
        elif t == pygame.KEYUP:
            self.keys.discard(getattr(event, "key", None))
        elif t == pygame.MOUSEBUTTONDOWN:
            self.mouse_buttons.add(getattr(event, "button", 0))
        elif t == pygame.MOUSEBUTTONUP:
            self.mouse_buttons.discard(getattr(event, "button", 0))
        elif t == pygame.MOUSEMOTION:
            self.dx += getattr(event, "rel", (0, 0))[0]
        elif t == pygame.WINDOWFOCUSLOST:
            self.release_all()  # a KEYUP sent to another window would leave keys stuck down
        return None

    def release_all(self) -> None:
        self.keys.clear()
        self.mouse_buttons.clear()
        self.dx = 0.0

    def action(self) -> A.Action:
        """The action for the next step; consumes the mouse motion accumulated since the last call."""
        names = {KEY_BUTTONS[k] for k in self.keys if k in KEY_BUTTONS}
        names |= {MOUSE_BUTTONS[b] for b in self.mouse_buttons if b in MOUSE_BUTTONS}
        bits = sum(1 << A.BUTTONS.index(n) for n in names)
        turn = A.turn_bucket(self.dx * self.sensitivity / self.frame_skip)
        self.dx = 0.0
        if turn == A.NO_TURN:  # the mouse did not move (enough): the arrow keys turn
            turn = A.turn_bucket(sum(KEY_TURN.get(k, 0.0) for k in self.keys))
        return A.Action(bits, turn)


class RandomInput:
    """Scripted play for `--input random`: the data collector's sticky random policy, seeded.

    Still reads events, so Esc and the window's close button work while it plays.
    """

    def __init__(self, seed: int | None = 0, repeat: float = 0.8) -> None:
        self.policy = A.StickyRandomPolicy(np.random.default_rng(seed), repeat)

    def handle(self, event: pygame.event.Event) -> str | None:
        if event.type == pygame.QUIT:
            return QUIT
        if event.type == pygame.KEYDOWN:
            return KEY_COMMANDS.get(getattr(event, "key", None))
        return None

    def action(self) -> A.Action:
        return self.policy()


__all__ = ["KeyboardMouse", "RandomInput", "HELP", "QUIT", "OVERLAY", "PAUSE", "SCREENSHOT", "MOUSE"]
