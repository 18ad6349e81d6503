"""The remembered plans of NumPy calls (numba_rope.cpu_backend.PLANS).

A call whose signature (shapes, dtypes, options) was validated before runs a plan with
the least Python work. The plan must give the same bits as the general path, and must
never let through what the general path rejects: options of another type, bad position
ids, a read-only or overlapping ``out``, other strides.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import BFLOAT16, assert_bitwise_equal, float32_contract, make_case

import numba_rope
from numba_rope import config
from numba_rope._cpu import backend as cpu_backend
from numba_rope._cpu import kernels as cpu_kernels

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16]


@pytest.fixture(autouse=True)
def no_plans():
    cpu_backend.PLANS.clear()
    yield
    cpu_backend.PLANS.clear()


def _planned(x, cos, sin, ids, out, interleaved=False, rotary_dim=0, layout="bhsd"):
    key = cpu_backend.plan_key(
        x, None, cos, sin, ids, out, None, interleaved, rotary_dim, layout, None, None, False
    )
    return cpu_backend.PLANS.get(key) is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("with_ids", [True, False])
def test_plan_gives_the_contract_bits(rng, dtype, with_ids):
    x, cos, sin, ids = make_case(rng, (2, 3, 5, 8), dtype, position_ids=with_ids)
    expected = float32_contract(x, cos, sin, ids)
    first = numba_rope.rotary_embedding(x, cos, sin, ids)
    assert _planned(x, cos, sin, ids, None)
    # Other values of the same signature go through the plan.
    x2, cos2, sin2, ids2 = make_case(rng, (2, 3, 5, 8), dtype, position_ids=with_ids)
    if with_ids:
        cos2, sin2 = cos, sin  # same cache shape; new ids and input
    second = numba_rope.rotary_embedding(x2, cos2, sin2, ids2)
    assert_bitwise_equal(first, expected)
    assert_bitwise_equal(second, float32_contract(x2, cos2, sin2, ids2))
    out = np.full_like(x2, np.nan)
    assert numba_rope.rotary_embedding(x2, cos2, sin2, ids2, out=out) is out
    numba_rope.rotary_embedding(x2, cos2, sin2, ids2, out=out)  # planned with out=
    assert_bitwise_equal(out, float32_contract(x2, cos2, sin2, ids2))


def test_plan_bshd_3d_and_inverse(rng):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32)
    x_bshd = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    expected = float32_contract(x, cos, sin, ids).transpose(0, 2, 1, 3)
    for _ in range(2):  # the second call runs the plan
        y = numba_rope.rotary_embedding(x_bshd, cos, sin, ids, layout="bshd")
        assert_bitwise_equal(y, expected)
        y3 = numba_rope.rotary_embedding(x_bshd.reshape(2, 4, 24), cos, sin, ids, num_heads=3)
        assert_bitwise_equal(y3, expected.reshape(2, 4, 24))
        back = numba_rope.rotary_embedding(y, cos, sin, ids, layout="bshd", inverse=True)
        y_bhsd = y.transpose(0, 2, 1, 3)
        assert_bitwise_equal(back, float32_contract(y_bhsd, cos, -sin, ids).transpose(0, 2, 1, 3))
        assert np.allclose(back, x_bshd, atol=1e-5)


def test_plan_rejects_what_validation_rejects(rng):
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 4), np.float32, n_positions=6)
    numba_rope.rotary_embedding(x, cos, sin, ids)
    assert _planned(x, cos, sin, ids, None)
    # 1 == True and 4.0 == 4 hash alike; the plan must not take them.
    with pytest.raises(TypeError, match="interleaved"):
        numba_rope.rotary_embedding(x, cos, sin, ids, interleaved=1)
    numba_rope.rotary_embedding(x, cos, sin, ids, rotary_embedding_dim=4)
    with pytest.raises(TypeError, match="rotary_embedding_dim"):
        numba_rope.rotary_embedding(x, cos, sin, ids, rotary_embedding_dim=4.0)
    # Bad ids: IndexError naming the value; out untouched.
    out = np.full_like(x, 7.0)
    numba_rope.rotary_embedding(x, cos, sin, ids, out=out)
    out[...] = 7.0
    bad = ids.copy()
    bad[0, 2] = 6
    with pytest.raises(IndexError, match="6"):
        numba_rope.rotary_embedding(x, cos, sin, bad, out=out)
    assert np.all(out == 7.0)
    # A read-only out.
    frozen = np.empty_like(x)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        numba_rope.rotary_embedding(x, cos, sin, ids, out=frozen)


def test_plan_handles_overlap_and_other_strides(rng):
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 8), np.float32)
    expected = float32_contract(x, cos, sin, ids)
    out = np.empty_like(x)
    numba_rope.rotary_embedding(x, cos, sin, ids, out=out)
    assert _planned(x, cos, sin, ids, out)
    # Same shapes, but out overlapping the input one element off: the general path
    # copies the input first.
    buffer = np.zeros(x.size + 1, np.float32)
    buffer[:-1] = x.reshape(-1)
    x_view = buffer[:-1].reshape(x.shape)
    out_view = buffer[1:].reshape(x.shape)
    numba_rope.rotary_embedding(x_view, cos, sin, ids, out=out_view)
    assert_bitwise_equal(out_view, expected)
    # Same shapes, every other element of a wider array (not unit stride).
    wide = np.zeros((*x.shape[:-1], 16), np.float32)
    wide[..., ::2] = x
    strided_out = np.zeros_like(wide)
    numba_rope.rotary_embedding(wide[..., ::2], cos, sin, ids, out=strided_out[..., ::2])
    assert_bitwise_equal(strided_out[..., ::2], expected)
    assert np.all(strided_out[..., 1::2] == 0)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BFLOAT16], ids=["float32", "bfloat16"])
def test_qk_plan_equals_two_calls(rng, dtype):
    q, cos, sin, ids = make_case(rng, (2, 4, 3, 8), dtype)
    k = rng.standard_normal((2, 2, 3, 8)).astype(dtype)
    expected = (float32_contract(q, cos, sin, ids), float32_contract(k, cos, sin, ids))
    for _ in range(2):  # the second call runs the plan
        got = numba_rope.rotary_embedding_qk(q, k, cos, sin, ids)
        assert_bitwise_equal(got[0], expected[0])
        assert_bitwise_equal(got[1], expected[1])
    out_q, out_k = np.empty_like(q), np.empty_like(k)
    for _ in range(2):
        numba_rope.rotary_embedding_qk(q, k, cos, sin, ids, out_q=out_q, out_k=out_k)
        assert_bitwise_equal(out_q, expected[0])
        assert_bitwise_equal(out_k, expected[1])
    with pytest.raises(ValueError, match="share memory"):
        numba_rope.rotary_embedding_qk(q, k, cos, sin, ids, out_q=out_q, out_k=out_q[:, :2])


def test_plans_table_is_bounded(rng, monkeypatch):
    monkeypatch.setattr(cpu_backend, "MAX_PLANS", 3)
    for seq_len in range(1, 6):
        x, cos, sin, ids = make_case(rng, (1, 1, seq_len, 4), np.float32)
        numba_rope.rotary_embedding(x, cos, sin, ids)
    assert 1 <= len(cpu_backend.PLANS) <= 3


def test_plan_with_an_integer_offset(rng):
    x, cos, sin, _ = make_case(rng, (2, 3, 4, 8), np.float16, n_positions=12)
    for offset in (0, 5, 8, 3):  # the plan is made by the first call, run by the others
        ids = np.full((2, 4), offset) + np.arange(4)
        got = numba_rope.rotary_embedding(x, cos, sin, position_offset=offset)
        assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))
    key = cpu_backend.plan_key(
        x, None, cos, sin, None, None, None, False, 0, "bhsd", None, None, False, 3
    )
    assert cpu_backend.PLANS.get(key) is not None
    with pytest.raises(IndexError, match="9"):
        numba_rope.rotary_embedding(x, cos, sin, position_offset=9)  # rows 9..12 of 12
    with pytest.raises(IndexError):
        numba_rope.rotary_embedding(x, cos, sin, position_offset=2**70)


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_plan_in_place(rng, dtype):
    # out is the input: the in-place kernels (one array for reading and writing).
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 16), dtype)
    k = rng.standard_normal((2, 1, 4, 16)).astype(dtype)
    for _ in range(2):  # the second call runs the plan
        expected = float32_contract(x, cos, sin, ids)
        assert numba_rope.rotary_embedding(x, cos, sin, ids, out=x) is x
        assert_bitwise_equal(x, expected)
        expected_q, expected_k = (float32_contract(a, cos, sin, ids) for a in (x, k))
        numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, out_q=x, out_k=k)
        assert_bitwise_equal(x, expected_q)
        assert_bitwise_equal(k, expected_k)


def test_qk_plan_with_an_integer_offset_in_place_on_a_fused_buffer(rng):
    # The Llama decode step: q and k views of one qkv buffer, rotated in place, bshd.
    _, cos, sin, _ = make_case(rng, (1, 1, 1, 8), np.float32, n_positions=20)
    for offset in (3, 7, 11):
        qkv = rng.standard_normal((2, 1, 4 * 8 + 2 * 8 + 2 * 8)).astype(np.float32)
        q = qkv[..., :32].reshape(2, 1, 4, 8)
        k = qkv[..., 32:48].reshape(2, 1, 2, 8)
        ids = np.full((2, 1), offset)
        expected_q = float32_contract(q.transpose(0, 2, 1, 3), cos, sin, ids).transpose(0, 2, 1, 3)
        expected_k = float32_contract(k.transpose(0, 2, 1, 3), cos, sin, ids).transpose(0, 2, 1, 3)
        v_before = qkv[..., 48:].copy()
        numba_rope.rotary_embedding_qk(
            q, k, cos, sin, position_offset=offset, layout="bshd", out_q=q, out_k=k
        )
        assert_bitwise_equal(q, expected_q)
        assert_bitwise_equal(k, expected_k)
        assert np.array_equal(qkv[..., 48:], v_before)
    with pytest.raises(IndexError):
        numba_rope.rotary_embedding_qk(q, k, cos, sin, position_offset=20, layout="bshd")


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("which", ["q", "k", "both", "neither"])
def test_qk_with_one_of_q_and_k_in_place(rng, monkeypatch, which, parallel):
    # A decode step that rotates q in place and writes k elsewhere (a KV-cache slot):
    # the kernels read and write q through one array (their in-place flag), else
    # LLVM's overlap test fails for equal pointers and takes the scalar loop. The
    # flags reach the kernels on the plan path and on the general path alike.
    if parallel:
        monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 1)
    requested = []
    kernels = cpu_backend.kernels

    def recording(*args):
        requested.append(args[3])
        return kernels(*args)

    monkeypatch.setattr(cpu_backend, "kernels", recording)
    _, cos, sin, ids = make_case(rng, (2, 4, 3, 16), BFLOAT16)
    for _ in range(2):  # the second call runs the plan
        q = rng.standard_normal((2, 4, 3, 16)).astype(BFLOAT16)
        k = rng.standard_normal((2, 2, 3, 16)).astype(BFLOAT16)
        expected_q, expected_k = (float32_contract(a, cos, sin, ids) for a in (q, k))
        out_q = q if which in ("q", "both") else np.empty_like(q)
        out_k = k if which in ("k", "both") else np.empty_like(k)
        numba_rope.rotary_embedding_qk(q, k, cos, sin, ids, out_q=out_q, out_k=out_k)
        assert_bitwise_equal(out_q, expected_q)
        assert_bitwise_equal(out_k, expected_k)
    flags = {"q": cpu_kernels.FIRST_IN_PLACE, "k": cpu_kernels.SECOND_IN_PLACE, "neither": 0}
    flags["both"] = cpu_kernels.FIRST_IN_PLACE + cpu_kernels.SECOND_IN_PLACE
    assert requested and set(requested) == {flags[which]}
