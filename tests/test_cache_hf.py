"""rope_cache in transformers' form (``config=``, ``rope_parameters=``), LongRoPE and
``seq_len=``: against transformers' own rotary modules (when transformers is installed),
against the decimal oracles of cache_oracles.py, and against numba_rope's own form with
the arguments translated by hand in the tests, following ``modeling_rope_utils.py``.
"""

from __future__ import annotations

import copy
import math
import types

import numpy as np
import pytest
from cache_oracles import (
    assert_matches_oracle,
    default_frequencies,
    dynamic_frequencies,
    exact_log,
    exact_pow,
    oracle_caches,
    yarn_frequencies,
)
from oracles import DTYPES, assert_bitwise_equal

import numba_rope

# ------------------------------------------------------------------ longrope oracle


def longrope_frequencies(rotary_dim, base, factors):
    """``1 / (e[i] * base**(2i/d))``, the power in decimal arithmetic (45 digits)."""
    return [
        1.0 / (factors[i] * exact_pow(base, (2 * i) / rotary_dim)) for i in range(rotary_dim // 2)
    ]


def longrope_attention(factor, original):
    """``sqrt(1 + ln(f) / ln(n))``, 1 when ``f <= 1``; sqrt is correctly rounded (IEEE)."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + exact_log(factor) / exact_log(original))


SHORT = [1.0, 1.02, 1.1, 1.25, 1.5, 1.75, 2.0, 3.0]
LONG = [1.0, 1.5, 2.5, 4.0, 6.5, 9.0, 12.0, 16.0]
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": SHORT,
    "long_factor": LONG,
    "original_max_position_embeddings": 48,
}
#: LONGROPE without its type, for the keys that name it otherwise.
UNNAMED_LONGROPE = {key: value for key, value in LONGROPE.items() if key != "rope_type"}
L, D = 64, 16


@pytest.mark.parametrize("seq_len", [None, 1, 48, 49, 4096])
@pytest.mark.parametrize(
    ("extra", "attention"),
    [
        ({"factor": 4.0}, longrope_attention(4.0, 48)),
        ({"factor": 32.0, "attention_factor": 1.25}, 1.25),  # given wins over the formula
        ({"factor": 0.5}, 1.0),
        ({"attention_factor": 0.8}, 0.8),
    ],
)
def test_longrope_matches_oracle(seq_len, extra, attention):
    """The short factors up to the original context, the long ones beyond it (by the
    sequence length, the cache length by default), times the attention factor, bit for
    bit as the decimal oracle rounds each float64 step."""
    scaling = {**LONGROPE, **extra}
    long = (L if seq_len is None else seq_len) > 48
    oracle = oracle_caches(longrope_frequencies(D, 10000.0, LONG if long else SHORT), L, attention)
    if seq_len is None:
        assert_matches_oracle(scaling, L, D, 10000.0, oracle)
    else:  # assert_matches_oracle has no seq_len: within a few float64 ulps
        cos, sin = numba_rope.rope_cache(L, D, scaling=scaling, seq_len=seq_len, dtype=np.float64)
        tolerance = attention * 8 * 2.0**-52 * (1 + np.abs(oracle.angles))
        assert np.all(np.abs(cos - oracle.cos) <= tolerance)
        assert np.all(np.abs(sin - oracle.sin) <= tolerance)


def test_longrope_attention_factor_of_phi3_mini_128k():
    """Phi-3-mini-128k: max_position_embeddings 131072 over 4096, factor 32, attention
    factor sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12), in decimal arithmetic here."""
    config = {
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48},
    }
    cos, _ = numba_rope.rope_cache(1, config=config, dtype=np.float64)
    assert cos.shape == (1, 48)
    # sqrt of the correctly rounded 17/12, correctly rounded (IEEE sqrt).
    assert cos[0, 0] == math.sqrt(1 + exact_log(32.0) / exact_log(4096.0))
    assert abs(cos[0, 0] - math.sqrt(17 / 12)) <= 2 * 2.0**-52


@pytest.mark.parametrize("seq_len", [1, 40, 41, 60, 96, 1000])
def test_dynamic_seq_len_matches_oracle(seq_len):
    """The dynamic NTK cache for a sequence of seq_len, whatever the cache length."""
    scaling = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 40}
    frequencies = dynamic_frequencies(D, 10000.0, 4.0, 40, seq_len)
    oracle = oracle_caches(frequencies, 50)
    cos, sin = numba_rope.rope_cache(50, D, scaling=scaling, seq_len=seq_len, dtype=np.float64)
    tolerance = 8 * 2.0**-52 * (1 + np.abs(oracle.angles))
    assert np.all(np.abs(cos - oracle.cos) <= tolerance)
    assert np.all(np.abs(sin - oracle.sin) <= tolerance)
    if seq_len <= 40:  # within the original context: plain RoPE, bit for bit
        plain_cos, plain_sin = numba_rope.rope_cache(50, D, dtype=np.float64)
        assert_bitwise_equal(cos, plain_cos)
        assert_bitwise_equal(sin, plain_sin)


@pytest.mark.parametrize("rope_type", ["default", "linear", "yarn", "llama3"])
def test_seq_len_changes_nothing_for_other_types(rope_type):
    scaling = {
        "default": None,
        "linear": {"rope_type": "linear", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    }[rope_type]
    want = numba_rope.rope_cache(16, D, scaling=scaling)
    for seq_len in (1, 8, 9, 10**6):
        got = numba_rope.rope_cache(16, D, scaling=scaling, seq_len=seq_len)
        assert_bitwise_equal(got[0], want[0])
        assert_bitwise_equal(got[1], want[1])


# ----------------------------------------------- transformers' form, translated by hand


def same_caches(transformers_form, numba_rope_form, dtype=np.float64):
    got = numba_rope.rope_cache(**transformers_form, dtype=dtype)
    want = numba_rope.rope_cache(**numba_rope_form, dtype=dtype)
    assert_bitwise_equal(got[0], want[0])
    assert_bitwise_equal(got[1], want[1])


# Each: (config as config.json holds it, the same in numba_rope's form, translated by
# hand as transformers 5 reads the config).
TRANSLATIONS = {
    "plain, transformers 5": (
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "max_position_embeddings": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        },
        {"max_position": 32, "rotary_dim": 16, "base": 500000.0},
    ),
    "no rope fields: base 10000": (
        {"head_dim": 8, "max_position_embeddings": 20},
        {"max_position": 20, "rotary_dim": 8},
    ),
    "transformers 4 rope_scaling, rope_theta outside": (
        {
            "head_dim": 32,
            "hidden_size": 64,  # head_dim wins over hidden_size // num_attention_heads
            "num_attention_heads": 4,
            "max_position_embeddings": 24,
            "rope_theta": 1000.0,
            "rope_scaling": {"type": "linear", "factor": 3.0},
        },
        {
            "max_position": 24,
            "rotary_dim": 32,
            "base": 1000.0,
            "scaling": {"rope_type": "linear", "factor": 3.0},
        },
    ),
    "rope_parameters wins over rope_scaling, its rope_theta over the config's": (
        {
            "head_dim": 16,
            "max_position_embeddings": 24,
            "rope_theta": 1000.0,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0},
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
        {
            "max_position": 24,
            "rotary_dim": 16,
            "base": 50.0,
            "scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    "partial rotary factor of the config": (
        {
            "hidden_size": 80 * 4,
            "num_attention_heads": 4,
            "partial_rotary_factor": 0.4,  # 80 * 0.4 = 32.000000000000004 -> 32
            "max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
        {"max_position": 16, "rotary_dim": 32},
    ),
    "partial rotary factor in the dict wins": (
        {
            "head_dim": 64,
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 16,
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25},
        },
        {"max_position": 16, "rotary_dim": 16},
    ),
    "dynamic: from max_position_embeddings, its own original ignored": (
        {
            "head_dim": 16,
            "max_position_embeddings": 40,
            "rope_scaling": {
                "rope_type": "dynamic",
                "factor": 2.0,
                "original_max_position_embeddings": 7,
            },
        },
        {
            "max_position": 40,
            "rotary_dim": 16,
            "scaling": {
                "rope_type": "dynamic",
                "factor": 2.0,
                "original_max_position_embeddings": 40,
            },
        },
    ),
    "yarn: factor None is max_position_embeddings / original": (
        {
            "head_dim": 32,
            "max_position_embeddings": 96,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": None,
                "original_max_position_embeddings": 24,
                "rope_theta": 10000.0,
            },
        },
        {
            "max_position": 96,
            "rotary_dim": 32,
            "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24},
        },
    ),
    "yarn: original from max_position_embeddings, betas 0 are the defaults, truncate None": (
        {
            "head_dim": 32,
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 0,
                "beta_slow": None,
                "truncate": None,  # transformers: `if truncate:` -> no truncation
            },
        },
        {
            "max_position": 64,
            "rotary_dim": 32,
            "scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "truncate": False,
            },
        },
    ),
    "yarn: truncate None in numba_rope's form too (transformers' `if truncate:`)": (
        {
            "head_dim": 32,
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "truncate": None,
            },
        },
        {
            "max_position": 64,
            "rotary_dim": 32,
            "scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "truncate": None,
            },
        },
    ),
    "longrope: a Phi-3 config.json naming it 'su', as Phi3Config reads it": (
        {
            "model_type": "phi3",
            "head_dim": 16,
            "max_position_embeddings": 192,
            "rope_scaling": {**UNNAMED_LONGROPE, "type": "su"},
        },
        {"max_position": 192, "rotary_dim": 16, "scaling": {**LONGROPE, "factor": 4.0}},
    ),
    "longrope: a Phi-4-multimodal config.json naming it 'yarn' as rope_type": (
        {
            "model_type": "phi4_multimodal",
            "head_dim": 16,
            "max_position_embeddings": 192,
            "rope_parameters": {**UNNAMED_LONGROPE, "rope_type": "yarn"},
        },
        {"max_position": 192, "rotary_dim": 16, "scaling": {**LONGROPE, "factor": 4.0}},
    ),
    "longrope beside its former name 'yarn', as Phi3Config leaves them": (
        {
            "head_dim": 16,
            "max_position_embeddings": 192,
            "rope_parameters": {**LONGROPE, "type": "yarn"},
        },
        {
            "max_position": 192,
            "rotary_dim": 16,
            "scaling": {**LONGROPE, "type": "su", "factor": 4.0},
        },
    ),
    "longrope: Phi-3's original outside the dict wins, factor from the lengths": (
        {
            "hidden_size": 64,
            "num_attention_heads": 2,
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 192,
            "original_max_position_embeddings": 48,
            "rope_scaling": {**LONGROPE, "type": "longrope", "original_max_position_embeddings": 7},
        },
        {
            "max_position": 192,
            "rotary_dim": 16,
            "scaling": {**LONGROPE, "factor": 4.0},
        },
    ),
    "llama3": (
        {
            "head_dim": 32,
            "max_position_embeddings": 80,
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 20,
                "rope_theta": 500000.0,
                "mrope_section": [4, 6, 6],  # known to transformers, unused: ignored
            },
        },
        {
            "max_position": 80,
            "rotary_dim": 32,
            "base": 500000.0,
            "scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 20,
            },
        },
    ),
}


@pytest.mark.parametrize("case", TRANSLATIONS.values(), ids=TRANSLATIONS.keys())
def test_config_reads_as_transformers_reads_it(case):
    config, translated = case
    same_caches({"config": config}, translated)
    # The same fields as attributes of an object (a PretrainedConfig's form).
    same_caches({"config": types.SimpleNamespace(**config)}, translated)


def test_rope_parameters_with_head_dim_and_length():
    """The dict alone, with the two fields a config would give, and with a config whose
    own rope parameters it replaces (one layer type's dict of a per-layer config)."""
    parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    translated = {
        "max_position": 64,
        "rotary_dim": 32,
        "scaling": {**parameters},
    }
    same_caches(
        {"rope_parameters": parameters, "head_dim": 32, "max_position_embeddings": 64},
        translated,
    )
    per_layer = {
        "head_dim": 32,
        "max_position_embeddings": 64,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": parameters,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }
    same_caches(
        {"config": per_layer, "rope_parameters": per_layer["rope_parameters"]["full_attention"]},
        translated,
    )
    # rotary_dim instead of head_dim when the whole head rotates; max_position given.
    same_caches(
        {
            "rope_parameters": {"rope_type": "linear", "factor": 2.0},
            "rotary_dim": 8,
            "max_position": 4,
        },
        {"max_position": 4, "rotary_dim": 8, "scaling": {"rope_type": "linear", "factor": 2.0}},
    )
    # A base equal to rope_theta is allowed, as is a rotary_dim equal to the derived one.
    same_caches(
        {
            "config": {"head_dim": 8, "rope_theta": 5.0},
            "base": 5.0,
            "rotary_dim": 8,
            "max_position": 3,
        },
        {"max_position": 3, "rotary_dim": 8, "base": 5.0},
    )


def test_seq_len_in_transformers_form():
    config = {
        "head_dim": 16,
        "max_position_embeddings": 40,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    }
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 40}
    for seq_len in (10, 40, 41, 100):
        same_caches(
            {"config": config, "max_position": 8, "seq_len": seq_len},
            {"max_position": 8, "rotary_dim": 16, "scaling": scaling, "seq_len": seq_len},
        )


def test_config_and_rope_parameters_are_not_modified():
    parameters = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    config = {
        "head_dim": 16,
        "max_position_embeddings": 96,
        "original_max_position_embeddings": 48,
        "rope_scaling": parameters,
    }
    before = repr(config)
    numba_rope.rope_cache(config=config)
    numba_rope.rope_cache(rope_parameters=parameters, config=config)
    assert repr(config) == before


def test_every_dtype_is_the_float64_cache_rounded_once():
    config = {
        "head_dim": 16,
        "max_position_embeddings": 64,
        "rope_scaling": {**LONGROPE, "factor": 2.0},
    }
    for dtype in DTYPES:
        got = numba_rope.rope_cache(config=config, dtype=dtype)
        want = numba_rope.rope_cache(64, 16, scaling={**LONGROPE, "factor": 2.0}, dtype=dtype)
        assert_bitwise_equal(got[0], want[0])
        assert_bitwise_equal(got[1], want[1])


# ------------------------------------------------------------------------- errors

HEAD = {"head_dim": 16, "max_position_embeddings": 32}

ERRORS = {
    "unsupported type": (
        {"config": {**HEAD, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}},
        ValueError,
        ["'proportional'", "'default', 'linear', 'dynamic', 'yarn', 'longrope', 'llama3'"],
    ),
    "two types": (
        {"rope_parameters": {"rope_type": "yarn", "type": "linear", "factor": 2.0}, **HEAD},
        ValueError,
        ["rope_type='yarn'", "type='linear'", "keep one"],
    ),
    "'yarn' beside 'linear' is no former name": (
        {"rope_parameters": {"rope_type": "linear", "type": "yarn", "factor": 2.0}, **HEAD},
        ValueError,
        ["rope_type='linear'", "type='yarn'", "keep one"],
    ),
    "'su' outside a Phi-3 config": (
        {"rope_parameters": {**UNNAMED_LONGROPE, "type": "su", "factor": 2.0}, **HEAD},
        ValueError,
        ["rope_type 'su'", "Phi-3's former name of 'longrope'"],
    ),
    "no type, a scaling parameter": (
        {"rope_parameters": {"factor": 8.0, "rope_theta": 1e4}, **HEAD},
        ValueError,
        ["names no rope type", "factor=8.0", "rope_type='linear'"],
    ),
    "a None type, a scaling parameter (transformers: KeyError)": (
        {"config": {**HEAD, "rope_parameters": {"rope_type": None, "mrope_section": [2, 3, 3]}}},
        ValueError,
        ["config.rope_parameters names no rope type", "mrope_section=[2, 3, 3]"],
    ),
    "typo": (
        {"rope_parameters": {"rope_type": "linear", "factr": 2.0}, **HEAD},
        ValueError,
        ["unknown key 'factr'", "rope_theta", "partial_rotary_factor"],
    ),
    "missing factor": (
        {"rope_parameters": {"rope_type": "linear"}, **HEAD},
        ValueError,
        ["rope_parameters for rope_type 'linear' is missing 'factor'"],
    ),
    "longrope without factors": (
        {"config": {**HEAD, "rope_scaling": {"type": "longrope"}}},
        ValueError,
        ["config.rope_scaling", "missing 'short_factor', 'long_factor'"],
    ),
    "longrope factors of the wrong length": (
        {"config": {**HEAD, "rope_scaling": {**LONGROPE, "long_factor": [1.0] * 4}}},
        ValueError,
        ["longrope long_factor", "rotary_dim / 2 = 8", "got 4"],
    ),
    "longrope factor not positive": (
        {"config": {**HEAD, "rope_scaling": {**LONGROPE, "short_factor": [0.0] * 8}}},
        ValueError,
        ["longrope short_factor[0]", "> 0"],
    ),
    "longrope factors a string": (
        {"config": {**HEAD, "rope_scaling": {**LONGROPE, "short_factor": "1.0"}}},
        TypeError,
        ["longrope short_factor", "list of 8 numbers", "str"],
    ),
    "per-layer dict": (
        {"config": {**HEAD, "rope_parameters": {"full_attention": {"rope_type": "default"}}}},
        ValueError,
        ["one dict per layer type", "'full_attention'", "rope_parameters=config.rope_parameters"],
    ),
    "rope parameters not a dict": (
        {"rope_parameters": [("rope_type", "linear")], **HEAD},
        TypeError,
        ["rope_parameters must be a dict", "list"],
    ),
    "config of another kind": (
        {"config": "meta-llama/Llama-3.1-8B"},
        TypeError,
        ["config must be a transformers PretrainedConfig or a dict", "str"],
    ),
    "no head size": (
        {"rope_parameters": {"rope_type": "default"}, "max_position": 4},
        ValueError,
        ["needs the head size", "head_dim="],
    ),
    "partial factor without head size": (
        {
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5},
            "rotary_dim": 8,
            "max_position": 4,
        },
        ValueError,
        ["partial_rotary_factor=0.5", "head_dim="],
    ),
    "odd rotated channels": (
        {"config": {"head_dim": 10, "partial_rotary_factor": 0.5, "max_position_embeddings": 4}},
        ValueError,
        ["10 * 0.5 gives 5 rotated channels", "positive even"],
    ),
    "partial factor out of range": (
        {"config": {**HEAD, "partial_rotary_factor": 1.5}},
        ValueError,
        ["partial_rotary_factor must be in (0, 1]", "1.5"],
    ),
    "rotary_dim disagrees": (
        {"config": HEAD, "rotary_dim": 8},
        ValueError,
        ["rotary_dim=8", "= 16", "leave rotary_dim out"],
    ),
    "base disagrees": (
        {"config": {**HEAD, "rope_theta": 500000.0}, "base": 10000.0},
        ValueError,
        ["base=10000.0", "rope_theta=500000.0", "leave base out"],
    ),
    "no length for dynamic": (
        {
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0},
            "head_dim": 16,
            "max_position": 4,
        },
        ValueError,
        ["'dynamic'", "max_position_embeddings="],
    ),
    "no length for a yarn factor": (
        {
            "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 8},
            "head_dim": 16,
            "max_position": 4,
        },
        ValueError,
        ["'yarn' without factor", "max_position_embeddings / original_max_position_embeddings"],
    ),
    "no cache length": (
        {"rope_parameters": {"rope_type": "default"}, "head_dim": 16},
        ValueError,
        ["needs max_position", "max_position_embeddings="],
    ),
    "scaling with a config": (
        {"config": HEAD, "scaling": {"rope_type": "linear", "factor": 2.0}},
        ValueError,
        ["scaling=", "leave it out"],
    ),
    "head_dim without a config": (
        {"max_position": 4, "rotary_dim": 8, "head_dim": 8},
        ValueError,
        ["head_dim=", "config= or rope_parameters="],
    ),
    "nothing": ({}, TypeError, ["needs max_position and rotary_dim", "config="]),
    "seq_len zero": (
        {"max_position": 4, "rotary_dim": 8, "seq_len": 0},
        ValueError,
        ["seq_len", ">= 1"],
    ),
    "seq_len float": (
        {"max_position": 4, "rotary_dim": 8, "seq_len": 4.0},
        TypeError,
        ["seq_len must be an integer"],
    ),
    "longrope scaling without factor": (
        {"max_position": 4, "rotary_dim": 16, "scaling": LONGROPE},
        ValueError,
        ["'longrope' needs 'factor'", "'attention_factor'", "config="],
    ),
    "longrope attention of one position": (
        {
            "max_position": 4,
            "rotary_dim": 16,
            "scaling": {**LONGROPE, "factor": 2.0, "original_max_position_embeddings": 1},
        },
        ValueError,
        ["original_max_position_embeddings >= 2", "attention_factor"],
    ),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_errors_state_the_rule_and_the_fix(case):
    arguments, exception, fragments = case
    with pytest.raises(exception) as raised:
        numba_rope.rope_cache(**arguments)
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# ------------------------------------------------------- against transformers itself
#
# transformers' rotary modules return cos and sin of shape [batch, seq_len, head_dim]
# (cat(freqs, freqs): the halves equal), computed in float32: inv_freq by float32 pow,
# products and quotients, the angle p * inv_freq a float32 product, cos/sin in float32,
# times the attention factor. The tolerance follows that computation:
#
# 1. HF's float32 inverse frequencies lie within a relative 2**-18 (64 float32 ulps) of
#    ours: each is at most ~10 float32 operations, each within 2**-24 relative (pow:
#    torch's float32 pow is within 1 ulp), and yarn's blend of two frequencies a factor
#    f <= 8 apart amplifies a weight's rounding at most f-fold. Asserted first (ours
#    read back from row 1 of the float64 cache: atan2(sin, cos) of an angle below pi,
#    exact to about 2**-52).
# 2. Then HF's float32 angle is within angle * (2**-18 + 2**-24) of the exact one, its
#    float32 cos/sin within 2 float32 ulps (2**-22 near 1) of cos/sin of that angle
#    (torch uses SLEEF's 1.0-ulp functions or libm's, both within 2 ulps everywhere),
#    and the attention factor's float32 product adds 2**-24 relative. cos and sin move no
#    faster than the angle, so each element is within
#        a * (angle * 2**-17 + 2**-21)
#    of our float64 value (whose own error, about 2**-53, is far below), on every CPU.
#    The bound grows with the position, as the float32 rounding of the angle does.

