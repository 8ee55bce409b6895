"""The real game: a headless ViZDoom behind the engine protocol `reset(seed) -> frame`, `step(action) -> frame`.

Always headless: a visible ViZDoom window without a display segfaults the whole process; pygame draws.
The engine runs as a child process that ignores SIGTERM and outlives a killed parent, so every game gets
a tiny reaper process that SIGKILLs the engine once its Python parent is gone. The engine also writes
_vizdoom.ini and _vizdoom/ into its working directory: it is started inside a private temp directory.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import vizdoom as vzd

from .actions import BUTTONS, NUM_BUTTONS, Action, ActionError
from .config import GAME_VARIABLES, GameConfig

RESOLUTIONS = {(120, 160): "RES_160X120", (240, 320): "RES_320X240", (480, 640): "RES_640X480",
               (200, 320): "RES_320X200", (256, 320): "RES_320X256"}
_CHDIR_LOCK = threading.Lock()

_REAPER = """
import os, shutil, sys, time
parent, engine = int(sys.argv[1]), int(sys.argv[2])
tmp = sys.argv[3] if len(sys.argv) > 3 else ""
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
while alive(engine):
    if os.getppid() != parent:  # our Python parent died: we were re-parented
        try:
            os.kill(engine, 9)
        except OSError:
            pass
        if tmp:  # the engine's private folder: nobody else will remove it now
            time.sleep(0.2)
            shutil.rmtree(tmp, ignore_errors=True)
        break
    time.sleep(0.5)
