"""numba_rope.reference: every keyword of the operator, and the contract mode.

The keywords are checked against the basic reference on transformed arguments (a
transposed input, ids built from an offset, a negated sine); ``precision="contract"``
against the tests' own float32-contract oracle (tests/oracles.py), bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import DTYPES, assert_bitwise_equal, float32_contract, make_case

import numba_rope
from numba_rope import reference

IDS = [d.name for d in DTYPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_layouts_offsets_and_inverse_equal_the_basic_reference(rng, dtype, interleaved):
    x, cos, sin, _ = make_case(rng, (2, 3, 4, 8), dtype, rotary_dim=6)
    options = {"interleaved": interleaved, "rotary_embedding_dim": 6}
    offsets = np.array([1, 3])
    ids = offsets[:, None] + np.arange(4)
    basic = reference.rotary_embedding(x, cos, sin, ids, **options)
    assert_bitwise_equal(
        reference.rotary_embedding(x, cos, sin, position_offset=offsets, **options), basic
    )
    bshd = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    got = reference.rotary_embedding(bshd, cos, sin, ids, layout="bshd", **options)
    assert_bitwise_equal(got, basic.transpose(0, 2, 1, 3))
    flat = bshd.reshape(2, 4, 24)
    got = reference.rotary_embedding(flat, cos, sin, ids, num_heads=3, **options)
    assert_bitwise_equal(got, basic.transpose(0, 2, 1, 3).reshape(2, 4, 24))
    inverse = reference.rotary_embedding(x, cos, sin, ids, inverse=True, **options)
    assert_bitwise_equal(inverse, reference.rotary_embedding(x, cos, -sin, ids, **options))
    scalar = reference.rotary_embedding(x, cos, sin, position_offset=2, **options)
    assert_bitwise_equal(
        scalar,
        reference.rotary_embedding(x, cos, sin, np.full((2, 1), 2) + np.arange(4), **options),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("with_ids", [True, False])
def test_contract_mode_is_the_contract_bit_for_bit(rng, dtype, with_ids):
    x, cos, sin, ids = make_case(rng, (2, 3, 5, 12), dtype, position_ids=with_ids, rotary_dim=8)
    for interleaved in (False, True):
        want = float32_contract(x, cos, sin, ids, interleaved, 8)
        got = reference.rotary_embedding(
            x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=8, precision="contract"
        )
        assert_bitwise_equal(got, want)
        # What the kernels promise: the CPU result equals it bit for bit.
        kernel = numba_rope.rotary_embedding(
            x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=8
        )
        assert_bitwise_equal(kernel, got)


def test_contract_and_float64_differ_by_at_most_one_unit_in_16_bits(rng):
    # A user checking a bfloat16 step against the float64 reference sees rare one-unit
    # differences; against precision="contract" there are none.
    x, cos, sin, ids = make_case(rng, (4, 8, 16, 64), np.dtype("float16"))
    exact = reference.rotary_embedding(x, cos, sin, ids).astype(np.float64)
    contract = reference.rotary_embedding(x, cos, sin, ids, precision="contract")
    ulp = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(contract.astype(np.float64) - exact) <= ulp)


def test_reference_argument_errors(rng):
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="precision must be one of"):
        reference.rotary_embedding(x, cos, sin, ids, precision="float32")
    with pytest.raises(ValueError, match="not both"):
        reference.rotary_embedding(x, cos, sin, ids, position_offset=0)
    with pytest.raises(IndexError, match="position ids must lie in"):
        reference.rotary_embedding(x, cos, sin, position_offset=cos.shape[0])
