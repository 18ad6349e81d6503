import os
import shutil
import sys


def _has_nvidia_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


# The GPU tests run on a GPU when there is one, else in numba's CUDA simulator, which
# must be chosen before numba is first imported. A value the user set wins.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _has_nvidia_gpu():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if "numba" in sys.modules:  # pragma: no cover - imported early, e.g. by a plugin
        import numba.core.config

        numba.core.config.reload_config()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture
def parallel_always(monkeypatch):
    """Make every input take the parallel kernel, however small."""
    from numba_rope import config

    monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)


@pytest.fixture
def small_cuda_launches(monkeypatch):
    """Shrink the CUDA launch so that tiny inputs span several blocks, several head
    groups (one of them partial) and several turns of every grid-stride loop."""
    from numba_rope import config

    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 4)
    monkeypatch.setattr(config, "CUDA_HEADS_PER_THREAD", 2)
    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 2)
