"""rope_cache's scaling schemes: each against the float64 oracle of cache_oracles.py
(one frequency and one position at a time, transcendental functions in decimal
arithmetic), and the properties that relate the schemes to plain RoPE.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from cache_oracles import (
    EPS64,
    LLAMA3,
    assert_matches_oracle,
    default_frequencies,
    dynamic_frequencies,
    exact_cos_sin,
    linear_frequencies,
    llama3_frequencies,
    oracle_caches,
    yarn_attention,
    yarn_frequencies,
    yarn_range,
)
from oracles import DTYPES, assert_bitwise_equal

import numba_rope

DTYPE_IDS = [d.name for d in DTYPES]

# -------------------------------------------------------------- schemes against oracles

L, D = 96, 16


@pytest.mark.parametrize("base", [10000.0, 500000.0, 2.0])
@pytest.mark.parametrize("rotary_dim", [2, 16, 64])
def test_default_matches_oracle(base, rotary_dim):
    oracle = oracle_caches(default_frequencies(rotary_dim, base), L)
    for scaling in (None, {"rope_type": "default"}, {"type": "default"}):
        assert_matches_oracle(scaling, L, rotary_dim, base, oracle)


@pytest.mark.parametrize("factor", [2.0, 3.0, 0.5, 1])
def test_linear_matches_oracle(factor):
    scaling = {"rope_type": "linear", "factor": factor}
    assert_matches_oracle(
        scaling, L, D, 10000.0, oracle_caches(linear_frequencies(D, 1e4, factor), L)
    )


@pytest.mark.parametrize("max_position", [40, 41, 96, 1000])
@pytest.mark.parametrize("factor", [2.0, 8.0, 1.0])
def test_dynamic_matches_oracle(factor, max_position):
    original = 40
    scaling = {
        "rope_type": "dynamic",
        "factor": factor,
        "original_max_position_embeddings": original,
    }
    frequencies = dynamic_frequencies(D, 1e4, factor, original, max_position)
    assert_matches_oracle(scaling, max_position, D, 1e4, oracle_caches(frequencies, max_position))


YARN_CASES = {
    "defaults": ({"factor": 4.0, "original_max_position_embeddings": 64}, 64, 10000.0),
    "explicit betas": (
        {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
        128,
        10000.0,
    ),
    "qwen-like": (
        {"factor": 4.0, "original_max_position_embeddings": 32768},
        128,
        1000000.0,
    ),
    "no truncation": (
        {"factor": 16.0, "original_max_position_embeddings": 2048, "truncate": False},
        64,
        150000.0,
    ),
    "attention factor": (
        {"factor": 4.0, "original_max_position_embeddings": 512, "attention_factor": 0.75},
        32,
        10000.0,
    ),
    "deepseek mscale": (
        {
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        64,
        10000.0,
    ),
    "mscale alone is ignored": (
        {"factor": 4.0, "original_max_position_embeddings": 512, "mscale": 2.0},
        32,
        10000.0,
    ),
    "zero-width ramp": (
        {"factor": 2.0, "original_max_position_embeddings": 6, "beta_fast": 1, "beta_slow": 1},
        16,
        10000.0,
    ),
    "narrow ramp": (
        {"factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 4, "beta_slow": 4},
        16,
        10000.0,
    ),
    "factor one": ({"factor": 1.0, "original_max_position_embeddings": 64}, 16, 10000.0),
    "nulls mean defaults": (
        {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": None, "mscale": None},
        16,
        10000.0,
    ),
}


@pytest.mark.parametrize("case", YARN_CASES.values(), ids=YARN_CASES.keys())
def test_yarn_matches_oracle(case):
    parameters, rotary_dim, base = case
    given = {key: value for key, value in parameters.items() if value is not None}
    frequencies = yarn_frequencies(
        rotary_dim,
        base,
        given["factor"],
        given["original_max_position_embeddings"],
        given.get("beta_fast", 32),
        given.get("beta_slow", 1),
        given.get("truncate", True),
    )
    attention = yarn_attention(
        given["factor"],
        given.get("attention_factor"),
        given.get("mscale"),
        given.get("mscale_all_dim"),
    )
    oracle = oracle_caches(frequencies, L, attention)
    assert_matches_oracle({"rope_type": "yarn", **parameters}, L, rotary_dim, base, oracle)


def test_yarn_equal_mscales_cancel():
    """DeepSeek-V3's configuration: mscale == mscale_all_dim, attention factor 1."""
    cos, _ = numba_rope.rope_cache(
        2,
        4,
        scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        dtype=np.float64,
    )
    assert cos[0, 0] == 1.0


@pytest.mark.parametrize(
    ("rotary_dim", "base", "changes"),
    [
        (128, 500000.0, {}),  # Llama 3.1
        (64, 500000.0, {"factor": 32.0, "original_max_position_embeddings": 8192}),  # 3.2
        (32, 10000.0, {"original_max_position_embeddings": 64, "low_freq_factor": 2}),
    ],
)
def test_llama3_matches_oracle(rotary_dim, base, changes):
    scaling = {**LLAMA3, **changes}
    frequencies = llama3_frequencies(
        rotary_dim,
        base,
        scaling["factor"],
        scaling["low_freq_factor"],
        scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
    )
    assert_matches_oracle(scaling, L, rotary_dim, base, oracle_caches(frequencies, L))


