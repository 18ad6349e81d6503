"""rope_cache: shape, layout and dtypes; the single rounding; properties every scheme
shares; the caches driving rotary_embedding; every error. The schemes against their
oracles are in test_cache_scaling.py, the cos/sin kernel in test_cache_sincos.py.
"""

from __future__ import annotations

import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from cache_oracles import LLAMA3, SCHEMES, round_once, yarn_attention
from oracles import BFLOAT16, DTYPES, assert_bitwise_equal, float32_contract, ulp_of

import numba_rope
from numba_rope import reference

DTYPE_IDS = [d.name for d in DTYPES]

# ------------------------------------------------------------------------- properties


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scaling", SCHEMES.values(), ids=SCHEMES.keys())
def test_shape_dtype_layout(scaling, dtype):
    cos, sin = numba_rope.rope_cache(200, 24, scaling=scaling, dtype=dtype)
    for cache in (cos, sin):
        assert type(cache) is np.ndarray
        assert cache.shape == (200, 12)
        assert cache.dtype == dtype
        assert cache.flags.c_contiguous and cache.flags.writeable and cache.flags.owndata


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scaling", SCHEMES.values(), ids=SCHEMES.keys())
def test_rounded_once_from_float64(scaling, dtype):
    """Each dtype is the float64 cache rounded once, to nearest even: bit for bit."""
    wide = numba_rope.rope_cache(300, 32, scaling=scaling, dtype=np.float64)
    narrow = numba_rope.rope_cache(300, 32, scaling=scaling, dtype=dtype)
    for got, values in zip(narrow, wide, strict=True):
        assert_bitwise_equal(got, round_once(values, dtype))


def test_bfloat16_is_not_rounded_twice():
    """Rounding float64 to bfloat16 through float32 rounds twice; we must round once.

    (ml_dtypes 0.6 converts float64 through float32, 0.7 rounds once: this test holds
    with either.)
    """
    from numba_rope._rounding import round_once as library_round_once

    def _round_to_bfloat16(values):
        return library_round_once(values, BFLOAT16)

    halfway = 1 + 2.0**-8  # between the bfloat16 neighbours 1 and 1 + 2**-7
    values = np.array([halfway + 2.0**-30, halfway - 2.0**-30, halfway, -halfway - 2.0**-40])
    got = _round_to_bfloat16(values).astype(np.float64)
    assert got.tolist() == [1 + 2.0**-7, 1.0, 1.0, -(1 + 2.0**-7)]
    # the double rounding this avoids: float32 first, then bfloat16
    assert values.astype(np.float32).astype(BFLOAT16)[0] == 1.0

    rng = np.random.default_rng(7)
    samples = np.concatenate(
        [
            rng.standard_normal(20000) * np.exp2(rng.integers(-140, 120, 20000)),
            np.array([0.0, -0.0, 2.0**-133, 2.0**-134, 3 * 2.0**-135, 2.0**-149, 1e-300]),
        ]
    )
    assert_bitwise_equal(_round_to_bfloat16(samples), round_once(samples, BFLOAT16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scaling", SCHEMES.values(), ids=SCHEMES.keys())
def test_pythagoras(scaling, dtype):
    attention = yarn_attention(4.0) if scaling and scaling["rope_type"] == "yarn" else 1.0
    cos, sin = (
        c.astype(np.float64) for c in numba_rope.rope_cache(500, 64, scaling=scaling, dtype=dtype)
    )
    tolerance = 4 * ulp_of(dtype) * attention**2
    assert np.all(np.abs(cos**2 + sin**2 - attention**2) <= tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scaling", SCHEMES.values(), ids=SCHEMES.keys())
def test_position_zero(scaling, dtype):
    cos, sin = numba_rope.rope_cache(3, 10, scaling=scaling, dtype=dtype)
    attention = yarn_attention(4.0) if scaling and scaling["rope_type"] == "yarn" else 1.0
    assert_bitwise_equal(cos[0], round_once(np.full(5, attention), dtype))
    assert_bitwise_equal(sin[0], np.zeros(5, dtype))


def test_accepts_numpy_scalars_and_mappings():
    from types import MappingProxyType

    scaling = MappingProxyType({"rope_type": "linear", "factor": np.float32(2.0)})
    got = numba_rope.rope_cache(np.int64(10), np.int32(8), base=np.float64(10000), scaling=scaling)
    want = numba_rope.rope_cache(10, 8, scaling={"rope_type": "linear", "factor": 2.0})
    for g, w in zip(got, want, strict=True):
        assert_bitwise_equal(g, w)
    for dtype in ("float16", np.dtype(np.float16), np.float16):
        assert numba_rope.rope_cache(2, 4, dtype=dtype)[0].dtype == np.float16
    assert numba_rope.rope_cache(2, 4, dtype=ml_dtypes.bfloat16)[0].dtype == BFLOAT16
    # By name, in a process that has not imported ml_dtypes (NumPy knows the name only
    # after it has): the same bits as the type.
    script = (
        "import sys, numba_rope; assert 'ml_dtypes' not in sys.modules; "
        "print(numba_rope.rope_cache(3, 4, dtype='bfloat16')[0].view('u2').tolist())"
    )
    named = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert named.strip() == str(
        numba_rope.rope_cache(3, 4, dtype=BFLOAT16)[0].view(np.uint16).tolist()
    )
    big_endian = numba_rope.rope_cache(2, 4, dtype=">f4")[0]
    assert big_endian.dtype == np.float32 and big_endian.dtype.isnative
    assert big_endian.dtype is np.dtype(np.float32)  # NumPy's own object: plans compare it
    # transformers' former key name for the type.
    legacy = numba_rope.rope_cache(10, 8, scaling={"type": "linear", "factor": 2.0})
    for g, w in zip(legacy, want, strict=True):
        assert_bitwise_equal(g, w)


def test_empty_cache():
    cos, sin = numba_rope.rope_cache(0, 8, scaling=SCHEMES["yarn"])
    assert cos.shape == sin.shape == (0, 4)
    assert cos.flags.c_contiguous


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_caches_drive_rotary_embedding(rng, dtype, interleaved):
    batch, heads, seq_len, head_size, rotary_dim = 2, 3, 7, 24, 16
    x = rng.standard_normal((batch, heads, seq_len, head_size)).astype(dtype)
    ids = rng.integers(0, 300, size=(batch, seq_len))
    cos, sin = numba_rope.rope_cache(300, rotary_dim, scaling=SCHEMES["yarn"], dtype=dtype)
    got = numba_rope.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids, interleaved, rotary_dim))
    want = reference.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    scale = np.abs(x.astype(np.float64)).max() * 2 * yarn_attention(4.0)
    assert np.allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=0, atol=4 * ulp_of(dtype) * scale
    )


