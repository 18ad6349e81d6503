"""Every script in examples/ runs and checks itself; GPU ones skip cleanly without a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CPU_EXAMPLES = ["seed_example.py", "llama_decode_step.py", "half_precision.py"]
GPU_EXAMPLES = ["gpu_cupy.py", "gpu_torch.py"]


def gpu_present() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()


def run_example(name: str) -> subprocess.CompletedProcess:
    # This checkout first on the path; the CUDA simulator is not a GPU.
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def test_every_example_is_tested_and_listed_in_the_readme():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(CPU_EXAMPLES + GPU_EXAMPLES)
    readme = (ROOT / "README.md").read_text()
    for name in CPU_EXAMPLES + GPU_EXAMPLES:
        assert f"examples/{name}" in readme, name


@pytest.mark.parametrize("name", CPU_EXAMPLES)
def test_cpu_example_runs_and_checks_itself(name):
    result = run_example(name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r": ok$", result.stdout, re.M), result.stdout


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_example_runs_or_skips_cleanly(name):
    result = run_example(name)
    assert result.returncode == 0, result.stdout + result.stderr
    if not gpu_present():
        # "skipping: " and why: no GPU, or the library (CuPy, torch) not installed.
        assert result.stdout.startswith(("no GPU, skipping: ", "skipping: ")), result.stdout
        assert result.stderr == ""
    else:  # pragma: no cover - CI has no GPU
        assert "no GPU" in result.stdout or re.search(r": ok$", result.stdout, re.M)
