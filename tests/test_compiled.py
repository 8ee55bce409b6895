"""The compiled (AOTInductor) path and the two-core engine, on the tiny checkpoint.

The package is built once per session by two players starting at once (the lock makes one wait for the
other's build); every test then copies or reuses that cache. CPU only; a real compiler (g++) is needed.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from neuraldoom import actions as A
from neuraldoom import sampler as S
from neuraldoom.checkpoint import Checkpoint
from neuraldoom.config import DenoiserConfig
from neuraldoom.denoiser import build_denoiser
from neuraldoom.engine import NeuralEngine
from tests.conftest import TINY_DENOISER

ACTIONS = [A.Action.of("MOVE_FORWARD"), A.Action.of("ATTACK", turn=4.0), A.NOOP, A.Action.of("USE"),
           A.Action.of("MOVE_LEFT", turn=-8.0), A.Action.of("MOVE_RIGHT")]


def play(eng: NeuralEngine, seed: int = 3) -> tuple[list[np.ndarray], torch.Tensor]:
    """The frames of ACTIONS from `seed`, and the latents sampled on the way."""
    eng.reset(seed)
    frames, zs = [], []
    for a in ACTIONS:
        frames.append(eng.step(a))
        zs.append(eng.z[-1].clone())
    return frames, torch.stack(zs)


def wait_for(builders, timeout: float = 240.0) -> None:
    end = time.monotonic() + timeout
    for b in builders:
        b.wait(timeout=max(1.0, end - time.monotonic()))


@pytest.fixture(scope="session")
def compiled(tiny_checkpoint, tmp_path_factory):
    """Two players start at once on an empty cache: both start a background build; the second builder
    waits on the lock and reuses the first one's package. Yields the cache and what the builds said."""
    cache = tmp_path_factory.mktemp("neuraldoom-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEURALDOOM_CACHE", str(cache))
        ck = Checkpoint(tiny_checkpoint)
        players = [NeuralEngine(ck, compile=True, dtype="float32", cores=1) for _ in range(2)]
        builders = [p._builder for p in players]
        assert all(b is not None for b in builders) and not any(p.compiled for p in players)
        t0 = time.monotonic()
        wait_for(builders)
        seconds = time.monotonic() - t0
        for p in players:
            p.step(A.NOOP)  # picks the finished build up
        path = S.package_path(tiny_checkpoint, torch.float32)
        yield SimpleNamespace(cache=cache, path=path, players=players, codes=[b.returncode for b in builders],
                              log=(S.cache_dir() / "build.log").read_text(), seconds=seconds)
        for p in players:
            p.close()


