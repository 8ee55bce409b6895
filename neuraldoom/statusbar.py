"""Read AMMO, HEALTH and ARMOR off the status bar of a 160x120 freedoom frame: game state as a metric.

The three big red numbers are right-aligned in fixed 7-pixel digit cells (hundreds, tens, ones), measured
on real 160x120 frames: digit rows 102-111, ammo cells from x=1, health from x=24 (then '%'), armor from
x=90 (then '%'). Each cell goes to its nearest template among 11 classes (0-9, blank). A template is the
mean cell of real frames whose recorded game variables say what the cell shows, one per (field, cell,
class), because the scaled-down bar draws the same glyph a pixel off at some places (armor tens). The
fit adds cheat-given frames (`cheat_frames`) for what play in E1M1 never shows (armor past 3, health
and ammo in the hundreds); a class still never seen at a place borrows its mean over the other places.
Nothing is hand-drawn. A cell is seen through its redness, R - (G + B) / 2: zero on the grey panel, the
whole glyph on the red digits. The pickup (gold) and pain (red) flashes blend the screen towards one
colour, which adds a constant to the redness and scales it: subtracting the cell's mean and dividing by
its norm removes both. A cell is read only when it lies within half the gap between the two closest templates of
its place; anything else (a smeared digit out of a model) is unreadable, and so is its field (UNREADABLE,
-1; a field that shows nothing reads EMPTY, -2).

Truth (`shown_values`): the bar lags the game by one tic, so frame t of a frame_skip-2 recording shows the
variables of row t - 1 or, for a field that changed within the step, of row t. The fist and chainsaw
(weapon slot 1) show no ammo: EMPTY.

    python -m neuraldoom.statusbar --fit data/e1m1   # refit the shipped templates, print held-out accuracy
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import GAME_VARIABLES

FIELDS = ("ammo", "health", "armor")
FRAME_SHAPE = (120, 160, 3)
ROWS = (102, 112)  # digit rows [top, bottom)
CELL_W = 7
FIELD_X = (1, 24, 90)  # left edge of each field's hundreds cell; tens and ones follow CELL_W apart
# Redness contrast (norm over a cell) below which a cell is not scaled up: real digits have 330+, the
# panel ~0, a model's smear of the panel 20-190; normalizing those to unit length would turn noise into glyphs.
CONTRAST_FLOOR = 200.0
BLANK = 10  # class of an empty cell; 0-9 are the digits
UNREADABLE = -1  # a field read() cannot make a number of
EMPTY = -2  # a field that shows nothing: the ammo of the fist and chainsaw
N_CLASSES = 11
DEFAULT_PATH = Path(__file__).parent / "assets" / "statusbar.safetensors"
_VAR = {n: GAME_VARIABLES.index(n) for n in ("SELECTED_WEAPON_AMMO", "HEALTH", "ARMOR", "SELECTED_WEAPON")}


def field_index(fields: tuple[str, ...]) -> list[int]:
    """The FIELDS positions of `fields` (ValueError naming an unknown one)."""
    unknown = [f for f in fields if f not in FIELDS]
    if unknown or not fields:
        raise ValueError(f"status bar fields must be some of {', '.join(FIELDS)}, not {' '.join(fields) or 'none'}")
    return [FIELDS.index(f) for f in fields]


def number_mask(height: int, width: int, fields: tuple[str, ...] = FIELDS) -> np.ndarray | None:
    """(height, width) bool: the pixels of the `fields`' digit cells; None where the reader does not
    apply (frames not 160x120). What the trainers weight: a few percent of the frame that is game state."""
    if (height, width) != FRAME_SHAPE[:2]:
        return None
    m = np.zeros((height, width), bool)
    for k in field_index(fields):
        m[ROWS[0]:ROWS[1], FIELD_X[k]:FIELD_X[k] + 3 * CELL_W] = True
    return m


def _check(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)  # a memmap stays a view: nothing is read yet
    if frames.ndim != 4 or frames.shape[1:] != FRAME_SHAPE:
        raise ValueError(f"the status-bar reader needs 160x120 RGB frames shaped (N, 120, 160, 3); got {frames.shape}")
    return frames


def cell_features(frames: np.ndarray) -> np.ndarray:
    """(N, 3 fields, 3 cells, rows * CELL_W) flash-invariant redness of the digit cells of (N, 120, 160, 3)
    frames."""
    band = np.asarray(_check(frames)[:, ROWS[0]:ROWS[1]], np.float32)  # only the digit rows leave a memmap
    red = band[..., 0] - (band[..., 1] + band[..., 2]) / 2
    cells = np.stack([np.stack([red[:, :, x + k * CELL_W:x + (k + 1) * CELL_W] for k in range(3)], 1)
                      for x in FIELD_X], 1)  # (N, 3 fields, 3 cells, rows, CELL_W)
    f = cells.reshape(*cells.shape[:3], -1)
    f -= f.mean(-1, keepdims=True)
    return f / np.maximum(np.linalg.norm(f, axis=-1, keepdims=True), CONTRAST_FLOOR)


def value_classes(values: np.ndarray) -> np.ndarray:
    """(..., 3) values -> (..., 3 fields, 3 cells) classes, right-aligned; EMPTY is all blank; anything
    else the bar cannot show (UNREADABLE, negative, over 999) gives class -1: ignored by fit."""
    v = np.asarray(values, np.int64)
    out = np.stack([np.where((v >= p) | (p == 1), v // p % 10, BLANK) for p in (100, 10, 1)], -1)
    out[v == EMPTY] = BLANK
    out[((v < 0) & (v != EMPTY)) | (v > 999)] = -1
    return out


def decode(classes: np.ndarray) -> np.ndarray:
    """(..., 3 cells) classes -> values: EMPTY for three blanks; UNREADABLE for an unreadable cell (-1)
    or a pattern no number makes (a gap between digits, a leading zero)."""
    h, t, o = np.moveaxis(np.asarray(classes), -1, 0)
    digit = lambda c: (c >= 0) & (c < BLANK)  # noqa: E731
    ok = (h >= 0) & (t >= 0) & digit(o)
    ok &= np.where(digit(h), digit(t) & (h > 0), (t == BLANK) | (t > 0))  # no gaps, no leading zeros
    val = np.where(digit(h), h * 100, 0) + np.where(digit(t), t * 10, 0) + o
    return np.where(ok, val, np.where((h == BLANK) & (t == BLANK) & (o == BLANK), EMPTY, UNREADABLE))


class StatusBarReader:
    """Nearest-template digit reader, fitted from (frame, true values) pairs."""

    def __init__(self, templates: np.ndarray | None = None, counts: np.ndarray | None = None,
                 max_dist: np.ndarray | None = None) -> None:
        self.templates = templates  # (3 fields, 3 cells, N_CLASSES, D); NaN for a class never seen anywhere
        self.counts = counts  # (3, 3, N_CLASSES) examples behind each template (0: borrowed from other cells)
        self.max_dist = max_dist  # (3, 3) squared distance beyond which a cell is unreadable

    def fit(self, frames: np.ndarray, values: np.ndarray, batch: int = 2048) -> StatusBarReader:
        """values: (N, 3) [ammo, health, armor] (EMPTY: nothing shown) or (N, K, 3) candidates (shown_values);
        a field whose candidates disagree is left out. A class never seen in a cell borrows the mean of
        that class over the other cells (the same glyph, on another patch of background)."""
        frames = _check(frames)
        v = _candidates(values, len(frames))
        values = np.where((v == v[:, :1]).all(1), v[:, 0], UNREADABLE)
        sums, counts = 0.0, np.zeros((3, 3, N_CLASSES))
        for s in range(0, len(frames), batch):
            f, c = cell_features(frames[s:s + batch]), value_classes(values[s:s + batch])
            onehot = (c[..., None] == np.arange(N_CLASSES)).astype(np.float64)  # class -1: no row
            sums += np.einsum("nfkc,nfkd->fkcd", onehot, f)
            counts += onehot.sum(0)
        if not counts.any():
            raise ValueError("fit needs at least one frame with readable values")
        with np.errstate(invalid="ignore", divide="ignore"):
            t = np.where(counts[..., None] > 0, sums / counts[..., None],
                         sums.sum((0, 1)) / counts.sum((0, 1))[:, None])
        self.templates, self.counts = t.astype(np.float32), counts.astype(np.int64)
        # a cell is read only within half the gap between its place's two closest templates
        gap = ((t[:, :, :, None] - t[:, :, None]) ** 2).sum(-1)
        gap[:, :, np.arange(N_CLASSES), np.arange(N_CLASSES)] = np.inf
        self.max_dist = np.nanmin(np.where(np.isnan(gap), np.inf, gap), axis=(2, 3)) / 4
        return self

    def _dist(self, f: np.ndarray) -> np.ndarray:
        """(N, 3, 3, D) features -> (N, 3, 3, N_CLASSES) squared distances (inf for a missing template)."""
        t = self.templates
        d = (f * f).sum(-1, keepdims=True) - 2 * np.einsum("nfkd,fkcd->nfkc", f, t) + (t * t).sum(-1)[None]
        return np.where(np.isnan(d), np.inf, np.maximum(d, 0))

    def classify(self, frames: np.ndarray) -> np.ndarray:
        """(N, 3 fields, 3 cells) classes; -1 for a cell too far from every template."""
        if self.templates is None:
            raise RuntimeError("StatusBarReader is not fitted: call fit() or load()")
        d = self._dist(cell_features(frames))
        return np.where(d.min(-1) <= self.max_dist, d.argmin(-1), -1)

    def read(self, frames: np.ndarray, batch: int = 4096) -> np.ndarray:
        """(N, 120, 160, 3) frames -> (N, 3) int [ammo, health, armor]; UNREADABLE (-1) where a field can't
        be read, EMPTY (-2) where it shows nothing."""
        frames = _check(frames)
        out = [decode(self.classify(frames[s:s + batch])) for s in range(0, len(frames), batch)]
        return np.concatenate(out) if out else np.zeros((0, 3), np.int64)

    # -- storage: safetensors, no pickle -----------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.numpy import save_file

        if self.templates is None:
            raise RuntimeError("nothing to save: the reader is not fitted")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"templates": np.ascontiguousarray(self.templates, np.float32),
                   "counts": np.ascontiguousarray(self.counts, np.int64),
                   "max_dist": np.ascontiguousarray(self.max_dist, np.float64)}, str(path), metadata=_layout())
        return path

    @classmethod
    def load(cls, path: str | Path) -> StatusBarReader:
        from safetensors import safe_open

        with safe_open(str(path), "numpy") as f:
            if (f.metadata() or {}) != _layout():
                raise ValueError(f"{path} was fitted for another status-bar layout ({f.metadata()}); refit it")
            t = {k: f.get_tensor(k) for k in f.keys()}
        return cls(t["templates"], t["counts"], t["max_dist"])

    @classmethod
    def fit_recordings(cls, recs: list[Any], n_frames: int = 6000,
                       extra: tuple[np.ndarray, np.ndarray] | None = None) -> StatusBarReader:
        """Fit on up to n_frames rows spread evenly over the recordings, plus optional (frames, (N, 3) values)."""
        frames, values = sample_recordings(recs, n_frames)
        if extra is not None:
            ex = np.asarray(extra[1])[:, None].repeat(2, 1)
            frames, values = np.concatenate([frames, extra[0]]), np.concatenate([values, ex])
        return cls().fit(frames, values)


def _layout() -> dict[str, str]:
    return {"rows": f"{ROWS[0]},{ROWS[1]}", "cell_w": str(CELL_W), "field_x": ",".join(map(str, FIELD_X)),
            "feature": f"redness, contrast floor {CONTRAST_FLOOR:g}"}


def _candidates(values: np.ndarray, n: int) -> np.ndarray:
    v = np.asarray(values, np.int64)
    v = v[:, None] if v.ndim == 2 else v
    if v.ndim != 3 or v.shape[0] != n or v.shape[2] != 3:
        raise ValueError(f"values must be (N, 3) or (N, K, 3) [ammo, health, armor] for {n} frames; got {v.shape}")
    return v


def vars_values(variables: np.ndarray) -> np.ndarray:
    """Game variables (..., len(GAME_VARIABLES)) -> (..., 3) int [ammo, health, armor] as the bar shows
    them: ammo EMPTY for weapon slot 1 (fist, chainsaw), which has none."""
    v = np.asarray(variables)
    ammo = np.where(v[..., _VAR["SELECTED_WEAPON"]] == 1, EMPTY, v[..., _VAR["SELECTED_WEAPON_AMMO"]])
    return np.stack([ammo, v[..., _VAR["HEALTH"]], v[..., _VAR["ARMOR"]]], -1).round().astype(np.int64)


def shown_values(variables: np.ndarray, episode: np.ndarray | None = None) -> np.ndarray:
    """What the bar of each frame of a played sequence shows: (N, 2, 3) candidates [row - 1, row].

    The bar lags the game by one tic (measured at frame_skip 1: frame t shows the variables of t - 1).
    A frame of a frame_skip-k recording shows the state one tic before its own, between the variables of
    rows t - 1 and t: a field that changed within the step may show either (health does, about half
    each; ammo, spent on a fixed beat from the step's first tic, has always shown t - 1). An episode's
    first row has no row before it: both candidates are its own. For frame_skip 1 take [:, 0]."""
    v = vars_values(variables)
    first = np.zeros(len(v), bool)
    first[:1] = True
    if episode is not None:
        first[1:] = np.asarray(episode)[1:] != np.asarray(episode)[:-1]
    prev = np.concatenate([v[:1], v[:-1]])
    prev[first] = v[first]
    return np.stack([prev, v], 1)


def frame_values(rec: Any, rows: np.ndarray | None = None) -> np.ndarray:
    """shown_values of some rows of a recording: (len(rows), 2, 3)."""
    ep = np.asarray(rec.steps["episode"])
    rows = np.arange(len(rec)) if rows is None else np.asarray(rows, np.int64)
    prev = np.maximum(rows - 1, 0)
    prev = np.where((rows > 0) & (ep[prev] == ep[rows]), prev, rows)
    variables = np.asarray(rec.steps["vars"])
    return np.stack([vars_values(variables[prev]), vars_values(variables[rows])], 1)


def bar_changes(frames: np.ndarray, episode: np.ndarray, fields: tuple[str, ...] = FIELDS) -> np.ndarray:
    """(N,) bool: the frames whose bar reads other numbers in `fields` than the frame before in their
    episode (ammo spent, health lost or picked up; "ammo" alone: the shots, without the damage and pickup
    flashes that come with a health or armor change, mostly). Read off the frames, which the reader
    reads right: the recorded variables cannot say which of a step's two tics a frame shows (shown_values),
    and a test on them flags twice as many steps as the bar shows changing. All False where the reader does
    not apply."""
    episode = np.asarray(episode)  # frames may be a recording's memmap: the reader reads only the digit rows
    cols = field_index(fields)
    out = np.zeros(len(episode), bool)
    if len(episode) < 2 or tuple(frames.shape[1:]) != FRAME_SHAPE:
        return out
    vals = default_reader().read(frames)[:, cols]
    out[1:] = (vals[1:] != vals[:-1]).any(1) & (episode[1:] == episode[:-1])
    return out


def sample_recordings(recs: list[Any], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to n (frame, (2, 3) shown-value candidates) pairs spread evenly over the recordings' rows."""
    recs = [r for r in recs if len(r)]
    total = sum(len(r) for r in recs)
    frames, values = [np.zeros((0, *FRAME_SHAPE), np.uint8)], [np.zeros((0, 2, 3), np.int64)]
    for r in recs:
        rows = np.unique(np.linspace(0, len(r) - 1, max(1, round(n * len(r) / total))).round().astype(np.int64))
        frames.append(np.asarray(r.frames[rows]))
        values.append(frame_values(r, rows))
    return np.concatenate(frames), np.concatenate(values)


def read_ok(reader: StatusBarReader, frames: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(N, 3) bool: each field of each frame read right. values: (N, 3), or (N, K, 3) where a field is
    right if it matches any of its K candidates (shown_values)."""
    return reads_ok(reader.read(frames), values)


def reads_ok(got: np.ndarray, values: np.ndarray) -> np.ndarray:
    """read_ok of reads already made: got (N, 3) as StatusBarReader.read."""
    return (got[:, None] == _candidates(values, len(got))).any(1)


def read_accuracy(reader: StatusBarReader, frames: np.ndarray, values: np.ndarray) -> dict[str, float]:
    """Fraction of frames read right (read_ok): all three fields ("all") and each field alone."""
    ok = read_ok(reader, frames, values)
    if not len(ok):
        return {"all": float("nan"), **{f: float("nan") for f in FIELDS}}
    return {"all": float(ok.all(1).mean()), **{f: float(ok[:, k].mean()) for k, f in enumerate(FIELDS)}}


def cheat_frames(episodes: int = 16, steps: int = 30, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Real frames showing what sticky-random play never does (armor past 3, health past 106, ammo in
    the hundreds): a headless E1M1 given items by console cheats. Each frame is taken two NOOP steps
    after its gives, when the bar has caught up. Returns (N, 120, 160, 3) frames and (N, 3) values."""
    from .actions import NOOP
    from .config import GameConfig
    from .game import RealGame

    rng = np.random.default_rng(seed)
    frames, values = [], []
    with RealGame(GameConfig()) as g:
        for ep in range(episodes):
            g.reset(seed * 1000 + ep)
            g.game.send_game_command("sv_cheats 1")
            if ep % 2:
                g.game.send_game_command("give backpack")  # ammo up to 400
            for _ in range(steps):  # increments that reach every cap (200 armor and health) within an episode
                for item, hi in (("armorbonus", 16), ("healthbonus", 8), ("clip", 28)):
                    if (k := int(rng.integers(0, hi))) > 0:
                        g.game.send_game_command(f"give {item} {k}")
                for _ in range(2):
                    g.step(NOOP)
                frames.append(g.frame.copy())
                values.append(vars_values(g.variables))
    return np.stack(frames), np.stack(values)


_DEFAULT: StatusBarReader | None = None


def default_reader() -> StatusBarReader:
    """The reader shipped with the package (freedoom1, 160x120, HUD on), loaded once."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = StatusBarReader.load(DEFAULT_PATH)
    return _DEFAULT


@dataclass(frozen=True)
class Args:
    fit: str  # dataset folder: DATA/train is fitted on, DATA/heldout measured
    frames: int = 6000  # training rows sampled evenly
    cheat_episodes: int = 16  # episodes of cheat_frames added to the fit (0: none)
    out: str = str(DEFAULT_PATH)


def main(argv: list[str] | None = None) -> int:
    from .config import parse_args
    from .recording import RecordingError, open_dataset

    a = parse_args(Args, argv, __doc__)
    try:
        train, heldout = open_dataset(Path(a.fit) / "train"), open_dataset(Path(a.fit) / "heldout")
    except RecordingError as e:
        print(f"statusbar: {e}", file=sys.stderr)
        return 2
    extra = cheat_frames(a.cheat_episodes) if a.cheat_episodes > 0 else None
    reader = StatusBarReader.fit_recordings(train, a.frames, extra)
    print(f"statusbar: fitted on {a.frames} training rows + {0 if extra is None else len(extra[0])} cheat frames; "
          f"wrote {reader.save(a.out)}")
    got, want = [], []
    for r in heldout:
        if len(r):
            got.append(reader.read(r.frames))
            want.append(frame_values(r))
    if not got:
        print(f"statusbar: no held-out frames in {Path(a.fit) / 'heldout'} to measure", file=sys.stderr)
        return 1
    got, want = np.concatenate(got), np.concatenate(want)
    ok = (got[:, None] == want).any(1)
    strict = got == want[:, 0]
    print(f"held-out {len(got)} frames: all three right {ok.all(1).mean():.4%} "
          f"(ammo {ok[:, 0].mean():.4%}, health {ok[:, 1].mean():.4%}, armor {ok[:, 2].mean():.4%}); "
          f"against row t - 1 only: {strict.all(1).mean():.4%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
