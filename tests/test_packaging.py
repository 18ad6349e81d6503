"""The README's promises about commands hold, and what a user of the package looks for
is there: the license, the changelog, the version, typed public functions."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_rope

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_exactly_the_readme_test_command():
    install_and_test = readme_commands()[1]
    test_command = install_and_test.split('pip install -e ".[test]" && ', 1)[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_demo_command_succeeds():
    demo = readme_commands()[0]
    assert demo.endswith("python -m numba_rope demo")
    result = subprocess.run(
        [sys.executable, "-m", "numba_rope", "demo", "--repeats", "20"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for dtype in ("float32", "float16", "bfloat16"):
        assert re.search(rf"^{dtype}\s.*\sok$", result.stdout, re.M), result.stdout


def test_readme_cpu_examples_run():
    """Each CPU example of the README runs as written (the GPU ones need a GPU)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    namespace: dict = {}
    ran = 0
    for block in blocks:
        if any(word in block for word in ("cupy", "torch", "from numba import cuda")):
            continue
        exec(compile(block, "README.md", "exec"), namespace)
        ran += 1
    assert ran >= 3


def test_ci_reruns_numerical_tests_without_numpy_simd():
    """After README's command, .ci/run runs the numerical tests again with the SIMD
    targets NumPy dispatches to switched off: the files exist, and the value it passes
    to NPY_DISABLE_CPU_FEATURES names only targets this CPU has (NumPy refuses others)."""
    ci = (ROOT / ".ci" / "run").read_text()
    step = ci.split("python .ci/numpy_features_off.py", 1)[1]
    files = re.findall(r"tests/\S+\.py", step)
    assert "tests/test_cache.py" in files and len(files) >= 4
    assert all((ROOT / name).is_file() for name in files), files
    printed = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "numpy_features_off.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    try:
        from numpy._core import _multiarray_umath as umath  # NumPy 2
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath as umath

    assert set(printed) <= set(umath.__cpu_dispatch__)
    assert all(umath.__cpu_features__[name] for name in printed)


def test_license_is_bsd_3_clause_and_packaged():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith(
        "BSD 3-Clause License\n\nCopyright (c) 2026, the numba_rope developers\n"
    )
    for clause in (
        "1. Redistributions of source code must retain",
        "2. Redistributions in binary form must reproduce",
        "3. Neither the name of the copyright holder nor the names of its",
        'THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"',
    ):
        assert clause in text
    project = pyproject()["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]  # into the sdist and the wheel


def test_changelog_has_unreleased_and_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert headings[0] == "Unreleased"
    assert re.search(
        rf"^## \[{re.escape(numba_rope.__version__)}\] - \d{{4}}-\d\d-\d\d$", text, re.M
    )


def test_version_command():
    result = subprocess.run(
        [sys.executable, "-m", "numba_rope", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"numba_rope {numba_rope.__version__}\n"


def test_the_version_is_written_once():
    """pyproject takes the version from ``numba_rope.__version__``, a literal that
    setuptools reads without importing the package."""
    config = pyproject()
    assert "version" not in config["project"]
    assert config["project"]["dynamic"] == ["version"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "numba_rope.__version__"}
    tree = ast.parse((ROOT / "numba_rope" / "__init__.py").read_text())
    literals = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(target, "id", None) for target in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert literals == [numba_rope.__version__]
    assert re.fullmatch(r"\d+\.\d+\.\d+", numba_rope.__version__)


def test_typing_check_is_checked_by_mypy():
    """tests/typing_check.py type-checks, each of its ``type: ignore`` comments on a real
    error (``warn_unused_ignores``): a list as ``input`` is an error for mypy."""
    api = pytest.importorskip("mypy.api")
    config = pyproject()["tool"]["mypy"]
    assert "tests/typing_check.py" in config["files"]
    assert {"module": ["typing_check"], "warn_unused_ignores": True} in config["overrides"]
    source = (ROOT / "tests" / "typing_check.py").read_text()
    assert "rotary_embedding([1.0, 2.0, 3.0, 4.0], cos, cos)  # type: ignore[type-var]" in source
    assert len(re.findall(r"  # type: ignore\[[a-z-]+\]$", source, re.M)) == 5
    stdout, stderr, status = api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "tests" / "typing_check.py")]
    )
    assert status == 0, stdout + stderr


def test_typing_check_good_calls_run():
    import typing_check

    typing_check.good_calls()
    cos, sin = numba_rope.rope_cache(8, 4)
    x = np.ones((1, 1, 2, 4), np.float32)
    y = typing_check.gpu_arrays_keep_their_type(x, cos, sin, 3)
    assert type(y) is np.ndarray and y.dtype == np.float32


def test_ci_tests_the_oldest_versions_the_package_allows():
    """The lower bounds of the dependencies are the versions .ci/run's last step installs
    (numba 0.60 brings LLVM 14, whose intrinsics differ from today's: AVX512_BF16's
    conversion once failed to compile there), and that step runs the kernels' tests."""
    ci = (ROOT / ".ci" / "run").read_text()
    step = ci.split("# The oldest versions pyproject.toml allows", 1)[1]
    bounds = dict(
        re.fullmatch(r"([\w-]+)>=([\d.]+)", requirement).groups()
        for requirement in pyproject()["project"]["dependencies"]
    )
    assert bounds == {"numba": "0.60", "numpy": "1.24", "ml_dtypes": "0.4"}
    assert '"numba==0.60.0"' in step and '"ml_dtypes==0.4.0"' in step
    assert "oldest_numpy=1.24.4" in step  # Python 3.11 and older
    files = re.findall(r"tests/\S+\.py", step)
    assert {"tests/test_rotary.py", "tests/test_targets.py"} <= set(files)
    assert all((ROOT / name).is_file() for name in files), files