def use_cache(monkeypatch, tmp_path, compiled, copy: bool = True):
    """A private cache for one test, holding a copy of the session's package (or nothing)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("NEURALDOOM_CACHE", str(cache))
    if copy:
        S.cache_dir().mkdir(parents=True)
        shutil.copy(compiled.path, S.cache_dir() / compiled.path.name)
    return S.cache_dir() / compiled.path.name


@pytest.mark.slow
def test_two_players_starting_at_once_compile_once(compiled):
    assert compiled.codes == [0, 0], compiled.log
    assert compiled.log.count("compiled the sampler") == 1, compiled.log
    assert compiled.log.count("was built by another player") == 1, compiled.log
    assert all(p.compiled for p in compiled.players)  # both swapped the one package in
    assert sorted(x.name for x in compiled.path.parent.glob("*.pt2")) == [compiled.path.name]  # no leftovers


@pytest.mark.slow
def test_compiled_matches_eager_over_autoregressive_steps(compiled, tiny_checkpoint, monkeypatch, tmp_path):
    path = use_cache(monkeypatch, tmp_path, compiled)
    ck = Checkpoint(tiny_checkpoint)
    fast = NeuralEngine(ck, compile=True, dtype="float32", cores=1)
    assert fast.compiled and fast._builder is None and path.exists()  # loaded from the cache, nothing built
    eager = NeuralEngine(ck, compile=False, dtype="float32", cores=1)
    f_frames, f_z = play(fast)
    e_frames, e_z = play(eager)
    gaps = (f_z - e_z).abs().flatten(1).max(1).values
    assert (gaps < 1e-3).all(), gaps  # each step feeds the next: the errors would compound
    assert all(np.abs(a.astype(int) - b.astype(int)).max() <= 2 for a, b in zip(f_frames, e_frames, strict=True))
    # two cores run the compiled unconditional passes on a second thread: the very same numbers
    two = NeuralEngine(ck, compile=True, dtype="float32", cores=2)
    assert two.compiled and two.split
    t_frames, t_z = play(two)
    assert torch.equal(t_z, f_z) and all(np.array_equal(a, b) for a, b in zip(t_frames, f_frames, strict=True))
    two.close()


@pytest.mark.slow
def test_a_corrupt_cache_entry_falls_back_to_eager_and_is_rebuilt(compiled, tiny_checkpoint, monkeypatch,
                                                                  tmp_path, capsys):
    path = use_cache(monkeypatch, tmp_path, compiled)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])  # a truncated package
    ck = Checkpoint(tiny_checkpoint)
    eng = NeuralEngine(ck, compile=True, dtype="float32", cores=1)
    assert not eng.compiled and eng._builder is not None  # eager at once, rebuilding over it
    assert "cannot use the compiled sampler" in capsys.readouterr().err
    eng.step(A.NOOP)
    wait_for([eng._builder])
    assert eng._builder.returncode == 0
    eng.step(A.NOOP)
    assert eng.compiled
    assert "compiled the sampler" in (S.cache_dir() / "build.log").read_text()
    eng.close()
    # the rebuilt package loads as is next time
    assert NeuralEngine(ck, compile=True, dtype="float32", cores=1).compiled


def test_a_package_giving_other_numbers_is_not_used(compiled, monkeypatch, tmp_path, capsys):
    """A stale entry (it loads, but computes another model): refused by the check against eager."""
    path = use_cache(monkeypatch, tmp_path, compiled)
    torch.manual_seed(1)
    other = S.DenoiserPass(build_denoiser(DenoiserConfig(**TINY_DENOISER), 4, (16, 20)).eval())
    assert S.load_package(path, other, S.example_inputs(other.denoiser, (4, 16, 20))) is None
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "differs from the eager model" in err


def test_a_failed_build_stays_eager_with_one_line(tiny_checkpoint, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NEURALDOOM_CACHE", str(tmp_path / "cache"))

    def broken(*args, **kw):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore details")

    monkeypatch.setattr(S, "build_package", broken)
    eng = NeuralEngine(Checkpoint(tiny_checkpoint), compile=True, wait_compile=True, dtype="float32")
    err = capsys.readouterr().err.strip()
    assert not eng.compiled and err.count("\n") == 0 and "compiling the sampler failed" in err
    assert eng.step(A.NOOP).shape == (120, 160, 3)
    eng.close()


@pytest.mark.slow
def test_a_background_build_without_a_compiler_stays_eager_with_one_line(tiny_checkpoint, monkeypatch, tmp_path,
                                                                          capsys):
    monkeypatch.setenv("NEURALDOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no kernels from earlier builds
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    eng = NeuralEngine(Checkpoint(tiny_checkpoint), compile=True, dtype="float32", cores=1)
    wait_for([eng._builder])
    capsys.readouterr()
    eng.step(A.NOOP)
    err = capsys.readouterr().err.strip()
    assert eng._builder.returncode != 0 and not eng.compiled
    assert err.count("\n") == 0 and "compiling the sampler failed; staying eager" in err
    eng.step(A.NOOP)
    assert capsys.readouterr().err == ""  # said once
    assert not list(S.cache_dir().glob("*.pt2"))
    assert "InvalidCxxCompiler" in (S.cache_dir() / "build.log").read_text()  # why, in the log, not over the game
    eng.close()


def test_the_build_lock_lets_one_of_two_builders_compile(tmp_path, monkeypatch):
    """ensure_package under flock: the second caller waits, finds the package and builds nothing."""
    import threading

    built = []

    def fake_build(module, example, path):
        built.append(threading.get_ident())
        time.sleep(0.5)
        path.write_bytes(b"package")

    monkeypatch.setattr(S, "build_package", fake_build)
    path = tmp_path / "pass-x.pt2"
    results = []
    threads = [threading.Thread(target=lambda: results.append(S.ensure_package(None, (), path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and sorted(results) == [False, True]
    # a broken entry is rebuilt over only while it is the one seen broken
    assert S.ensure_package(None, (), path, replace=S.signature(path)) and len(built) == 2
    assert not S.ensure_package(None, (), path, replace="another-version")


# -- two cores: the same numbers as one ---------------------------------------------------------------
def test_two_cores_give_the_same_frames_as_one(tiny_checkpoint):
    ck = Checkpoint(tiny_checkpoint)
    one = NeuralEngine(ck, compile=False, cores=1)
    assert one._pool is None and not one.split
    frames, z = play(one)
    two = NeuralEngine(ck, compile=False, cores=2)
    assert two.split and not two.pipeline and torch.get_num_threads() == 1
    f2, z2 = play(two)
    assert torch.equal(z2, z) and all(np.array_equal(a, b) for a, b in zip(f2, frames, strict=True))
    # decoding on the second core: the same frames, each one step late (the first step shows the reset frame)
    for parallel in ("decode", "both"):
        late = NeuralEngine(ck, compile=False, cores=2, parallel=parallel)
        first = late.reset(3).copy()
        f3, z3 = play(late)
        assert torch.equal(z3, z) and np.array_equal(f3[0], first)
        assert all(np.array_equal(a, b) for a, b in zip(f3[1:], frames[:-1], strict=True))
        with pytest.raises(A.ActionError):
            late.step("forward")
        late.close()
    # no guidance: nothing to split, one stream
    flat = NeuralEngine(ck, compile=False, cores=2, guidance=1.0)
    assert flat._pool is None
    two.close()


def test_two_cores_keep_delta_targets_and_frames_read():
    """The split sampler with a "delta" denoiser and one that reads only the newest frames."""
    from neuraldoom.denoiser import Denoiser

    torch.manual_seed(0)
    base = DenoiserConfig(**TINY_DENOISER)
    reads = build_denoiser(replace(base, reads=2), 4, (16, 20)).eval()
    frame = build_denoiser(base, 4, (16, 20)).eval()
    delta = Denoiser(frame.unet, frame.action_encoder, replace(base, target="delta", delta_scale=0.5)).eval()
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 16, 20, generator=g), torch.randn(1, 4, 4, 16, 20, generator=g)
    codes = torch.randint(0, 4, (1, 5, 2), generator=g)
    from concurrent.futures import ThreadPoolExecutor

    from neuraldoom.engine import _worker_init

    with torch.no_grad(), ThreadPoolExecutor(1, initializer=_worker_init, initargs=(1,)) as pool:
        for d in (reads, delta):
            s = S.DDIMSampler(d, 4, 1.5)
            p = S.denoiser_pass(d)
            alone, split = s.sample(noise, ctx, codes, p), s.sample(noise, ctx, codes, p, pool)
            assert torch.equal(alone, split)
            torch.testing.assert_close(alone, s(noise, ctx, codes))
            torch.testing.assert_close(s.sample(noise, ctx, codes, p, batched=True), alone)  # one batch-2 call
        fs = S.DDIMSampler(frame, 4, 1.5)
        ds = S.DDIMSampler(delta, 4, 1.5)
        out = ds.sample(noise, ctx, codes, S.denoiser_pass(delta), pool)
        torch.testing.assert_close(out, ctx[:, -1] + 0.5 * fs(noise, ctx, codes))


def test_bench_never_reports_a_failed_compile_as_compiled(tiny_checkpoint, monkeypatch, tmp_path, capsys):
    from neuraldoom import bench

    monkeypatch.setenv("NEURALDOOM_CACHE", str(tmp_path / "cache"))
    calls = []

    def broken(*args, **kw):
        calls.append(1)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(S, "build_package", broken)
    assert bench.main(["--checkpoint", str(tiny_checkpoint), "--quick", "--frames", "1"]) == 0
    out, err = capsys.readouterr()
    rows = [x.split()[0] for x in out.splitlines()[2:] if x.split() and x.split()[0] in ("eager", "eager*", "compiled")]
    assert "compiled" not in rows and rows.count("eager*") == rows.count("eager") > 0
    assert len(calls) == 1 and err.count("compiling the sampler failed") == 1  # tried once, said once
    assert out.strip().splitlines()[-1].startswith("fps=")


def test_the_package_key_follows_what_the_pass_computes_with(tiny_checkpoint, tmp_path):
    """New sampler settings or notes keep a compiled package (no rebuild at the next play); another denoiser
    config, the part's weights or the action set each get their own."""
    import json

    def edited(name: str, edit) -> Path:
        d = tmp_path / name
        shutil.copytree(tiny_checkpoint, d)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    key = S.package_path(tiny_checkpoint, torch.float32, 1).name
    same = [edited("sampler", lambda c: c["sampler"].update(deadband=0.7, cfg=1.5)),
            edited("notes", lambda c: c["notes"].update(samples=123))]
    other = [edited("reads", lambda c: c["denoiser"].update(reads=c["denoiser"]["reads"] - 1)),
             edited("turns", lambda c: c.update(turn_buckets=c["turn_buckets"][:-1]))]
    assert [S.package_path(d, torch.float32, 1).name for d in same] == [key, key]
    assert all(S.package_path(d, torch.float32, 1).name != key for d in other)
    weights = edited("weights", lambda c: None) / "unet" / "diffusion_pytorch_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    assert S.package_path(weights.parent.parent, torch.float32, 1).name != key