INV_FREQ_RELATIVE = 2.0**-18


def transformers_modules():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    # torch's first cos of a process can be wrong: on a 2-core Intel AVX-512 VM
    # (torch 2.13.0+cpu, 2026-12-04), the first Tensor.cos() of a [1, 128, 32] float32
    # tensor returned its second half (elements 2048-4095) up to 1.5e-4 off in 5 of 40
    # fresh processes of a script of torch alone (numba_rope not imported), every later
    # call right; with one cos and sin of another tensor first, 0 of 40
    # (docs/performance.md, "Twenty-seventh session"). Those two calls first, so that
    # transformers' module is not the first.
    warm = torch.arange(4096, dtype=torch.float32).reshape(1, 128, 32) * 0.01
    warm.cos(), warm.sin()

    return types.SimpleNamespace(
        torch=torch,
        LlamaConfig=LlamaConfig,
        Phi3Config=Phi3Config,
        ROPE_INIT_FUNCTIONS=ROPE_INIT_FUNCTIONS,
        LlamaRotaryEmbedding=LlamaRotaryEmbedding,
        Phi3RotaryEmbedding=Phi3RotaryEmbedding,
    )


def transformers_cos_sin(module, seq_len, torch):
    """cos and sin of the rotary module's forward pass over positions 0 .. seq_len - 1
    (float32, as a model in float32 gets them), and the inverse frequencies it used."""
    x = torch.zeros(1, dtype=torch.float32)
    positions = torch.arange(seq_len)[None]
    with torch.no_grad():
        cos, sin = module(x, positions)
    return (
        cos[0].numpy().astype(np.float64),
        sin[0].numpy().astype(np.float64),
        module.inv_freq.numpy().astype(np.float64),
        module.attention_scaling,
    )


