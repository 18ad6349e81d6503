"""numba_rope in hostile processes, each test in a subprocess of its own: a read-only
install with no writable cache location."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_rope

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "numba_rope"

#: Seconds a whole subprocess may take (cold compilation included).
SUBPROCESS_TIMEOUT = 300


def _run(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code``, whose ``sys.argv[1]`` is the directory numba_rope must come from."""
    result = subprocess.run(
        [sys.executable, "-c", code, env["PYTHONPATH"]],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        env=env,
        cwd=cwd,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _env(pythonpath: Path, **changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(pythonpath)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


# -- read-only install ---------------------------------------------------------------------

READ_ONLY_SCRIPT = """
import hashlib, sys
import numpy as np
import numba_rope
from numba_rope import config

assert numba_rope.__file__.startswith(sys.argv[1]), numba_rope.__file__
x = np.random.default_rng(3).standard_normal((1, 4, 64, 8), dtype=np.float32)
cos, sin = numba_rope.rope_cache(64, 8, dtype=np.float32)
ids = np.arange(64)[None]
small = numba_rope.rotary_embedding(x, cos, sin, ids)
config.PARALLEL_MIN_ELEMENTS = 0
large = numba_rope.rotary_embedding(x, cos, sin, ids)
print(hashlib.sha256(small.tobytes() + cos.tobytes() + sin.tobytes()).hexdigest())
print(hashlib.sha256(large.tobytes()).hexdigest())
"""


def _expected_digests() -> list[str]:
    x = np.random.default_rng(3).standard_normal((1, 4, 64, 8), dtype=np.float32)
    cos, sin = numba_rope.rope_cache(64, 8, dtype=np.float32)
    out = numba_rope.rotary_embedding(x, cos, sin, np.arange(64)[None])
    return [
        hashlib.sha256(out.tobytes() + cos.tobytes() + sin.tobytes()).hexdigest(),
        hashlib.sha256(out.tobytes()).hexdigest(),
    ]


@pytest.fixture
def read_only_install(tmp_path):
    """A copy of the package where numba finds no cache location, even as root: every
    ``__pycache__`` is a file (no directory can be made there), and the home and cache
    directories lie under a file. Returns the environment of a process using it."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "numba_rope", ignore=shutil.ignore_patterns("__pycache__"))
    for init in (site / "numba_rope").rglob("__init__.py"):
        (init.parent / "__pycache__").write_text("")
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    env = _env(
        site,
        HOME=str(blocked / "home"),
        XDG_CACHE_HOME=str(blocked / "cache"),
        NUMBA_CACHE_DIR=str(blocked / "numba"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def test_read_only_install_imports_and_computes_the_same_bits(read_only_install, tmp_path):
    """With no writable cache location (an unusable ``NUMBA_CACHE_DIR`` too), import
    used to fail with "cannot cache function 'rotate_pair': no locator available"; the
    package now compiles in memory, to the same bits."""
    env = read_only_install
    result = _run(READ_ONLY_SCRIPT, env, tmp_path)
    assert result.stdout.split() == _expected_digests()


def test_read_only_install_still_caches_in_numba_cache_dir(read_only_install, tmp_path):
    """numba's own ``NUMBA_CACHE_DIR`` is still where compiled code goes when usable."""
    env = read_only_install
    cache = tmp_path / "numba-cache"
    _run(READ_ONLY_SCRIPT, env | {"NUMBA_CACHE_DIR": str(cache)}, tmp_path)
    cached = {path.name.split(".")[0] for path in cache.rglob("*.nbi")}
    assert {"_sincos", "_rotation", "kernels"} <= cached, sorted(cached)