@pytest.mark.slow
def test_a_status_bar_denoiser_is_compiled_after_the_frames_and_plays_as_eager(tiny_checkpoint, monkeypatch,
                                                                                tmp_path):
    from neuraldoom.checkpoint import save_checkpoint

    monkeypatch.setenv("NEURALDOOM_CACHE", str(tmp_path / "cache"))
    ck = Checkpoint(tiny_checkpoint)
    torch.manual_seed(1)
    bcfg = replace(ck.denoiser_cfg, rows=(28, 29, 32))
    with_bar = tmp_path / "with-bar"
    save_checkpoint(with_bar, ck.ae, ck.denoiser, ck.game, ck.denoiser_cfg, ck.sampler_cfg, ck.context_frames,
                    ck.context_actions, bar=(build_denoiser(bcfg, 4, (4, 40)), bcfg, {}))
    ck = Checkpoint(with_bar)
    eng = NeuralEngine(ck, compile=True, dtype="float32", cores=1)
    first = eng._builder  # the frame's package first: one build at a time beside play
    wait_for([first])
    eng.step(A.NOOP)  # swaps it in, then starts the bar's
    assert first.returncode == 0 and eng.compiled and eng._builder is not first
    wait_for([eng._builder])
    eng.step(A.NOOP)
    assert eng.bar_pass is not eng.bar_eager and eng._builder.returncode == 0
    assert S.package_path(with_bar, torch.float32, bar=True).exists()
    f_frames, f_z = play(eng)
    e_frames, e_z = play(NeuralEngine(ck, compile=False, dtype="float32", cores=1))
    assert (f_z - e_z).abs().max() < 1e-3  # the bar's rows too: its inputs are cut out of the ring contiguous
    eng.close()
