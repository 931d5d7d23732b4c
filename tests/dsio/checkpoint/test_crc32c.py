"""crc32c paths: the AVX-512 + VPCLMULQDQ path (dsio's native core) and the portable one (the
``crc32c`` package) give ``crc32c.crc32c(data, value)``'s values for every length, start alignment
and running value; the process picks the AVX-512 path exactly where the CPU has it (read from
/proc/cpuinfo, so an AVX2-only machine checks the fallback), ``DSIO_CRC32C=portable`` forces the
package, checkpoint saves and loads checksum through the chosen path, and every path releases the GIL
over a large span (another Python thread runs meanwhile)."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import _forkserver
import crc32c
import numpy as np
import pytest
import torch

import dsio
from dsio.checkpoint import _integrity
from dsio.checkpoint._integrity import CRC32C_ENV, crc_continue, crc_of, crc_path, crc_paths

#: What the AVX-512 path needs, as /proc/cpuinfo spells it.
FAST_FLAGS = ("avx512f", "avx512bw", "avx512vl", "vpclmulqdq", "pclmulqdq", "sse4_2")
PATHS = ("portable", "avx512", "sse42")
MiB = 1 << 20


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _native_built() -> bool:
    try:
        import dsio._C  # noqa: F401
    except ImportError:
        return False
    return True


def _path(name: str):
    paths = crc_paths()
    if name not in paths:
        pytest.skip(f"the {name} path does not run here (the CPU lacks its instructions, or no native core)")
    return paths[name]


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    """8 MiB + 128 random bytes (128: room to reach a 64-byte boundary, then every start alignment)."""
    return np.random.default_rng(31).integers(0, 256, 8 * MiB + 128, dtype=np.uint8)


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _aligned_view(data: np.ndarray, align: int, n: int) -> np.ndarray:
    """``n`` bytes of ``data`` starting ``align`` bytes past a 64-byte boundary."""
    base = (-_ptr(data)) % 64
    out = data[base + align : base + align + n]
    assert out.nbytes == n
    return out


@pytest.mark.parametrize("name", PATHS)
def test_every_length_to_1024(name: str, data: np.ndarray) -> None:
    fn = _path(name)
    rng = random.Random(1)
    for n in range(1025):
        a = _aligned_view(data, n % 64, n)
        value = rng.getrandbits(32)
        assert fn(_ptr(a), n, value) == crc32c.crc32c(a.tobytes(), value), n


@pytest.mark.parametrize("name", PATHS)
def test_every_start_alignment(name: str, data: np.ndarray) -> None:
    """Each start 0..63 bytes past a 64-byte boundary, over lengths that end at every phase of the
    256-byte fold loop, the 64- and 16-byte ones and the tail."""
    fn = _path(name)
    for align in range(64):
        for n in (255, 256, 511, 512, 513, 575, 600, 767, 1000, 4096 + 17, 65_536 + 255):
            a = _aligned_view(data, align, n)
            assert fn(_ptr(a), n, 0) == crc32c.crc32c(a.tobytes()), (align, n)


@pytest.mark.parametrize("name", PATHS)
def test_random_lengths_to_8mib(name: str, data: np.ndarray) -> None:
    fn = _path(name)
    rng = random.Random(2)
    lengths = [8 * MiB, 8 * MiB - 1, MiB, MiB + 15] + [rng.randrange(8 * MiB) for _ in range(12)]
    for n in lengths:
        a = _aligned_view(data, rng.randrange(64), n)
        value = rng.getrandbits(32)
        assert fn(_ptr(a), n, value) == crc32c.crc32c(a.tobytes(), value), n


@pytest.mark.parametrize("name", PATHS)
def test_extending_a_running_value(name: str, data: np.ndarray) -> None:
    """crc32c over a split span, the second part continuing the first's result, is the whole
    span's, at split points inside and at the edges of every loop of the fast path."""
    fn = _path(name)
    n = 3 * 4096 + 123
    a = _aligned_view(data, 5, n)
    whole = crc32c.crc32c(a.tobytes())
    for k in (0, 1, 3, 4, 15, 16, 255, 256, 511, 512, 513, 1000, 4096, n - 513, n - 512, n - 1, n):
        head = fn(_ptr(a), k, 0)
        assert fn(_ptr(a) + k, n - k, head) == whole, k
    # three pieces, from a value that is not 0
    v = crc32c.crc32c(b"prefix")
    got = fn(_ptr(a) + 700, n - 700, fn(_ptr(a) + 7, 693, fn(_ptr(a), 7, v)))
    assert got == crc32c.crc32c(a.tobytes(), v)