def assert_close_to_transformers(ours, theirs):
    our_cos, our_sin = ours
    cos, sin, inv_freq, attention = theirs
    rows, half = cos.shape[0], our_cos.shape[1]
    assert our_cos.shape[0] >= rows
    assert cos.shape[1] == 2 * half  # full width, the halves duplicated
    assert np.array_equal(cos[:, :half], cos[:, half:])
    # 1. The inverse frequencies (ours read back from row 1) and the attention factor.
    our_inv_freq = np.arctan2(our_sin[1], our_cos[1])
    assert np.all(np.abs(our_inv_freq - inv_freq) <= INV_FREQ_RELATIVE * inv_freq)
    assert abs(float(np.hypot(our_cos[0, 0], our_sin[0, 0])) - attention) <= 2.0**-50
    # 2. Ours against float64 NumPy, an oracle independent of both: cos/sin of p times
    #    our frequencies, times the factor. The frequencies read back above are within
    #    a few float64 ulps (atan2 of an angle below pi), so the oracle's angle is
    #    within angle * 2**-50 of ours, and NumPy's float64 cos/sin add a few ulps on
    #    every CPU: a * (angle + 1) * 2**-48 holds with room, and ours are closer still.
    positions = np.arange(our_cos.shape[0])[:, None]
    a = float(np.hypot(our_cos[0, 0], our_sin[0, 0]))
    our_angles = positions * our_inv_freq
    bound = a * (np.abs(our_angles) + 1.0) * 2.0**-48
    for ours_table, function in ((our_cos, np.cos), (our_sin, np.sin)):
        oracle = a * function(our_angles)
        worst = np.unravel_index(np.argmax(np.abs(ours_table - oracle) - bound), oracle.shape)
        assert np.all(np.abs(ours_table - oracle) <= bound), (
            f"ours off NumPy's {function.__name__} at {worst}: {ours_table[worst]} vs {oracle[worst]}"
        )
    # 3. The tables, within the float32 rounding of HF's computation. (A failure here,
    #    after 2 passed, is transformers' table off the bound: the message says where.)
    angles = np.arange(rows)[:, None] * inv_freq
    tolerance = attention * (angles * 2.0**-17 + 2.0**-21)
    for ours_table, theirs_table in ((our_cos, cos), (our_sin, sin)):
        error = np.abs(ours_table[:rows] - theirs_table[:, :half])
        worst = np.unravel_index(np.argmax(error - tolerance), error.shape)
        assert np.all(error <= tolerance), (
            f"transformers' table off ours at {worst}: {theirs_table[worst]} vs "
            f"{ours_table[worst]} (bound {tolerance[worst]:.3g}; inv_freq {inv_freq[worst[1]]!r})"
        )


