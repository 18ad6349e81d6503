import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture
def parallel_always(monkeypatch):
    """Make every input take the parallel kernel, however small."""
    from numba_rope import config

    monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)
