"""The benchmark helpers check what they claim: a page-cache drop is verified with mincore, and a
missing DeepSpeed baseline is reported with how to get it (issue 16)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import _common  # noqa: E402


def _cached_file(path: str, nbytes: int = 4 << 20) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    with open(path, "rb") as f:
        f.read()  # buffered: now in the page cache


def test_resident_fraction_sees_the_page_cache(tmp_path):
    p = str(tmp_path / "f.bin")
    _cached_file(p)
    assert _common.resident_fraction(p) > 0.9
    assert _common.resident_fraction(p, offset=1 << 20, nbytes=1 << 20) > 0.9


def test_failed_drop_is_reported_not_assumed(tmp_path, monkeypatch):
    p = str(tmp_path / "f.bin")
    _cached_file(p)
    monkeypatch.setattr(_common, "drop_caches", lambda: True)  # "worked", but nothing was dropped
    assert _common.drop_caches_verified(p) is False
    monkeypatch.setattr(_common, "drop_caches", lambda: False)  # refused (not root)
    assert _common.drop_caches_verified(p) is False


@pytest.mark.skipif(
    os.geteuid() != 0, reason="dropping the page cache needs root: run as root to check the real drop"
)
def test_real_drop_is_verified(tmp_path):
    p = str(tmp_path / "f.bin")
    _cached_file(p)
    assert _common.drop_caches_verified(p) is True
    assert _common.resident_fraction(p) <= 0.01


def test_missing_deepspeed_venv_says_how_to_build_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DSIO_DEEPSPEED_PYTHON", raising=False)
    monkeypatch.setenv("DSIO_DEEPSPEED_VENV", str(tmp_path / "nope"))
    assert _common.deepspeed_python() is None
    err = capsys.readouterr().err
    assert "setup_deepspeed.sh" in err and str(tmp_path / "nope") in err
    monkeypatch.delenv("DSIO_DEEPSPEED_VENV")
    assert _common.deepspeed_venv() == os.path.join(_common.ROOT, ".venv-deepspeed")
    monkeypatch.setenv("DSIO_BENCH_DIR", str(tmp_path))
    assert _common.scratch_dir() == str(tmp_path)


def test_peak_rss_is_read_and_reset():
    # one fresh process (a small baseline): 256 MiB written then freed stays in the peak until
    # reset_peak, and rss_now reads what rss does (the drivers' peak-RSS figures rest on these)
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(_common.ROOT)!r})\n"
        "from bench._common import reset_peak, rss, rss_now\n"
        "now, peak = rss()\n"
        "assert 0 < now <= peak and abs(rss_now() - now) < 16 << 20, (now, peak, rss_now())\n"
        "x = b'\\x01' * (256 << 20)\n"
        "del x\n"
        "now, peak = rss()\n"
        "assert peak - now > 200 << 20, (now, peak)\n"
        "if not reset_peak():\n"
        "    print('no reset')\n"
        "    sys.exit()\n"
        "now, peak = rss()\n"
        "assert peak - now < 64 << 20, (now, peak)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() == "no reset":
        pytest.skip("this kernel cannot reset VmHWM (/proc/self/clear_refs)")
    assert r.stdout.strip() == "ok"
