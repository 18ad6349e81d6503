"""The cos/sin kernel of rope_cache (numba_rope/_sincos.py): correctly rounded against
decimal arithmetic, and the same bits on every machine."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from cache_oracles import KERNEL_EXCESS, exact_cos_sin

import numba_rope
from numba_rope import _sincos


def angles_to_test():
    rng = np.random.default_rng(5)
    half_pi_multiples = [float(k * math.pi / 2) for k in rng.integers(1, 2**24, 200)]
    return np.concatenate(
        [
            [0.0, 2.0**-1074, 1e-300, 2.0**-30, 0.5, 1.0, math.pi / 4, 1 / 128, 3 / 128],
            rng.uniform(0, 2 * math.pi, 300),
            rng.uniform(0, 2e5, 300),
            np.exp(rng.uniform(math.log(1e-8), math.log(2.0**26), 300)),
            half_pi_multiples,  # the largest cancellation in the reduction
            np.nextafter(half_pi_multiples, 0.0),
            np.arange(1, 60) / 64 + 1 / 128,  # table boundaries
            [2.0**26, np.nextafter(2.0**26, 0.0), 1e10, 2.0**70 / 3, 1e300],  # exact path
        ]
    )


def test_correctly_rounded():
    """Bit for bit the correctly rounded cos and sin, except where the exact value lies
    within KERNEL_EXCESS ulp of a midpoint (the kernel's bound beyond half an ulp)."""
    angles = angles_to_test()
    cos, sin = _sincos.cos_sin(2, angles)  # row 1 holds 1 * angle = angle
    for angle, got_cos, got_sin in zip(angles, cos[1], sin[1], strict=True):
        for got, exact in zip((got_cos, got_sin), exact_cos_sin(float(angle)), strict=True):
            nearest = float(exact)
            if got != nearest:
                error = abs(float(exact - type(exact)(float(got)))) / math.ulp(nearest)
                assert error <= 0.5 + KERNEL_EXCESS, (angle, got, nearest)


def test_infinite_angle_gives_nan():
    cos, sin = numba_rope.rope_cache(
        3, 4, scaling={"rope_type": "linear", "factor": 1e-308}, dtype=np.float64
    )
    assert np.isnan(cos[2, 0]) and np.isnan(sin[2, 0])
    assert np.isfinite(cos[:2]).all() and np.isfinite(cos[:, 1]).all()


# sha256 of the float64 cos then sin caches: the same on every machine (x86 with or
# without AVX-512, aarch64, any OS), since every step is float64 + - * / or decimal
# arithmetic. A change to these digests is a change of rope_cache's values.
GOLDEN = {
    "default": (
        4096,
        128,
        10000.0,
        None,
        "b2c1d4e8a996d00c71ccbb07e0928869c937291e9c3653f501ffb829d5498334",
    ),
    "llama3": (
        4096,
        128,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "4c418edbc75c465899364abb537b239df99e3bef3538bf704db3462e5f15d868",
    ),
    "yarn": (
        4096,
        128,
        1000000.0,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        "498f1b9d8d98557357e6e8573b9f6a0fc5007eca19e1015b0362b2327cd9b8bc",
    ),
    "dynamic": (
        4096,
        64,
        10000.0,
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2048},
        "294cebe8c895f90efaa3a3bcb1028377a30615e57a56f164e838e6173a192f18",
    ),
}


def digest(max_position, rotary_dim, base, scaling):
    cos, sin = numba_rope.rope_cache(
        max_position, rotary_dim, base=base, scaling=scaling, dtype=np.float64
    )
    data = np.concatenate([cos.ravel(), sin.ravel()]).astype("<f8").tobytes()
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("case", GOLDEN.values(), ids=GOLDEN.keys())
def test_same_bits_on_every_machine(case):
    *arguments, expected = case
    assert digest(*arguments) == expected