"""


class GameError(RuntimeError):
    """A game that cannot be set up: unknown WAD, scenario or map, unsupported resolution."""


def vizdoom_root() -> Path:
    return Path(vzd.__file__).parent


def resolve_wad(cfg: GameConfig) -> tuple[str, str]:
    """(game WAD path, scenario WAD path or '') for a config, with a clear error for unknown names."""
    root = vizdoom_root()
    wad = Path(cfg.wad) if os.sep in cfg.wad else root / cfg.wad
    if not wad.is_file():
        known = ", ".join(sorted(p.name for p in root.glob("*.wad")))
        raise GameError(f"unknown WAD {cfg.wad!r}; shipped WADs: {known}")
    scenario = ""
    if cfg.scenario:
        s = Path(cfg.scenario)
        if s.suffix.lower() == ".cfg":
            raise GameError(cfg_refusal(s))
        if not s.suffix:
            s = root / "scenarios" / f"{cfg.scenario}.wad"
        if not s.is_file():
            known = ", ".join(sorted(p.stem for p in (root / "scenarios").glob("*.wad")))
            raise GameError(f"unknown scenario {cfg.scenario!r}; shipped scenarios: {known}")
        scenario = str(s)
    return str(wad), scenario


def cfg_refusal(path: Path) -> str:
    """Why a ViZDoom .cfg is not taken as a scenario (its buttons, variables and screen would fight the
    game's own), naming the WAD and map it points to when it can be read."""
    found = {}
    try:
        for line in path.read_text(errors="replace").splitlines():
            key, eq, value = line.split("#", 1)[0].partition("=")
            key = key.strip().lower().replace("_", "")
            if eq and key in ("doomscenariopath", "doommap"):
                found[key] = value.strip()
    except OSError:
        pass
    hint = ""
    if "doomscenariopath" in found:  # ViZDoom's own default map is MAP01
        wad = path.parent / found["doomscenariopath"]
        hint = f"; it plays {wad} map {found.get('doommap', 'map01').upper()}: give that WAD and map instead"
    return f"scenario {str(path)!r} is a ViZDoom .cfg, not a shipped scenario name or a .wad{hint}"


def wad_maps(path: str) -> set[str]:
    """Map names in a WAD: marker lumps followed by THINGS (or TEXTMAP); empty if it cannot be read.

    Checked before init because ViZDoom given a map the WAD lacks does not fail: new_episode() hangs.
    """
    try:
        with open(path, "rb") as f:
            ident, n, offset = struct.unpack("<4sii", f.read(12))
            if ident not in (b"IWAD", b"PWAD"):
                return set()
            f.seek(offset)
            directory = f.read(16 * n)
    except (OSError, struct.error):
        return set()
    names = [directory[i + 8:i + 16].rstrip(b"\0").decode("ascii", "replace").upper()
             for i in range(0, len(directory) - 15, 16)]
    return {a for a, b in zip(names, names[1:], strict=False) if b in ("THINGS", "TEXTMAP")}


def _engine_children() -> set[int]:
    """PIDs of our direct children (the ViZDoom engine is one)."""
    me = str(os.getpid())
    kids = set()
    for task in Path(f"/proc/{me}/task").glob("*"):
        try:
            kids |= {int(p) for p in (task / "children").read_text().split()}
        except OSError:
            pass
    return kids


class RealGame:
    """Headless ViZDoom. `frame` is uint8 (H, W, 3); `variables` follow GAME_VARIABLES."""

    def __init__(self, cfg: GameConfig = GameConfig()) -> None:
        self.cfg = cfg
        wad, scenario = resolve_wad(cfg)
        maps = wad_maps(wad) | (wad_maps(scenario) if scenario.endswith(".wad") else set())
        if maps and cfg.map.upper() not in maps:
            where = Path(scenario or wad).name
            raise GameError(f"unknown map {cfg.map!r} in {where}; it has: {', '.join(sorted(maps))}")
        res = RESOLUTIONS.get((cfg.height, cfg.width))
        if res is None:
            raise GameError(f"unsupported resolution {cfg.width}x{cfg.height}; "
                            "use 160x120, 320x240, 320x200, 320x256 or 640x480")
        g = vzd.DoomGame()
        if scenario:
            g.set_doom_scenario_path(scenario)
        g.set_doom_game_path(wad)
        g.set_doom_map(cfg.map)
        g.set_doom_skill(cfg.skill)
        g.set_screen_resolution(getattr(vzd.ScreenResolution, res))
        g.set_screen_format(vzd.ScreenFormat.RGB24)
        g.set_render_hud(cfg.hud)
        g.set_render_crosshair(False)
        g.set_render_weapon(True)
        g.set_render_decals(False)
        g.set_render_particles(False)
        g.set_window_visible(False)  # never True: segfaults without a display
        g.set_sound_enabled(False)
        g.set_mode(vzd.Mode.PLAYER)
        g.set_episode_timeout(cfg.episode_timeout)
        g.set_automap_buffer_enabled(cfg.automap)
        if cfg.automap:
            g.set_automap_mode(vzd.AutomapMode.OBJECTS)
            g.set_automap_rotate(False)
        g.set_available_buttons([getattr(vzd.Button, b) for b in BUTTONS] + [vzd.Button.TURN_LEFT_RIGHT_DELTA])
        g.set_available_game_variables([getattr(vzd.GameVariable, v) for v in GAME_VARIABLES])
        self._tmp = tempfile.mkdtemp(prefix="neuraldoom-vizdoom-")
        g.set_doom_config_path(os.path.join(self._tmp, "_vizdoom.ini"))
        before = _engine_children()
        with _CHDIR_LOCK:  # the engine inherits the cwd at spawn: keep its litter out of the user's folder
            cwd = os.getcwd()
            os.chdir(self._tmp)
            try:
                g.init()
            except Exception as e:  # vizdoom raises its own exception types, with multi-line text
                shutil.rmtree(self._tmp, ignore_errors=True)
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise GameError(f"ViZDoom could not start map {cfg.map!r} of {Path(wad).name}: {msg}") from None
            finally:
                os.chdir(cwd)
        self.game = g
        self._reapers = [
            subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), str(pid), self._tmp],
                             stdin=subprocess.DEVNULL, start_new_session=True)
            for pid in _engine_children() - before
        ]
        self.frame = np.zeros((cfg.height, cfg.width, 3), np.uint8)
        self.automap: np.ndarray | None = None
        self.variables = np.zeros(len(GAME_VARIABLES), np.float32)
        self.done = False
        self.seed: int | None = None

    # -- the engine protocol -------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> np.ndarray:
        """Start a new episode; the same seed and the same actions give byte-identical frames."""
        if seed is not None:
            self.game.set_seed(int(seed) % (2**31))
        self.seed = seed
        self.game.new_episode()
        self.done = False
        self._read_state()
        return self.frame

    def step(self, action: Action) -> np.ndarray:
        """Hold `action` for frame_skip tics. After the episode ends the last frame is returned again."""
        if not isinstance(action, Action):
            raise ActionError(f"step() takes an Action, got {type(action).__name__}")
        if self.done:
            return self.frame
        vec = action.to_vizdoom()
        if len(vec) != NUM_BUTTONS + 1:
            raise ActionError(f"action vector has {len(vec)} values, expected {NUM_BUTTONS + 1}")
        self.reward = self.game.make_action(vec, self.cfg.frame_skip)
        self.done = self.game.is_episode_finished()
        if not self.done:
            self._read_state()
        return self.frame

    def _read_state(self) -> None:
        s = self.game.get_state()
        if s is None:
            return
        self.frame = np.ascontiguousarray(s.screen_buffer)  # (H, W, 3) uint8
        self.variables = np.asarray(s.game_variables, np.float32)
        if self.cfg.automap and s.automap_buffer is not None:
            self.automap = np.ascontiguousarray(s.automap_buffer)

    def var(self, name: str) -> float:
        return float(self.variables[GAME_VARIABLES.index(name)])

    def close(self) -> None:
        if getattr(self, "game", None) is not None:
            try:
                self.game.close()
            except Exception:
                pass
            self.game = None
        for r in getattr(self, "_reapers", []):
            r.kill()
            r.wait()
        self._reapers = []
        shutil.rmtree(getattr(self, "_tmp", ""), ignore_errors=True)

    def __enter__(self) -> RealGame:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