# ----------------------------------------------------------- schemes against plain RoPE


def test_linear_is_default_at_positions_over_factor():
    default_cos, default_sin = numba_rope.rope_cache(50, 32, dtype=np.float64)
    # A power of two divides exactly: row 4p of linear is row p of the default, bit for bit.
    cos, sin = numba_rope.rope_cache(
        200, 32, scaling={"rope_type": "linear", "factor": 4.0}, dtype=np.float64
    )
    assert_bitwise_equal(cos[::4], default_cos)
    assert_bitwise_equal(sin[::4], default_sin)
    # Any factor: cos((p / f) * inv_freq), within the rounding of the angle. The angles
    # p * (inv_freq / f) and (p / f) * inv_freq differ by at most 2 roundings, 2 * 2**-53
    # of the angle; cos and sin move no faster than the angle; the cache is within
    # 0.5 ulp + KERNEL_EXCESS of the exact value; 8 * EPS64 * (1 + angle) covers all of
    # it on every machine (the oracle is decimal arithmetic, not the platform's libm).
    factor = 3.0
    cos, sin = numba_rope.rope_cache(
        300, 32, scaling={"rope_type": "linear", "factor": factor}, dtype=np.float64
    )
    frequencies = default_frequencies(32, 10000.0)
    for p in range(300):
        for i, frequency in enumerate(frequencies):
            angle = (p / factor) * frequency
            tolerance = 8 * EPS64 * (1 + angle)
            exact_cos, exact_sin = exact_cos_sin(angle)
            assert abs(cos[p, i] - float(exact_cos)) <= tolerance
            assert abs(sin[p, i] - float(exact_sin)) <= tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("max_position", [0, 1, 100, 4096])
def test_dynamic_within_original_context_is_default(max_position, dtype):
    scaling = {"rope_type": "dynamic", "factor": 3.5, "original_max_position_embeddings": 4096}
    got = numba_rope.rope_cache(max_position, 64, scaling=scaling, dtype=dtype)
    want = numba_rope.rope_cache(max_position, 64, dtype=dtype)
    for g, w in zip(got, want, strict=True):
        assert_bitwise_equal(g, w)


def test_dynamic_beyond_original_context_slows_rotation():
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    default_cos, default_sin = numba_rope.rope_cache(65, 16, dtype=np.float64)
    cos, sin = numba_rope.rope_cache(65, 16, scaling=scaling, dtype=np.float64)
    # The first frequency is base**0 = 1 whatever the base; the others all slow down.
    assert_bitwise_equal(cos[:, 0], default_cos[:, 0])
    angles = np.arctan2(sin[1], cos[1])
    default_angles = np.arctan2(default_sin[1], default_cos[1])
    assert np.all(angles[1:] < default_angles[1:])


def llama3_bands(rotary_dim, base, scaling):
    n = scaling["original_max_position_embeddings"]
    wavelengths = [2 * math.pi / f for f in default_frequencies(rotary_dim, base)]
    high = [i for i, w in enumerate(wavelengths) if w < n / scaling["high_freq_factor"]]
    low = [i for i, w in enumerate(wavelengths) if w > n / scaling["low_freq_factor"]]
    return high, low


def test_llama3_keeps_high_frequencies_and_divides_low_ones():
    rotary_dim, base = 128, 500000.0
    high, low = llama3_bands(rotary_dim, base, LLAMA3)
    assert high and low and len(high) + len(low) < rotary_dim // 2  # all three bands
    default = numba_rope.rope_cache(50, rotary_dim, base=base, dtype=np.float64)
    llama = numba_rope.rope_cache(400, rotary_dim, base=base, scaling=LLAMA3, dtype=np.float64)
    for got, want in zip(llama, default, strict=True):
        # Unchanged high frequencies: the same columns, bit for bit.
        assert_bitwise_equal(
            np.ascontiguousarray(got[:50, high]), np.ascontiguousarray(want[:, high])
        )
        # Low frequencies divided by the factor 8 (a power of two, exact): row 8p is row p.
        assert_bitwise_equal(
            np.ascontiguousarray(got[::8, low]), np.ascontiguousarray(want[:, low])
        )


def test_yarn_extrapolates_fast_dimensions_and_interpolates_slow_ones():
    rotary_dim, base, original = 64, 10000.0, 4096
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": original}
    attention = yarn_attention(4.0)
    low, high = yarn_range(rotary_dim, base, original, 32, 1)
    assert 0 < low < high < rotary_dim // 2
    default_cos, default_sin = numba_rope.rope_cache(50, rotary_dim, dtype=np.float64)
    cos, sin = numba_rope.rope_cache(200, rotary_dim, scaling=scaling, dtype=np.float64)
    fast, slow = slice(0, low + 1), slice(high, None)
    for got, want in ((cos, default_cos), (sin, default_sin)):
        assert_bitwise_equal(np.ascontiguousarray(got[:50, fast]), want[:, fast] * attention)
        assert_bitwise_equal(np.ascontiguousarray(got[::4, slow]), want[:, slow] * attention)