LLAMA_CASES = {
    "default": {"rope_theta": 10000.0},
    "default, large base": {"rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    },
    "yarn, factor None": {
        "rope_type": "yarn",
        "factor": None,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    },
    "yarn, deepseek mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
        "rope_theta": 10000.0,
    },
    "yarn, no truncation": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "truncate": False,
        "rope_theta": 10000.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
}


@pytest.mark.parametrize("parameters", LLAMA_CASES.values(), ids=LLAMA_CASES.keys())
@pytest.mark.parametrize("form", ["config object", "config dict", "rope_parameters"])
def test_matches_transformers_llama(parameters, form):
    hf = transformers_modules()
    config = hf.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=128,
        rope_parameters=dict(parameters),
    )
    theirs = transformers_cos_sin(hf.LlamaRotaryEmbedding(config), 128, hf.torch)
    arguments = {
        "config object": {"config": config},
        "config dict": {"config": config.to_dict()},
        "rope_parameters": {
            "rope_parameters": parameters,
            "head_dim": 32,
            "max_position_embeddings": 128,
        },
    }[form]
    ours = numba_rope.rope_cache(**arguments, dtype=np.float64)
    assert ours[0].shape == (128, 16)
    assert_close_to_transformers(ours, theirs)


def test_matches_transformers_rope_init_functions():
    """transformers' frequency functions themselves, for every type they have that
    rope_cache builds, at a sequence length past the original context."""
    hf = transformers_modules()
    for rope_type, parameters in {
        "linear": {"factor": 2.0},
        "dynamic": {"factor": 4.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": 16},
        "longrope": {"short_factor": SHORT, "long_factor": LONG, "factor": 3.0},
        "llama3": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    }.items():
        config = hf.LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            max_position_embeddings=48,
            rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **parameters},
        )
        for seq_len in (None, 30, 100):
            inv_freq, attention = hf.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
            # transformers' None is the config's context, 48 (the cache rows here).
            cos, sin = numba_rope.rope_cache(
                config=config, seq_len=seq_len, dtype=np.float64, max_position=2
            )
            ours = np.arctan2(sin[1], cos[1])
            want = inv_freq.numpy().astype(np.float64)
            assert np.all(np.abs(ours - want) <= INV_FREQ_RELATIVE * want), (rope_type, seq_len)
            assert abs(float(np.hypot(cos[0, 0], sin[0, 0])) - attention) <= 2.0**-50