def test_paths_agree_with_each_other_on_big_spans(data: np.ndarray) -> None:
    """The chosen path (crc_of / crc_continue) against the package on the whole 8 MiB span."""
    assert crc_path() in crc_paths()
    assert crc_of(_ptr(data), data.nbytes) == crc32c.crc32c(data.tobytes())
    assert crc_continue(_ptr(data), data.nbytes, 0xDEADBEEF) == crc32c.crc32c(data.tobytes(), 0xDEADBEEF)
    assert crc_of(0, 0) == 0 and crc_continue(0, 0, 1234) == 1234


def test_fast_path_exactly_where_the_cpu_has_it() -> None:
    """``avx512`` runs (and ``auto`` picks it) iff /proc/cpuinfo lists every flag it needs and the
    native core is built; otherwise the package's path: an AVX2-only machine runs the fallback.
    ``sse42`` (the engine copier's kernel without AVX-512) runs iff the CPU lists sse4_2."""
    expected = _native_built() and set(FAST_FLAGS) <= _cpu_flags()
    assert ("avx512" in crc_paths()) == expected
    assert ("sse42" in crc_paths()) == (_native_built() and "sse4_2" in _cpu_flags())
    assert "portable" in crc_paths()
    if os.environ.get(CRC32C_ENV, "auto") == "auto":
        assert crc_path() == ("avx512" if expected else "portable")


def _first_use(code: str, args: list[str]) -> None:
    """``python -c CODE ARGS`` in a process forked from the fork server, where dsio is imported but no
    crc32c path chosen yet: the child's first checksum reads `CRC32C_ENV`, as a new interpreter's does."""
    if _integrity._chosen is not None:
        sys.exit(f"the crc32c path was chosen before the child ran: {_integrity._chosen[0]}")
    _forkserver.code(code, args)


