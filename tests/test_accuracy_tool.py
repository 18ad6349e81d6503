"""``tools/accuracy.py``, whose table README's "Accuracy" quotes: its ulp measure, and
the claims made from it (numba_rope's 16-bit results are the nearest values; arithmetic
rounded after every operation is not)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest


@pytest.fixture(scope="module")
def accuracy(load_tool):
    return load_tool("accuracy")


@pytest.mark.parametrize(("dtype", "mantissa_bits"), [(np.float16, 10), (ml_dtypes.bfloat16, 7)])
def test_ulp_error_counts_steps_of_the_type(accuracy, dtype, mantissa_bits):
    exact = np.array([1.0, 1.5, -3.0])
    spacing = np.exp2(np.floor(np.log2(np.abs(exact))) - mantissa_bits)
    np.testing.assert_array_equal(accuracy.ulp_error(exact.astype(dtype), exact), [0, 0, 0])
    stepped = (exact + np.sign(exact) * spacing).astype(dtype)  # the next value of the type
    np.testing.assert_array_equal(accuracy.ulp_error(stepped, exact), [1, 1, 1])
    # Below the smallest normal, the spacing is the smallest subnormal.
    tiny = ml_dtypes.finfo(dtype).smallest_subnormal
    got = accuracy.ulp_error(np.array([tiny, 2 * tiny], dtype), np.array([0.0, 0.0]))
    np.testing.assert_array_equal(got, [1, 2])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numba_rope_gives_the_nearest_value_and_per_operation_rounding_does_not(accuracy, dtype):
    found = accuracy.measure(accuracy.DTYPES[dtype], positions=512, tokens=64)
    worst, _, not_nearest = found["numba_rope"]
    # float32 evaluation, then one rounding: products of two 16-bit values are exact
    # in float32 (at most 22 significant bits), their sum is rounded once (relative
    # error 2**-24), so the 16-bit result is at most half an ulp plus 2**-13 ulp
    # (float16) or 2**-16 ulp (bfloat16) from the exact value, on every CPU.
    assert worst <= 0.5 + 2.0**-10
    assert not_nearest == 0.0
    for name, (peer_worst, _, peer_not_nearest) in found.items():
        if "16 bits" in name:
            assert peer_worst > 2  # cancellation after rounded products
            assert peer_not_nearest > 0.05


def test_the_emulated_rounding_is_transformers_own(accuracy):
    pytest.importorskip("transformers")
    found = accuracy.measure(accuracy.DTYPES["bfloat16"], positions=512, tokens=64)
    assert (
        found["transformers apply_rotary_pos_emb"]
        == found["x*cos + rotate_half(x)*sin in 16 bits (HF, flash-attn torch)"]
    )