def test_matches_transformers_dynamic_as_the_sequence_grows():
    """transformers' dynamic NTK module over a series of forward passes: the cache of
    each is rope_cache(seq_len=S), S the longest length since the last pass shorter
    than max_position_embeddings (the rule the docstring gives)."""
    hf = transformers_modules()
    config = hf.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    )
    module = hf.LlamaRotaryEmbedding(config)
    longest = 0
    for length in (30, 64, 80, 120, 100, 64, 40, 90):
        longest = length if length < 64 else max(longest, length)
        theirs = transformers_cos_sin(module, length, hf.torch)
        ours = numba_rope.rope_cache(128, config=config, seq_len=longest, dtype=np.float64)
        assert_close_to_transformers(ours, theirs)
    # Growing changes every row, not only the new ones.
    grown = numba_rope.rope_cache(config=config, seq_len=120, dtype=np.float64)
    start = numba_rope.rope_cache(config=config, seq_len=80, dtype=np.float64)
    assert not np.array_equal(grown[0][1:], start[0][1:])


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.5])
def test_matches_transformers_phi3_longrope(partial_rotary_factor):
    """Phi-3's LongRoPE module: the short factors for a forward pass within the original
    context, the long ones past it, chosen anew at every pass."""
    hf = transformers_modules()
    rotary_dim = int(32 * partial_rotary_factor)
    short = [1.0 + i / 8 for i in range(rotary_dim // 2)]
    long = [1.0 + i for i in range(rotary_dim // 2)]
    config = hf.Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        partial_rotary_factor=partial_rotary_factor,
        rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long},
    )
    module = hf.Phi3RotaryEmbedding(config)
    for length in (40, 64, 65, 200, 50):
        theirs = transformers_cos_sin(module, length, hf.torch)
        ours = numba_rope.rope_cache(config=config, seq_len=length, dtype=np.float64)
        assert ours[0].shape == (256, rotary_dim // 2)
        assert_close_to_transformers(ours, theirs)
        # The cache of the whole context is the long one; short passes differ from it.
        assert np.array_equal(
            ours[0], numba_rope.rope_cache(config=config, dtype=np.float64)[0]
        ) == (length > 64)


@pytest.mark.parametrize("former", ["su", "yarn"])
def test_matches_transformers_phi3_former_names_of_longrope(former):
    """Phi3Config reads a type "su" or "yarn" (Phi-3's checkpoints before transformers
    named it) as LongRoPE, and keeps the former name under "type" beside rope_type
    "longrope": the config object, its to_dict() and the config.json it came from all
    give transformers' LongRoPE tables, not YaRN's, and are not refused."""
    hf = transformers_modules()
    short = [1.0 + i / 8 for i in range(16)]
    long = [1.0 + i for i in range(16)]
    fields = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": former, "short_factor": short, "long_factor": long},
    }
    config = hf.Phi3Config(**copy.deepcopy(fields))
    module = hf.Phi3RotaryEmbedding(config)
    assert module.rope_type == "longrope"
    for length in (40, 200):
        theirs = transformers_cos_sin(module, length, hf.torch)
        for form in (config, config.to_dict(), {"model_type": "phi3", **fields}):
            ours = numba_rope.rope_cache(config=form, seq_len=length, dtype=np.float64)
            assert_close_to_transformers(ours, theirs)


def test_a_multimodal_config_that_transformers_made_default_is_read():
    """Qwen2-VL's config class turns a 4.x rope_scaling of type "mrope" into rope_type
    "default" and keeps type "mrope" beside it: read as transformers reads it (the
    default table), not refused as two types."""
    pytest.importorskip("transformers")
    import transformers

    config = transformers.Qwen2VLConfig(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    text = getattr(config, "text_config", config)
    assert text.rope_parameters["rope_type"] == "default"
    assert text.rope_parameters["type"] == "mrope"
    head_dim = text.hidden_size // text.num_attention_heads
    want = numba_rope.rope_cache(6, head_dim, base=text.rope_parameters["rope_theta"])
    for form in (text, text.to_dict()):
        for got, expected in zip(numba_rope.rope_cache(6, config=form), want, strict=True):
            assert_bitwise_equal(got, expected)


def test_matches_transformers_phi3_partial_default():
    hf = transformers_modules()
    config = hf.Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=96,
        partial_rotary_factor=0.75,
        rope_theta=5000.0,
    )
    theirs = transformers_cos_sin(hf.Phi3RotaryEmbedding(config), 96, hf.torch)
    ours = numba_rope.rope_cache(config=config, dtype=np.float64)
    assert ours[0].shape == (96, 12)
    assert_close_to_transformers(ours, theirs)


def test_default_frequencies_match_the_decimal_oracle_through_a_config():
    """The float64 cache read from a config is the oracle's (independent of transformers)."""
    config = {"hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 24}
    oracle = oracle_caches(default_frequencies(32, 10000.0), 24)
    assert_matches_oracle(None, 24, 32, 10000.0, oracle)
    same_caches({"config": config}, {"max_position": 24, "rotary_dim": 32})
    yarn = oracle_caches(yarn_frequencies(32, 10000.0, 4.0, 6), 24, 0.1 * exact_log(4.0) + 1)
    cos, sin = numba_rope.rope_cache(
        config={**config, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 6}},
        dtype=np.float64,
    )
    tolerance = 8 * 2.0**-52 * (1 + np.abs(yarn.angles)) * 2
    assert np.all(np.abs(cos - yarn.cos) <= tolerance)
    assert np.all(np.abs(sin - yarn.sin) <= tolerance)