def _child(code: str, mode: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh process (forked: tests/_forkserver.py, no new interpreter's ~2 CPU-s of
    imports) with `CRC32C_ENV` set to ``mode`` (None: unset)."""
    env = dict(os.environ)
    env.pop(CRC32C_ENV, None)
    if mode is not None:
        env[CRC32C_ENV] = mode
    cmd = [sys.executable, "-c", code, *args]
    return _forkserver.run(functools.partial(_first_use, code, list(args)), cmd, env=env, timeout=300)


def test_unknown_env_value_is_a_config_error() -> None:
    code = (
        "from dsio.errors import ConfigError\n"
        "from dsio.checkpoint._integrity import crc_of\n"
        "try:\n    crc_of(0, 0)\nexcept ConfigError as e:\n    print('ConfigError', e.field)\n"
    )
    r = _child(code, "avx2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ConfigError", CRC32C_ENV]


SAVE_LOAD_CORRUPT = """
import asyncio, os, sys
import torch
import dsio.checkpoint as C
from dsio.errors import ChecksumError
from dsio.checkpoint._integrity import crc_path

async def main(path):
    state = {"big": torch.arange(3 << 18, dtype=torch.float32), "small": torch.arange(10)}
    await C.save(state, path)
    back = await C.load(path)
    assert torch.equal(back["big"], state["big"]) and torch.equal(back["small"], state["small"])
    with open(path, "r+b") as f:  # flip a bit near the end of the data: inside "big" or "small"
        f.seek(os.path.getsize(path) - 4096)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    try:
        await C.load(path)
    except ChecksumError:
        print(crc_path(), "detected")

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("mode", [None, "portable"])
def test_env_var_picks_the_path_that_saves_loads_and_detects_corruption(mode: str | None, tmp_path) -> None:
    """Unset (``auto``): the AVX-512 path where the CPU has it; ``portable``: the package. Either
    way a checkpoint saves, loads back equal, and a flipped bit is a ChecksumError."""
    pytest.importorskip("dsio._C", reason="dsio's native core is not built here")
    r = _child(SAVE_LOAD_CORRUPT, mode, str(tmp_path / "m.safetensors"))
    assert r.returncode == 0, r.stderr
    fast = _native_built() and set(FAST_FLAGS) <= _cpu_flags()
    assert r.stdout.split() == ["avx512" if fast and mode is None else "portable", "detected"]


def test_checkpoint_save_and_load_checksum_through_the_chosen_path(tmp_path, monkeypatch) -> None:
    """Every checksum of a save and of a verified load goes through `crc_of` / `crc_continue` /
    `copy_crc`'s dispatch (a call straight to the package would skip the fast path): count the
    calls. A load's
    checksums the engine computed as the bytes landed (`dsio._sums`, its own native kernels) are
    counted from the handle's statistics."""
    pytest.importorskip("dsio._C", reason="dsio's native core is not built here")
    import dsio.checkpoint as C

    name, fn, copy_fn = _integrity._choose()
    calls = {"bytes": 0}

    def counting(ptr: int, nbytes: int, value: int) -> int:
        calls["bytes"] += nbytes
        return fn(ptr, nbytes, value)

    def counting_copy(dst: int, src: int, nbytes: int) -> int:  # a save's staging: copy + crc32c
        calls["bytes"] += nbytes
        return copy_fn(dst, src, nbytes)

    monkeypatch.setattr(_integrity, "_chosen", (name, counting, counting_copy))
    state = {"big": torch.randn(3 << 18), "small": torch.arange(10)}
    data_bytes = sum(t.numel() * t.element_size() for t in state.values())
    path = str(tmp_path / "m.safetensors")
    asyncio.run(C.save(state, path))
    assert calls["bytes"] >= data_bytes  # the save checksummed every byte through the dispatch
    calls["bytes"] = 0

    async def load() -> tuple[dict, int]:
        async with dsio.AsyncIOHandle(C.DEFAULT_IO) as h:
            back = await C.load(path, handle=h)
            return back, h.statistics().engine.checksummed_bytes

    back, by_engine = asyncio.run(load())
    assert torch.equal(back["big"], state["big"])
    assert calls["bytes"] + by_engine >= data_bytes  # and so did the load


def _ticks_while(call: Callable[[], object], *, calls: int, seconds: float) -> tuple[int, int]:
    """How often another Python thread ran while ``call()`` ran in this one: ``(ticks, calls made)``.
    The calls repeat until that thread ticked during one of them, ``calls`` calls were made (at
    least one) and ``seconds`` passed; at most ``seconds`` plus one call, whichever comes first.

    With no forced switches (``sys.setswitchinterval`` far above the run) and the collector off, this
    thread holds the GIL from setting ``in_call`` to clearing it unless ``call()`` releases it; the
    ticker releases it at every sleep. So a tick counted during a call is proof of a release, and a
    call that holds the GIL counts exactly 0 however loaded the machine; a loaded machine only
    delays the ticker's first tick, which the repeats absorb."""
    state = {"in_call": False, "ticks": 0}
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            if state["in_call"]:
                state["ticks"] += 1
            time.sleep(0.0002)  # the GIL is released here, so the caller never waits on this thread

    old, collecting = sys.getswitchinterval(), gc.isenabled()
    thread = threading.Thread(target=ticker, name="crc-gil-ticker", daemon=True)
    made = 0
    sys.setswitchinterval(1000.0)
    gc.disable()
    try:
        thread.start()
        end = time.monotonic() + seconds
        while made < 1 or (state["ticks"] == 0 and made < calls and time.monotonic() < end):
            state["in_call"] = True
            call()
            state["in_call"] = False
            made += 1
            time.sleep(0.0005)  # the process's other threads run between calls (outside the window)
    finally:
        state["in_call"] = False
        stop.set()
        sys.setswitchinterval(old)
        if collecting:
            gc.enable()
        thread.join()
    return state["ticks"], made


@pytest.fixture(scope="module")
def big() -> np.ndarray:
    """64 MiB: a few ms of crc32c on any path."""
    return np.random.default_rng(5).integers(0, 256, 64 * MiB, dtype=np.uint8)


def test_the_gil_probe_sees_a_call_that_holds_the_gil(big: np.ndarray) -> None:
    """The probe's control: the package asked to keep the GIL (``gil_release_mode=0``) over the same
    span lets no other thread run during any of 20 calls."""
    view = memoryview(big)
    assert crc32c.crc32c(view, 0, gil_release_mode=0) == crc32c.crc32c(view)
    ticks, made = _ticks_while(lambda: crc32c.crc32c(view, 0, gil_release_mode=0), calls=20, seconds=60)
    assert (ticks, made) == (0, 20)


@pytest.mark.parametrize("name", [*PATHS, "chosen"])
def test_every_path_releases_the_gil_over_a_large_span(name: str, big: np.ndarray) -> None:
    """A checkpoint's checksums run on the copier threads beside training and the event loop: over
    a large span each path (AVX-512 where this CPU has it, else skipped; the package's; and the one
    `crc_of` dispatches to) lets another Python thread run while it computes."""
    path = None if name == "chosen" else _path(name)
    ptr, n = _ptr(big), big.nbytes

    def call() -> int:
        return crc_of(ptr, n) if path is None else path(ptr, n, 0)

    assert call() == crc32c.crc32c(memoryview(big))
    ticks, made = _ticks_while(call, calls=10**6, seconds=60)
    assert ticks > 0, f"no other thread ran during {made} calls of {n} bytes"


@pytest.mark.parametrize("fused", [True, False], ids=["native_fused", "copy_then_crc"])
def test_copy_crc_copies_exactly_and_returns_the_bytes_crc32c(fused: bool, data: np.ndarray) -> None:
    """A staging copy's one pass (`copy_crc`: the native copy_crc32c on the avx512 path, else memcpy
    then the path's crc32c): at every length around its 64 KiB steps and the streaming stores'
    32-byte alignment, from and to odd addresses, the destination holds the source's bytes and the
    result is their crc32c."""
    pytest.importorskip("dsio._C", reason="dsio's native core is not built here")
    from dsio._native import native

    if fused and not native().crc32c_hw_supported():
        pytest.skip("no crc32c instruction here: the fused kernel does not run")
    fn = _integrity._copy_crc_fused if fused else _integrity._copy_then_crc(_integrity._crc_portable)
    out = np.zeros(2 * MiB + 256, dtype=np.uint8)
    rng = random.Random(4)
    for n in (0, 1, 31, 32, 4095, 4096, 4097, 65_535, 65_536, 65_537, 3 * 65_536 + 5, MiB + 3, 2 * MiB):
        s, d = rng.randrange(64), rng.randrange(64)
        src = data[s : s + n]
        out[:] = 0
        got = fn(_ptr(out) + d, _ptr(src), n)
        assert got == crc32c.crc32c(src.tobytes()), n
        assert out[d : d + n].tobytes() == src.tobytes(), n
        assert not out[:d].any() and not out[d + n :].any(), n  # nothing written outside