# ----------------------------------------------------------------------------- errors

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

ERRORS = {
    # arguments
    "max_position negative": ({"max_position": -1}, ValueError, ["max_position", ">= 0", "-1"]),
    "max_position float": ({"max_position": 10.0}, TypeError, ["max_position", "integer", "float"]),
    "max_position bool": ({"max_position": True}, TypeError, ["max_position", "integer"]),
    "rotary_dim odd": ({"rotary_dim": 7}, ValueError, ["rotary_dim", "even", "7"]),
    "rotary_dim zero": ({"rotary_dim": 0}, ValueError, ["rotary_dim", "positive and even", "0"]),
    "rotary_dim negative": ({"rotary_dim": -4}, ValueError, ["rotary_dim", ">= 0", "-4"]),
    "rotary_dim string": ({"rotary_dim": "8"}, TypeError, ["rotary_dim", "integer", "str"]),
    "base zero": ({"base": 0.0}, ValueError, ["base", "> 0", "0.0"]),
    "base negative": ({"base": -10.0}, ValueError, ["base", "> 0", "-10.0"]),
    "base infinite": ({"base": math.inf}, ValueError, ["base", "finite", "inf"]),
    "base nan": ({"base": math.nan}, ValueError, ["base", "finite", "nan"]),
    "base string": ({"base": "10000"}, TypeError, ["base", "real number", "str"]),
    "dtype int": ({"dtype": np.int32}, TypeError, ["dtype", "float32, float16, bfloat16, float64"]),
    "dtype complex": ({"dtype": "complex64"}, TypeError, ["dtype", "float32, float16, bfloat16"]),
    "dtype None": ({"dtype": None}, TypeError, ["dtype", "float32, float16, bfloat16", "None"]),
    "dtype nonsense": ({"dtype": "floaty"}, TypeError, ["dtype", "floaty", "bfloat16"]),
    "scaling list": (
        {"scaling": [("rope_type", "linear")]},
        TypeError,
        ["scaling", "dict", "list"],
    ),
    "scaling string": ({"scaling": "linear"}, TypeError, ["scaling", "dict", "str"]),
    # rope types
    "unknown type": (
        {"scaling": {"rope_type": "proportional", "factor": 2.0}},
        ValueError,
        ["proportional", "'default', 'linear', 'dynamic', 'yarn', 'longrope', 'llama3'"],
    ),
    "type not a string": (
        {"scaling": {"rope_type": 3}},
        ValueError,
        ["3", "'default', 'linear', 'dynamic', 'yarn', 'longrope', 'llama3'"],
    ),
    "no type": (
        {"scaling": {"factor": 2.0}},
        ValueError,
        ["'rope_type'", "'linear'", "factor"],
    ),
    "conflicting type keys": (
        {"scaling": {"rope_type": "linear", "type": "dynamic", "factor": 2.0}},
        ValueError,
        ["'linear'", "'dynamic'"],
    ),
    "'su' as a type": (
        {"scaling": {"rope_type": "su", "factor": 2.0}},
        ValueError,
        ["unknown rope_type 'su'", "Phi-3's former name of 'longrope'"],
    ),
    # missing parameters
    "linear without factor": (
        {"scaling": {"rope_type": "linear"}},
        ValueError,
        ["missing 'factor'", "rope_type, factor"],
    ),
    "linear factor None": (
        {"scaling": {"rope_type": "linear", "factor": None}},
        ValueError,
        ["missing 'factor'"],
    ),
    "dynamic without original": (
        {"scaling": {"rope_type": "dynamic", "factor": 2.0}},
        ValueError,
        ["'dynamic'", "missing 'original_max_position_embeddings'"],
    ),
    "yarn without anything": (
        {"scaling": {"rope_type": "yarn"}},
        ValueError,
        ["missing 'factor', 'original_max_position_embeddings'", "optionally beta_fast"],
    ),
    "llama3 without band factors": (
        {
            "scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 8192,
            }
        },
        ValueError,
        ["missing 'low_freq_factor', 'high_freq_factor'"],
    ),
    # unknown keys
    "typo in key": (
        {"scaling": {"rope_type": "linear", "factr": 2.0}},
        ValueError,
        ["unknown key 'factr'", "accepted keys: rope_type, factor"],
    ),
    "typo next to a good key": (
        {"scaling": {**YARN, "beta_fats": 16}},
        ValueError,
        ["'beta_fats'", "beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate"],
    ),
    "key of another type": (
        {"scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
        ValueError,
        ["'low_freq_factor'", "'linear'"],
    ),
    "default with factor": (
        {"scaling": {"rope_type": "default", "factor": 2.0}},
        ValueError,
        ["unknown key 'factor'", "accepted keys: rope_type"],
    ),
    "rope_theta in scaling": (
        {"scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        ValueError,
        ["'rope_theta'", "base="],
    ),
    # parameter values
    "linear factor zero": (
        {"scaling": {"rope_type": "linear", "factor": 0.0}},
        ValueError,
        ["factor", "> 0", "0.0"],
    ),
    "linear factor string": (
        {"scaling": {"rope_type": "linear", "factor": "2"}},
        TypeError,
        ["factor", "real number", "str"],
    ),
    "linear factor bool": (
        {"scaling": {"rope_type": "linear", "factor": True}},
        TypeError,
        ["factor", "real number", "bool"],
    ),
    "dynamic factor below one": (
        {"scaling": {"rope_type": "dynamic", "factor": 0.5, "original_max_position_embeddings": 8}},
        ValueError,
        ["dynamic scaling factor", ">= 1", "0.5"],
    ),
    "dynamic original zero": (
        {"scaling": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 0}},
        ValueError,
        ["original_max_position_embeddings", ">= 1", "0"],
    ),
    "dynamic original float": (
        {
            "scaling": {
                "rope_type": "dynamic",
                "factor": 2.0,
                "original_max_position_embeddings": 8.5,
            }
        },
        TypeError,
        ["original_max_position_embeddings", "integer", "8.5"],
    ),
    "dynamic two channels": (
        {
            "rotary_dim": 2,
            "scaling": {
                "rope_type": "dynamic",
                "factor": 2.0,
                "original_max_position_embeddings": 8,
            },
        },
        ValueError,
        ["dynamic", "rotary_dim >= 4", "2"],
    ),
    "yarn factor below one": (
        {"scaling": {**YARN, "factor": 0.5}},
        ValueError,
        ["yarn factor", ">= 1"],
    ),
    "yarn betas reversed": (
        {"scaling": {**YARN, "beta_fast": 1, "beta_slow": 32}},
        ValueError,
        ["beta_fast must be >= beta_slow", "beta_fast=1", "beta_slow=32"],
    ),
    "yarn beta zero": ({"scaling": {**YARN, "beta_slow": 0}}, ValueError, ["beta_slow", "> 0"]),
    "yarn attention factor negative": (
        {"scaling": {**YARN, "attention_factor": -1.0}},
        ValueError,
        ["attention_factor", "> 0", "-1.0"],
    ),
    "yarn truncate string": (
        {"scaling": {**YARN, "truncate": "yes"}},
        TypeError,
        ["truncate", "True or False", "'yes'"],
    ),
    "yarn base one": (
        {"base": 1.0, "scaling": YARN},
        ValueError,
        ["yarn", "base != 1", "log(base)"],
    ),
    "yarn mscale degenerate": (
        {"scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": -20 / math.log(4.0)}},
        ValueError,
        ["mscale=1.0", "mscale_all_dim=", "both must be > 0"],
    ),
    "llama3 bands reversed": (
        {"scaling": {**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
        ValueError,
        ["high_freq_factor must be > low_freq_factor", "4.0", "1.0"],
    ),
    "llama3 equal bands": (
        {"scaling": {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}},
        ValueError,
        ["high_freq_factor must be > low_freq_factor"],
    ),
    "llama3 factor infinite": (
        {"scaling": {**LLAMA3, "factor": math.inf}},
        ValueError,
        ["llama3 factor", "finite", "inf"],
    ),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_errors_state_the_rule_and_what_is_accepted(case):
    changes, exception, fragments = case
    arguments = {"max_position": 16, "rotary_dim": 8, **changes}
    max_position, rotary_dim = arguments.pop("max_position"), arguments.pop("rotary_dim")
    with pytest.raises(exception) as raised:
        numba_rope.rope_cache(max_position, rotary_dim, **arguments)
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_scaling_argument_is_not_modified():
    scaling = {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": None,
    }
    before = dict(scaling)
    numba_rope.rope_cache(4, 8, scaling=scaling)
    assert scaling == before


def test_exported():
    assert "rope_cache" in numba_rope.__all__
    assert numba_rope.rope_cache.__doc__


def test_reference_rounds_bfloat16_once():
    """The operator's float64 reference rounds its bfloat16 results once, too."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, 1, 64, 32)).astype(BFLOAT16)
    # float32 caches carry more bits than bfloat16, so x1*cos - x2*sin in float64 is
    # rarely a float32: this is where rounding through float32 would go wrong.
    angles = rng.uniform(-3, 3, size=(1, 64, 16))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    got = numba_rope.reference.rotary_embedding(x, cos, sin)
    x64 = x.astype(np.float64)
    c, s = cos.astype(np.float64)[:, None], sin.astype(np.float64)[:, None]
    x1, x2 = x64[..., :16], x64[..., 16:]
    exact = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    assert_bitwise_equal(got, round_once(exact, BFLOAT16))


def test_reference_bfloat16_halfway_case():
    # x1*cos = 0.37988281657... lies just above 0.3798828125, the midpoint between the
    # bfloat16 neighbours 0.37890625 and 0.380859375; rounded to float32 first it would
    # land on the midpoint and then round (to even) down.
    x = np.array([[[[-1.7109375, 0.0]]]]).astype(BFLOAT16)
    cos = np.array([[[-0.22203196585178375]]], dtype=np.float32)
    sin = np.zeros((1, 1, 1), np.float32)
    got = numba_rope.reference.rotary_embedding(x, cos, sin)
    assert float(got[0, 0, 0, 0]) == 0.380859375
