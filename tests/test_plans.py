"""The remembered plans of NumPy calls (numba_rope.cpu_backend.PLANS), and the
compiled plans of small calls repeated (numba_rope.cpu_backend.FAST).

A call whose signature (shapes, dtypes, options) was validated before runs a plan with
the least Python work; a small call of one tensor repeated runs its compiled plan,
checked and rotated in one numba call. Plans must give the same bits as the general
path, and must never let through what the general path rejects: options of another
type, bad position ids, a read-only or overlapping ``out``, other strides or dtypes.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from oracles import BFLOAT16, assert_bitwise_equal, float32_contract, make_case
from plan_counting import counting_plans

import numba_rope
from numba_rope import config
from numba_rope._aligned import empty_on_line
from numba_rope._cpu import backend as cpu_backend
from numba_rope._cpu import kernels as cpu_kernels
from numba_rope._cpu import pool
from numba_rope._cpu.vector import words_fill_lines

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16]


@pytest.fixture(autouse=True)
def no_plans():
    cpu_backend._forget_fast()  # both tables: Python plans and compiled ones
    yield
    cpu_backend._forget_fast()


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


@pytest.fixture
def in_place_flags(monkeypatch):
    """The in-place flags (``FIRST_IN_PLACE`` + ``SECOND_IN_PLACE``) of every kernel
    choice made meanwhile, in order."""
    requested = []
    kernels = cpu_backend.kernels

    def recording(*args):
        requested.append(args[3])
        return kernels(*args)

    monkeypatch.setattr(cpu_backend, "kernels", recording)
    return requested


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("which", ["q", "k", "both", "neither"])
def test_qk_with_one_of_q_and_k_in_place(rng, monkeypatch, in_place_flags, which, parallel):
    # A decode step that rotates q in place and writes k elsewhere (a KV-cache slot):
    # the kernels read and write q through one array (their in-place flag), else
    # LLVM's overlap test fails for equal pointers and takes the scalar loop. The
    # flags reach the kernels on the plan path and on the general path alike.
    if parallel:
        monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 1)
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
    assert in_place_flags and set(in_place_flags) == {flags[which]}


@pytest.mark.parametrize("form", ["x[...]", "buffer[i] twice", "read-only input", "k of q and k"])
def test_in_place_through_another_view_runs_the_in_place_kernels(rng, in_place_flags, form):
    # An output that is another array over the input's very elements (the same address,
    # shape and strides): the general path runs the in-place kernels, given the output
    # as the input (it is writable; the input need not be). The two-pointer kernels
    # give the same bits there, but their vector loops test the pointers for overlap
    # and take the scalar code. Channels past rotary_dim and the buffer's other entries
    # stay as they were.
    _, cos, sin, ids = make_case(rng, (2, 4, 3, 16), np.float16, rotary_dim=8)
    buffer = rng.standard_normal((3, 2, 4, 3, 16)).astype(np.float16)
    before = buffer.copy()
    x, out = buffer[1], buffer[1]  # two view objects of one memory
    if form == "x[...]":
        out = x[...]
    elif form == "read-only input":
        x.flags.writeable = False
    expected = float32_contract(before[1], cos, sin, ids, rotary_embedding_dim=8)
    if form == "k of q and k":
        q = rng.standard_normal((2, 4, 3, 16)).astype(np.float16)
        out_q = np.empty_like(q)
        numba_rope.rotary_embedding_qk(
            q, x, cos, sin, ids, out_q=out_q, out_k=out, rotary_embedding_dim=8
        )
        assert_bitwise_equal(out_q, float32_contract(q, cos, sin, ids, rotary_embedding_dim=8))
        flag = cpu_kernels.SECOND_IN_PLACE
    else:
        result = numba_rope.rotary_embedding(x, cos, sin, ids, out=out, rotary_embedding_dim=8)
        assert result is out
        flag = cpu_kernels.FIRST_IN_PLACE
    assert_bitwise_equal(buffer[1], expected)
    assert np.array_equal(buffer[[0, 2]], before[[0, 2]])
    assert in_place_flags == [flag]


# -- compiled plans ----------------------------------------------------------------------


@pytest.fixture
def fast_runs(monkeypatch):
    """The calls that ran by a compiled plan, counted ``[ran, fell back]``, for one
    tensor (``"one"``) and for q and k (``"qk"``)."""
    counts = {"one": [0, 0], "qk": [0, 0]}

    def note(kind, ran):
        counts[kind][not ran] += 1

    monkeypatch.setattr(cpu_backend, "FAST", counting_plans(note))
    return counts


def _repeat(call, times=cpu_backend.FAST_AFTER + 2):
    """Run ``call`` often enough for its signature to get a compiled plan, and once
    more by it; return the last result."""
    for _ in range(times):
        result = call()
    return result


@pytest.mark.parametrize("dtype", [*DTYPES, np.dtype(np.float64)], ids=lambda d: d.name)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"interleaved": True},
        {"rotary_embedding_dim": 8, "inverse": True},
        {"position_ids": False},
        {"out": "in place"},
        {"out": "given", "position_ids": "int32"},
        {"shape": (3, 4, 1, 16)},  # a decode step: the token-major kernels
    ],
    ids=["plain", "interleaved", "partial-inverse", "no-ids", "in-place", "out-int32", "decode"],
)
def test_compiled_plan_gives_the_contract_bits(rng, fast_runs, dtype, options):
    options = dict(options)
    shape = options.pop("shape", (2, 3, 5, 16))
    ids_kind = options.pop("position_ids", True)
    out_kind = options.pop("out", None)
    rotary_dim = options.get("rotary_embedding_dim", 0)
    inverse = options.get("inverse", False)
    interleaved = options.get("interleaved", False)
    _, cos, sin, ids = make_case(
        rng, shape, dtype, position_ids=bool(ids_kind), rotary_dim=rotary_dim
    )
    if ids_kind == "int32":
        ids = ids.astype(np.int32)
    for _ in range(cpu_backend.FAST_AFTER + 3):  # a new input each call
        x = rng.standard_normal(shape).astype(dtype)
        expected = float32_contract(x, cos, -sin if inverse else sin, ids, interleaved, rotary_dim)
        out = {"in place": x, "given": np.full_like(x, np.nan), None: None}[out_kind]
        got = numba_rope.rotary_embedding(x, cos, sin, ids, out=out, **options)
        if out is not None:
            assert got is out
        assert_bitwise_equal(got, expected)
    assert fast_runs == {"one": [2, 0], "qk": [0, 0]}  # the last two calls, by the plan


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=[d.name for d in DTYPES[1:]])
@pytest.mark.parametrize("two", [False, True], ids=["one", "qk"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_compiled_plan_of_16bit_input_and_float32_caches_gives_the_contract_bits(
    rng, fast_runs, dtype, two, layout
):
    # The 16-bit input goes to the compiled function as it is, the float32 caches too:
    # the bits are the contract's (caches widened exactly, one rounding of the result).
    shape = (2, 3, 4, 16)
    _, cos, sin, ids = make_case(rng, shape, np.float32, n_positions=9)
    k_shape = (2, 1, 4, 16)
    for _ in range(cpu_backend.FAST_AFTER + 3):  # new values each call
        x4 = rng.standard_normal(shape).astype(dtype)
        k4 = rng.standard_normal(k_shape).astype(dtype)
        x, k = (a if layout == "bhsd" else a.transpose(0, 2, 1, 3).copy() for a in (x4, k4))
        if two:
            got = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, layout=layout)
        else:
            got = (numba_rope.rotary_embedding(x, cos, sin, ids, layout=layout),)
        if layout == "bshd":
            got = tuple(g.transpose(0, 2, 1, 3) for g in got)
        for g, want in zip(got, (x4, k4), strict=False):
            assert g.dtype == dtype
            assert_bitwise_equal(g, float32_contract(want, cos, sin, ids))
    assert fast_runs["qk" if two else "one"] == [2, 0]  # the last two calls, by the plan


def _outcome(call):
    """What a call gives: its results' bytes, or its exception's type and message."""
    try:
        result = call()
    except Exception as error:  # compared, not swallowed
        return type(error), str(error)
    results = result if isinstance(result, tuple) else (result,)
    return [(r.dtype, r.shape, r.tobytes()) for r in results]


def _assert_same_without_plans(calls, with_plan):
    """Each of ``calls`` gives, with every plan forgotten (the general path alone), what
    it gave with the plans (``with_plan``, by :func:`_outcome`)."""
    for name, call in calls.items():
        cpu_backend._forget_fast()
        assert with_plan[name] == _outcome(call), name


def test_compiled_plan_leaves_other_calls_to_the_general_path(rng, fast_runs):
    # Calls that look like the planned one (same input shape, dtype and options) but
    # are not: each gives what it gives without any plan, having written nothing
    # before the general path took over.
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 16), np.float32, n_positions=10)
    out = np.empty_like(x)
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids, out=out))
    assert fast_runs["one"][0] >= 1
    bad_ids = ids.copy()
    bad_ids[1, 2] = 10
    frozen = np.empty_like(x)
    frozen.flags.writeable = False

    def one_element_off():  # a fresh buffer each time: the call writes into its input
        buffer = np.zeros(x.size + 1, np.float32)
        buffer[:-1] = x.reshape(-1)
        return numba_rope.rotary_embedding(
            buffer[:-1].reshape(x.shape), cos, sin, ids, out=buffer[1:].reshape(x.shape)
        )

    wide = np.zeros((*x.shape[:-1], 32), np.float32)
    wide[..., ::2] = x
    transposed = np.empty((2, 4, 3, 16), np.float32).transpose(0, 2, 1, 3)  # rows contiguous
    self_overlapping = np.lib.stride_tricks.as_strided(  # elements 0 and 1 share bytes
        np.empty(x.size, np.float32), x.shape, (0, *x.strides[1:])
    )
    cos_wide = np.zeros((10, 16), np.float32)
    cos_wide[:, ::2] = cos
    calls = {
        "bad ids": lambda: numba_rope.rotary_embedding(x, cos, sin, bad_ids, out=out),
        "read-only out": lambda: numba_rope.rotary_embedding(x, cos, sin, ids, out=frozen),
        "out one element off the input": one_element_off,
        "strided rows": lambda: numba_rope.rotary_embedding(wide[..., ::2], cos, sin, ids),
        "out overlapping itself": lambda: numba_rope.rotary_embedding(
            x, cos, sin, ids, out=self_overlapping
        ),
        "strided cache rows": lambda: numba_rope.rotary_embedding(
            x, cos_wide[:, ::2], sin, ids, out=out
        ),
        "more cache rows": lambda: numba_rope.rotary_embedding(
            x, np.vstack([cos, cos]), np.vstack([sin, sin]), ids, out=out
        ),
        "ids of other shape": lambda: numba_rope.rotary_embedding(x, cos, sin, ids[:, :2], out=out),
        "float16 out": lambda: numba_rope.rotary_embedding(
            x, cos, sin, ids, out=np.empty(x.shape, np.float16)
        ),
        "float64 sin": lambda: numba_rope.rotary_embedding(
            x, cos, sin.astype(np.float64), ids, out=out
        ),
    }
    others = {  # not even found: the caches' and ids' dtypes are part of the key
        "float64 caches": lambda: numba_rope.rotary_embedding(
            x, cos.astype(np.float64), sin.astype(np.float64), ids, out=out
        ),
        "big-endian caches": lambda: numba_rope.rotary_embedding(
            x, cos.astype(">f4"), sin.astype(">f4"), ids, out=out
        ),
        "a list for cos": lambda: numba_rope.rotary_embedding(x, cos.tolist(), sin, ids, out=out),
        "int32 ids": lambda: numba_rope.rotary_embedding(
            x, cos, sin, ids.astype(np.int32), out=out
        ),
    }
    ran = fast_runs["one"][0]
    with_plan = {name: _outcome(call) for name, call in calls.items()}
    assert fast_runs["one"] == [ran, len(calls)]  # each call was tried by the plan, refused
    with_plan.update({name: _outcome(call) for name, call in others.items()})
    assert fast_runs["one"] == [ran, len(calls)]
    calls.update(others)
    assert cpu_backend.FAST
    _assert_same_without_plans(calls, with_plan)
    assert with_plan["bad ids"][0] is IndexError
    assert with_plan["read-only out"][0] is ValueError
    assert with_plan["out overlapping itself"][0] is ValueError
    # An out of other strides whose elements are apart is the plan's call, though.
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids, out=out))
    ran = fast_runs["one"][0]
    assert numba_rope.rotary_embedding(x, cos, sin, ids, out=transposed) is transposed
    assert fast_runs["one"][0] == ran + 1
    assert_bitwise_equal(transposed, float32_contract(x, cos, sin, ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("two", [False, True], ids=["one", "qk"])
@pytest.mark.parametrize("with_ids", [True, False], ids=["ids", "no-ids"])
def test_compiled_plan_refuses_arrays_of_other_axes_and_read_only_outputs(
    rng, fast_runs, dtype, two, with_ids
):
    # A compiled plan calls its compiled function directly, with 16-bit arrays as they
    # are, after checking in Python what numba's dispatch would have checked by type:
    # caches, ids and outputs of another number of axes (the compiled function would
    # unbox them as arrays of its own number of axes, past the end of its shape),
    # read-only outputs. Each such call is refused, then gives what the general path
    # gives with no plan (an error here), and leaves every output as it was.
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 16), dtype, n_positions=10, position_ids=with_ids)
    k = rng.standard_normal((2, 1, 4, 16)).astype(dtype)
    out, out_k = np.zeros_like(x), np.zeros_like(k)

    def call(x=x, cos=cos, sin=sin, ids=ids, out=out, out_k=out_k):
        if two:
            return numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, out_q=out, out_k=out_k)
        return numba_rope.rotary_embedding(x, cos, sin, ids, out=out)

    kind = "qk" if two else "one"
    _repeat(call)
    assert fast_runs[kind][0] >= 1
    out[...], out_k[...] = 0, 0
    frozen = np.zeros_like(x)
    frozen.flags.writeable = False
    calls = {
        "caches of one axis more": lambda: call(cos=cos[None], sin=sin[None]),
        "cos of one axis less": lambda: call(cos=cos.reshape(-1)),
        "sin of one axis more": lambda: call(sin=sin[None]),
        "out of one axis more": lambda: call(out=out[None]),
        "out of one axis less": lambda: call(out=out.reshape(-1, *x.shape[2:])),
        "read-only out": lambda: call(out=frozen),
    }
    if with_ids:
        calls["ids of one axis less"] = lambda: call(ids=ids.reshape(-1))
        calls["ids of one axis more"] = lambda: call(ids=ids[None])
    if two:
        frozen_k = np.zeros_like(k)
        frozen_k.flags.writeable = False
        calls["out_k of one axis more"] = lambda: call(out_k=out_k[None])
        calls["read-only out_k"] = lambda: call(out_k=frozen_k)
    ran, refused = fast_runs[kind]
    with_plan = {name: _outcome(call) for name, call in calls.items()}
    assert fast_runs[kind] == [ran, refused + len(calls)]  # each found, each refused
    assert not out.any() and not out_k.any() and not frozen.any()
    _assert_same_without_plans(calls, with_plan)
    for name, outcome in with_plan.items():
        assert outcome[0] in (ValueError, IndexError), (name, outcome)
    assert "read-only" in with_plan["read-only out"][1]


def test_compiled_plan_writes_nothing_when_it_refuses(rng):
    # The compiled function alone: a bad id or an overlapping output is refused before
    # any element is written (the general path then raises or copies).
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 8), np.float32, n_positions=4)
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids))
    (fast,) = cpu_backend.FAST.values()
    plan = fast[1]
    out = np.full_like(x, 7.0)
    bad = ids.copy()
    bad[0, 1] = -1
    assert cpu_kernels.planned(x, None, cos, sin, bad, out, None, plan) == cpu_kernels.NOT_PLANNED
    assert cpu_kernels.planned(x, None, cos, sin, ids, x[:, ::-1], None, plan) == (
        cpu_kernels.NOT_PLANNED
    )
    assert np.all(out == 7.0)
    assert cpu_kernels.planned(x, None, cos, sin, ids, out, None, plan) == cpu_kernels.DONE
    assert_bitwise_equal(out, float32_contract(x, cos, sin, ids))


def test_compiled_plans_are_forgotten_when_a_constant_changes(rng, monkeypatch, fast_runs):
    # A plan holds the thresholds' choice and the work split of the constants of its time.
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 8), np.float32)
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids))
    assert cpu_backend.FAST
    original = config.HELPER_MIN_ELEMENTS
    monkeypatch.setattr(config, "HELPER_MIN_ELEMENTS", 0)
    assert not cpu_backend.FAST
    got = _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids))
    assert cpu_backend.FAST  # a plan of the helper's size now (shared when it can be)
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))
    # The constant back: the signature gets its compiled plan again.
    config.HELPER_MIN_ELEMENTS = original
    ran = fast_runs["one"][0]
    got = _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids))
    assert cpu_backend.FAST and fast_runs["one"][0] == ran + 1
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


def test_calls_in_place_after_calls_out_of_place_get_a_compiled_plan_too(rng, fast_runs):
    # One Python plan serves both; each gets a compiled plan of its own, whichever
    # came first.
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 8), np.float32)
    out = np.empty_like(x)
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids, out=out))
    ran = fast_runs["one"][0]

    def in_place():
        y = x.copy()
        return numba_rope.rotary_embedding(y, cos, sin, ids, out=y)

    got = _repeat(in_place)  # the Python plan exists: 8 calls count down, 2 run compiled
    assert len(cpu_backend.FAST) == 2 and fast_runs["one"][0] == ran + 2
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


def test_signatures_forgotten_when_the_table_is_full_get_compiled_plans_again(
    rng, monkeypatch, fast_runs
):
    monkeypatch.setattr(cpu_backend, "MAX_PLANS", 2)
    cases = [make_case(rng, (1, 2, seq_len, 8), np.float32) for seq_len in (1, 2, 3)]
    for x, cos, sin, ids in cases:  # the third's plan empties the full table
        _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids))  # noqa: B023
    assert len(cpu_backend.FAST) == 1
    x, cos, sin, ids = cases[0]
    ran = fast_runs["one"][0]
    got = _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids))
    assert len(cpu_backend.FAST) == 2 and fast_runs["one"][0] == ran + 1
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


@pytest.mark.parametrize(
    ("two", "dtype"),
    [(False, np.dtype(np.float32)), (True, np.dtype(np.float32)), (True, BFLOAT16)],
    ids=["one-float32", "qk-float32", "qk-bfloat16"],
)
def test_compiled_plans_of_the_helpers_size_share_while_the_helper_is_usable(
    rng, monkeypatch, two, dtype
):
    """A signature at the helper's threshold gets a compiled plan whatever the thread
    count when it is made; each call shares its chunks with the helper when this
    thread may use more than one numba thread at that moment, else runs alone, as the
    general path decides: the same bits either way."""
    from numba_rope._cpu import helper, relay

    x, cos, sin, ids = make_case(rng, (2, 4, 3, 8), dtype, n_positions=12)
    k = rng.standard_normal((2, 2, 3, 8)).astype(dtype)
    monkeypatch.setattr(config, "HELPER_MIN_ELEMENTS", x.size)
    monkeypatch.setattr(config, "HELPER_CHUNKS_PER_THREAD", 4)  # several chunks to share
    shared_runs = []

    class Counted:  # a dispatcher whose compiled entry points count their calls
        def __init__(self, dispatcher):
            self.dispatcher = dispatcher

        def compile(self, kinds):
            entry = self.dispatcher.compile(kinds)
            return lambda *a: shared_runs.append(1) or entry(*a)

    for name in ("planned_shared_one", "planned_shared"):
        monkeypatch.setattr(cpu_backend, name, Counted(getattr(cpu_backend, name)))
    if two:
        want = (float32_contract(x, cos, sin, ids), float32_contract(k, cos, sin, ids))

        def call():
            return numba_rope.rotary_embedding_qk(x, k, cos, sin, ids)
    else:
        want = (float32_contract(x, cos, sin, ids),)

        def call():
            return (numba_rope.rotary_embedding(x, cos, sin, ids),)

    monkeypatch.setattr(helper, "thread_count", lambda: 1)
    for got, expected in zip(_repeat(call), want, strict=True):
        assert_bitwise_equal(got, expected)
    assert len(cpu_backend.FAST) == 1 and not shared_runs  # made, run alone
    monkeypatch.setattr(helper, "thread_count", lambda: 2)
    for _ in range(3):
        for got, expected in zip(call(), want, strict=True):
            assert_bitwise_equal(got, expected)
    assert len(shared_runs) == 3 and len(cpu_backend.FAST) == 1
    # Another caller's job in the helper's block, then a helper without a core of late
    # (a futex: Linux): the plan runs alone through its own block, as relayed does.
    block = helper.helper().block
    misses = block[relay.MISSES]
    block[relay.OWNER] = 1
    try:
        for got, expected in zip(call(), want, strict=True):
            assert_bitwise_equal(got, expected)
        assert block[relay.OWNER] == 1 and block[relay.MISSES] == misses  # untouched
    finally:
        block[relay.OWNER] = 0
    if block[relay.SYSCALL]:
        # As after MISSES_BEFORE_ALONE misses (the count of the helper's moves taken
        # then; moves off the caller's CPU turned off, so that none makes it share).
        getcpu = block[relay.GETCPU]
        block[relay.GETCPU] = 0
        block[relay.MISSES], block[relay.SKIPPED] = relay.MISSES_BEFORE_ALONE, 10
        block[relay.MOVES_SEEN] = block[relay.MOVES]
        try:
            for got, expected in zip(call(), want, strict=True):
                assert_bitwise_equal(got, expected)
            assert block[relay.OWNER] == 0 and block[relay.SKIPPED] == 11  # released
            assert block[relay.MISSES] == relay.MISSES_BEFORE_ALONE  # no job finished
        finally:
            block[relay.MISSES] = block[relay.SKIPPED] = 0
            block[relay.GETCPU] = getcpu
    assert len(shared_runs) == 5


def _heads_inside(x, form):
    """``x`` (bhsd) as the caller of ``form`` holds it, with the keywords of the form."""
    batch, heads, seq_len, head_size = x.shape
    if form == "bhsd":
        return x, {}
    bshd = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    if form == "bshd":
        return bshd, {"layout": "bshd"}
    return bshd.reshape(batch, seq_len, heads * head_size), {"num_heads": heads}


def _as_bhsd(array, form, heads):
    if form == "bhsd":
        return array
    batch, seq_len = array.shape[:2]
    return array.reshape(batch, seq_len, heads, -1).transpose(0, 2, 1, 3)


# Each form in float32, and one in the 16-bit formats too: what a compiled plan does
# for them (16-bit arrays as integer views) does not depend on the form, and every
# case compiles kernels of its own (the suite's time is mostly compiling).
_FORMS = [
    ("bshd", "ids", np.dtype(np.float32)),
    ("3-D", "ids", np.dtype(np.float32)),
    ("bhsd", "offset", np.dtype(np.float32)),
    ("bhsd", "offsets", np.dtype(np.float32)),
    ("bshd", "offsets", np.dtype(np.float32)),
    ("3-D", "offset", np.dtype(np.float32)),
    ("bshd", "none", np.dtype(np.float32)),
    ("bshd", "offsets", np.dtype(np.float16)),
    ("bshd", "offsets", BFLOAT16),
]


@pytest.mark.parametrize(
    ("form", "positions", "dtype"), _FORMS, ids=[f"{f}-{p}-{d.name}" for f, p, d in _FORMS]
)
def test_compiled_plans_of_every_form_give_the_contract_bits(
    rng, fast_runs, dtype, form, positions
):
    # The forms of flash-attn (bshd, per-sequence offsets) and vLLM (3-D) and integer
    # offsets: compiled plans too, each call with new values.
    shape = (3, 4, 2, 16)
    _, cos, sin, _ = make_case(rng, shape, dtype, position_ids=positions != "none", n_positions=9)
    for _ in range(cpu_backend.FAST_AFTER + 3):
        x4 = rng.standard_normal(shape).astype(dtype)
        x, keywords = _heads_inside(x4, form)
        ids = None
        if positions == "ids":
            ids = rng.integers(0, 9, (3, 2))
            keywords["position_ids"] = ids
        elif positions == "offset":
            offset = int(rng.integers(0, 8))
            keywords["position_offset"] = offset
            ids = np.full((3, 2), offset) + np.arange(2)
        elif positions == "offsets":
            offsets = rng.integers(0, 8, 3)
            keywords["position_offset"] = offsets
            ids = offsets[:, None] + np.arange(2)
        else:
            cos, sin = (rng.standard_normal((3, 2, 8)).astype(dtype) for _ in range(2))
        out = np.full_like(x, np.nan)
        got = numba_rope.rotary_embedding(x, cos, sin, out=out, **keywords)
        assert got is out
        assert_bitwise_equal(_as_bhsd(got, form, 4), float32_contract(x4, cos, sin, ids))
    assert fast_runs == {"one": [2, 0], "qk": [0, 0]}  # the last two calls, by the plan


_FUSED = [("vllm", BFLOAT16), ("flash-attn", np.dtype(np.float32))]  # each 10-15 s cold


@pytest.mark.parametrize(("form", "dtype"), _FUSED, ids=[f"{f}-{d.name}" for f, d in _FUSED])
def test_compiled_plan_of_q_and_k_in_place_in_a_fused_buffer(rng, fast_runs, dtype, form):
    # The decode step of a serving loop: q and k are views of one qkv buffer (vLLM:
    # [tokens, (heads + 2 kv heads) * head_size]; flash-attn: [batch, seq, 3, heads,
    # head_size]), rotated in place. Their byte spans interleave, yet they share no
    # byte: the kernels prove it from their token rows instead of copying.
    heads, kv_heads, head_size, tokens = 4, 2, 16, 3
    _, cos, sin, _ = make_case(rng, (1, 1, 1, head_size), dtype, n_positions=20)
    for _ in range(cpu_backend.FAST_AFTER + 3):
        positions = rng.integers(0, 20, tokens)
        if form == "vllm":
            qkv = rng.standard_normal((1, tokens, (heads + 2 * kv_heads) * head_size))
            qkv = qkv.astype(dtype)
            q = qkv[..., : heads * head_size]
            k = qkv[..., heads * head_size : (heads + kv_heads) * head_size]
            v = qkv[..., (heads + kv_heads) * head_size :]
            keywords = {"position_ids": positions[None], "num_heads": heads}
            keywords["num_kv_heads"] = kv_heads
            q4, k4 = (_as_bhsd(a, "3-D", n) for a, n in ((q, heads), (k, kv_heads)))
            ids = positions[None]
        else:
            qkv = rng.standard_normal((tokens, 1, 3, heads, head_size)).astype(dtype)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            keywords = {"position_offset": positions, "layout": "bshd"}
            q4, k4 = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
            ids = positions[:, None]
        expected_q = float32_contract(q4, cos, sin, ids)
        expected_k = float32_contract(k4, cos, sin, ids)
        v_before = v.copy()
        got = numba_rope.rotary_embedding_qk(q, k, cos, sin, out_q=q, out_k=k, **keywords)
        assert got[0] is q and got[1] is k
        assert_bitwise_equal(q4, expected_q)
        assert_bitwise_equal(k4, expected_k)
        assert_bitwise_equal(v, v_before)
    assert fast_runs == {"one": [0, 0], "qk": [2, 0]}


def test_compiled_plan_of_offsets_leaves_other_calls_to_the_general_path(rng, fast_runs):
    # Offsets that look like the planned ones but are not (dtype, axes, values, memory):
    # each call gives what it gives without any plan.
    x, cos, sin, _ = make_case(rng, (3, 2, 4, 8), np.float32, n_positions=10)
    offsets = np.array([0, 6, 3])
    out = np.empty_like(x)
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, position_offset=offsets, out=out))
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, position_offset=5, out=out))
    assert fast_runs["one"][0] >= 2
    frozen = offsets.copy()
    frozen.flags.writeable = False
    shared = np.zeros(x.size, np.float32)  # an output whose bytes hold the offsets too
    shared_out = shared.reshape(x.shape)
    shared_offsets = shared[2:8].view(np.int64)

    def offsets_in_the_output():
        shared_offsets[:] = offsets  # (the call before overwrote them)
        return numba_rope.rotary_embedding(
            x, cos, sin, position_offset=shared_offsets, out=shared_out
        )

    calls = {
        "bad offset": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=np.array([0, 7, 3]), out=out
        ),
        "negative offset": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=np.array([0, -1, 3]), out=out
        ),
        "int32 offsets": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=offsets.astype(np.int32), out=out
        ),
        "uint64 beyond int64": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=np.array([0, 2**64 - 1, 3], np.uint64), out=out
        ),
        "strided offsets": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=np.repeat(offsets, 2)[::2], out=out
        ),
        "read-only offsets": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=frozen, out=out
        ),
        "0-d offset array": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=np.array(2), out=out
        ),
        "offsets of 2 axes": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=offsets[:, None], out=out
        ),
        "offsets in the output's bytes": offsets_in_the_output,
        "offset beyond int64": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=2**70, out=out
        ),
        "offset past the caches": lambda: numba_rope.rotary_embedding(
            x, cos, sin, position_offset=7, out=out
        ),
    }
    with_plan = {name: _outcome(call) for name, call in calls.items()}
    _assert_same_without_plans(calls, with_plan)
    for name in ("bad offset", "negative offset", "uint64 beyond int64", "offset beyond int64"):
        assert with_plan[name][0] is IndexError, name
    assert with_plan["offsets of 2 axes"][0] is ValueError
    ids = offsets[:, None] + np.arange(4)
    for name in ("int32 offsets", "strided offsets", "read-only offsets"):
        assert with_plan[name] == [
            (out.dtype, out.shape, float32_contract(x, cos, sin, ids).tobytes())
        ]


def test_offsets_of_other_integer_dtypes_take_the_compiled_plan_of_int64_ones(rng, fast_runs):
    # int32 offsets (flash-attn's cache_seqlens) and other integers of fewer bits are
    # read as int64, exactly: the compiled plan of int64 offsets runs them (one plan
    # for all), with the contract's bits; uint64 offsets keep the general path's check
    # (test above), and offsets in the other byte order its refusal.
    x, cos, sin, _ = make_case(rng, (3, 2, 4, 8), np.float32, n_positions=10)
    k = rng.standard_normal((3, 1, 4, 8)).astype(np.float32)
    offsets = np.array([0, 6, 3])
    ids = offsets[:, None] + np.arange(4)
    want, want_k = float32_contract(x, cos, sin, ids), float32_contract(k, cos, sin, ids)
    out = np.empty_like(x)
    dtypes = (np.int32, np.int16, np.uint8, np.uint32, np.int64)
    for dtype in dtypes:
        given = offsets.astype(dtype)
        got = _repeat(
            lambda given=given: numba_rope.rotary_embedding(
                x, cos, sin, position_offset=given, out=out
            )
        )
        assert_bitwise_equal(got, want)
        got_q, got_k = _repeat(
            lambda given=given: numba_rope.rotary_embedding_qk(
                x, k, cos, sin, position_offset=given
            )
        )
        assert_bitwise_equal(got_q, want)
        assert_bitwise_equal(got_k, want_k)
        assert given.dtype == np.dtype(dtype)  # the caller's array is left as it was
    # every call after the first dtype's plan was made ran by it, none fell back
    later = (len(dtypes) - 1) * (cpu_backend.FAST_AFTER + 2)
    for kind in ("one", "qk"):
        assert fast_runs[kind][0] > later and fast_runs[kind][1] == 0, fast_runs
    with pytest.raises(IndexError, match="position_offset"):
        numba_rope.rotary_embedding(
            x, cos, sin, position_offset=np.array([0, 7, 3], np.int32), out=out
        )
    other_order = offsets.astype(np.int32).astype(np.dtype(np.int32).newbyteorder())
    with pytest.raises(TypeError, match="position_offset has dtype"):
        numba_rope.rotary_embedding(x, cos, sin, position_offset=other_order, out=out)


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("form", ["out", "allocating", "q in place", "both in place", "no ids"])
def test_compiled_plan_of_q_and_k_gives_the_contract_bits(rng, fast_runs, dtype, form):
    # Hugging Face's form: q and k (fewer heads) bhsd, caches per token or by ids.
    with_ids = form != "no ids"
    _, cos, sin, ids = make_case(rng, (2, 4, 3, 16), dtype, position_ids=with_ids)
    for _ in range(cpu_backend.FAST_AFTER + 3):
        q = rng.standard_normal((2, 4, 3, 16)).astype(dtype)
        k = rng.standard_normal((2, 2, 3, 16)).astype(dtype)
        expected = (float32_contract(q, cos, sin, ids), float32_contract(k, cos, sin, ids))
        out_q = q if form in ("q in place", "both in place") else None
        out_k = k if form == "both in place" else None
        if form == "out":
            out_q, out_k = np.full_like(q, np.nan), np.full_like(k, np.nan)
        got = numba_rope.rotary_embedding_qk(q, k, cos, sin, ids, out_q=out_q, out_k=out_k)
        for result, given in zip(got, (out_q, out_k), strict=True):
            assert given is None or result is given
        assert_bitwise_equal(got[0], expected[0])
        assert_bitwise_equal(got[1], expected[1])
    assert fast_runs == {"one": [0, 0], "qk": [2, 0]}


def test_compiled_plan_of_q_and_k_leaves_other_calls_to_the_general_path(rng, fast_runs):
    q, cos, sin, ids = make_case(rng, (2, 4, 3, 16), np.float32, n_positions=9)
    k = rng.standard_normal((2, 2, 3, 16)).astype(np.float32)
    out_q, out_k = np.empty_like(q), np.empty_like(k)
    _repeat(lambda: numba_rope.rotary_embedding_qk(q, k, cos, sin, ids, out_q=out_q, out_k=out_k))
    bad = ids.copy()
    bad[0, 0] = 9
    both = np.empty((2, 6, 3, 16), np.float32)
    buffer = np.empty(q.size + k.size, np.float32)

    def out_k_on_q():  # a fresh q each time: the call writes into it
        fresh = q.copy()
        return numba_rope.rotary_embedding_qk(
            fresh, k, cos, sin, ids, out_q=out_q, out_k=fresh[:, 1:3]
        )

    calls = {
        "outputs sharing memory": lambda: numba_rope.rotary_embedding_qk(
            q, k, cos, sin, ids, out_q=out_q, out_k=out_q[:, :2]
        ),
        "out_k on q": out_k_on_q,
        "bad ids": lambda: numba_rope.rotary_embedding_qk(
            q, k, cos, sin, bad, out_q=out_q, out_k=out_k
        ),
        "k of another dtype": lambda: numba_rope.rotary_embedding_qk(
            q, k.astype(np.float64), cos, sin, ids, out_q=out_q, out_k=out_k
        ),
        "k of other heads": lambda: numba_rope.rotary_embedding_qk(
            q, both[:, :4], cos, sin, ids, out_q=out_q, out_k=out_k
        ),
        "outs not C-contiguous": lambda: numba_rope.rotary_embedding_qk(
            q, k, cos, sin, ids, out_q=both[:, :4], out_k=both[:, 4:]
        ),
        "outs of one buffer": lambda: numba_rope.rotary_embedding_qk(
            q,
            k,
            cos,
            sin,
            ids,
            out_q=buffer[: q.size].reshape(q.shape),
            out_k=buffer[q.size :].reshape(k.shape),
        ),
        "float64 sin": lambda: numba_rope.rotary_embedding_qk(
            q, k, cos, sin.astype(np.float64), ids, out_q=out_q, out_k=out_k
        ),
        "a list for sin": lambda: numba_rope.rotary_embedding_qk(
            q, k, cos, sin.tolist(), ids, out_q=out_q, out_k=out_k
        ),
        "float16 out_q": lambda: numba_rope.rotary_embedding_qk(
            q, k, cos, sin, ids, out_q=np.empty(q.shape, np.float16), out_k=out_k
        ),
        "float16 out_k": lambda: numba_rope.rotary_embedding_qk(
            q, k, cos, sin, ids, out_q=out_q, out_k=np.empty(k.shape, np.float16)
        ),
        "a list for k": lambda: numba_rope.rotary_embedding_qk(
            q, k.tolist(), cos, sin, ids, out_q=out_q, out_k=out_k
        ),
    }
    ran, refused = fast_runs["qk"]
    with_plan = {name: _outcome(call) for name, call in calls.items()}
    # Found by all but "k of other heads" (k's shape is in the key) and "a list for k"
    # (no key without arrays); run only for "outs of one buffer", two C-contiguous
    # outputs apart in one buffer.
    assert fast_runs["qk"] == [ran + 1, refused + len(calls) - 3]
    _assert_same_without_plans(calls, with_plan)
    assert with_plan["outputs sharing memory"][0] is ValueError
    assert with_plan["bad ids"][0] is IndexError
    for name in ("float16 out_q", "float16 out_k", "a list for sin", "a list for k"):
        assert with_plan[name][0] is TypeError, name


def test_compiled_plans_of_heads_inside_tokens_leave_other_calls_to_the_general_path(
    rng, fast_runs
):
    # Plans of 3-D inputs (views reshaped to bhsd) and of q and k with offsets: outputs
    # of another shape and offsets they cannot take go to the general path, which
    # gives what it gives without any plan.
    x4, cos, sin, ids = make_case(rng, (2, 4, 3, 16), np.float32, n_positions=9)
    k4 = rng.standard_normal((2, 2, 3, 16)).astype(np.float32)
    x, k = (_heads_inside(a, "3-D")[0] for a in (x4, k4))
    out, out_k = np.empty_like(x), np.empty_like(k)
    kv = {"num_heads": 4, "num_kv_heads": 2}
    offsets = np.array([0, 5])
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids, out=out, num_heads=4))
    _repeat(
        lambda: numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, out_q=out, out_k=out_k, **kv)
    )
    _repeat(
        lambda: numba_rope.rotary_embedding_qk(
            x, k, cos, sin, position_offset=offsets, out_q=out, out_k=out_k, **kv
        )
    )
    assert fast_runs["one"][0] >= 1 and fast_runs["qk"][0] >= 2
    calls = {
        "4-D out": lambda: numba_rope.rotary_embedding(
            x, cos, sin, ids, out=np.empty((2, 3, 4, 16), np.float32), num_heads=4
        ),
        "4-D out_q": lambda: numba_rope.rotary_embedding_qk(
            x, k, cos, sin, ids, out_q=np.empty((2, 3, 4, 16), np.float32), out_k=out_k, **kv
        ),
        "4-D out_k": lambda: numba_rope.rotary_embedding_qk(
            x, k, cos, sin, ids, out_q=out, out_k=np.empty((2, 3, 2, 16), np.float32), **kv
        ),
        "offsets of 2 axes": lambda: numba_rope.rotary_embedding_qk(
            x, k, cos, sin, position_offset=offsets[:, None], out_q=out, out_k=out_k, **kv
        ),
        "strided offsets": lambda: numba_rope.rotary_embedding_qk(
            x,
            k,
            cos,
            sin,
            position_offset=np.repeat(offsets, 2)[::2],
            out_q=out,
            out_k=out_k,
            **kv,
        ),
    }
    refused_one, refused_qk = fast_runs["one"][1], fast_runs["qk"][1]
    with_plan = {name: _outcome(call) for name, call in calls.items()}
    assert fast_runs["one"][1] == refused_one + 1
    assert fast_runs["qk"][1] == refused_qk + 3  # strided offsets: copied, then run
    _assert_same_without_plans(calls, with_plan)
    for name in ("4-D out", "4-D out_q", "4-D out_k", "offsets of 2 axes"):
        assert with_plan[name][0] is ValueError, name
    expected = [float32_contract(a, cos, sin, offsets[:, None] + np.arange(3)) for a in (x4, k4)]
    assert_bitwise_equal(_as_bhsd(out, "3-D", 4), expected[0])
    assert_bitwise_equal(_as_bhsd(out_k, "3-D", 2), expected[1])


def test_threads_sharing_compiled_plans_get_their_own_bits(rng, fast_runs):
    # Plans are made by whichever thread gets there first and then run by all of them,
    # concurrently: each call must still rotate its own input into its own output.
    from concurrent.futures import ThreadPoolExecutor

    shape, k_shape = (2, 4, 3, 16), (2, 2, 3, 16)
    _, cos, sin, ids = make_case(rng, shape, np.float16)
    inputs = [
        [
            (rng.standard_normal(shape).astype(np.float16), rng.standard_normal(k_shape))
            for _ in range(3 * cpu_backend.FAST_AFTER)
        ]
        for _ in range(4)
    ]

    def work(pairs):
        results = []
        for x, k in pairs:
            k = k.astype(np.float16)
            one = numba_rope.rotary_embedding(x, cos, sin, ids)
            both = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids)
            results.append((x, k, one, both))
        return results

    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(work, inputs))
    for results in done:
        for x, k, one, (q_out, k_out) in results:
            expected = float32_contract(x, cos, sin, ids)
            assert_bitwise_equal(one, expected)
            assert_bitwise_equal(q_out, expected)
            assert_bitwise_equal(k_out, float32_contract(k, cos, sin, ids))
    assert fast_runs["one"][0] > 0 and fast_runs["qk"][0] > 0  # the plans did run
    assert fast_runs["one"][1] == fast_runs["qk"][1] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_compiled_plan_takes_equal_dtypes_that_are_other_objects(rng, fast_runs, dtype):
    # NumPy's native dtypes are one object each, but an equal dtype can be another
    # object (newbyteorder("="), unpickling, rope_cache before this was found): such
    # arrays used to miss their plan at every call, silently slower.
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 16), dtype)
    _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids))
    other = dtype.newbyteorder("=")
    assert other == dtype and other is not dtype
    for arrays in [(x, cos.view(other), sin.view(other)), (x.view(other), cos, sin)]:
        out = np.full_like(x, np.nan).view(other)
        got = numba_rope.rotary_embedding(*arrays, ids, out=out)
        assert got is out
        assert_bitwise_equal(got.view(dtype), float32_contract(x, cos, sin, ids))
    assert fast_runs == {"one": [3, 0], "qk": [0, 0]}
    cos2, sin2 = numba_rope.rope_cache(cos.shape[0], 32, dtype=dtype)
    assert cos2.dtype is dtype and sin2.dtype is dtype  # NumPy's own object


# -- compiled plans of large calls: numba's parallel region ------------------------------


@pytest.fixture
def large_calls(monkeypatch):
    """Small arrays made large: calls of 64 elements or more run in numba's parallel
    region, and outputs of 4 KiB or more are streamed (the constants read at each call;
    setting them forgets the plans made before)."""
    monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 64)
    monkeypatch.setattr(config, "STREAMING_MIN_BYTES", 4096)


def _large_plans_counted(calls: int) -> list[int]:
    """What :func:`fast_runs` counts for ``calls`` calls after a large call's signature
    was planned: run by its compiled plan where such calls run in numba's parallel
    region with a thread-safe threading layer (OpenMP or TBB), left to the general path
    (which takes a lock) under numba's workqueue layer, and no compiled plan at all on
    one thread (the serial kernels then run the large calls, unplanned)."""
    if numba.get_num_threads() < 2:
        return [0, 0]
    return [calls, 0] if numba.threading_layer() in ("omp", "tbb") else [0, calls]


_LARGE_CASES = [
    (np.dtype(np.float32), False, None),
    (np.dtype(np.float32), False, "given"),
    (np.dtype(np.float32), False, "in place"),
    (np.dtype(np.float32), True, "given"),
    (np.dtype(np.float32), True, "k in place"),
    (np.dtype(np.float16), False, "given"),
    (BFLOAT16, True, None),
]


@pytest.mark.parametrize(
    ("dtype", "two", "out_kind"),
    _LARGE_CASES,
    ids=[f"{d.name}-{'qk' if t else 'one'}-{o}" for d, t, o in _LARGE_CASES],
)
def test_compiled_plans_of_large_calls_give_the_contract_bits(
    rng, monkeypatch, fast_runs, large_calls, dtype, two, out_kind
):
    # Large calls (numba's parallel region; streamed where out of place) of one
    # signature repeated: the last two by the compiled plan, each call's bits the
    # contract's.
    if out_kind is None:
        # Allocated from the pool, on a 64-byte line, as large calls' outputs are: NumPy
        # puts these small ones wherever the heap has room, and a bfloat16 output
        # streams only from a line, so a call whose output lands elsewhere than the
        # planned one's is left to the general path (CI, once: [1, 1]).
        monkeypatch.setattr(pool, "MIN_BYTES", 0)
    shape, k_shape = (2, 4, 16, 16), (2, 2, 16, 16)
    _, cos, sin, ids = make_case(rng, shape, dtype, n_positions=20)
    for _ in range(cpu_backend.FAST_AFTER + 3):  # new values each call
        x = rng.standard_normal(shape).astype(dtype)
        k = rng.standard_normal(k_shape).astype(dtype)
        want = (float32_contract(x, cos, sin, ids), float32_contract(k, cos, sin, ids))
        out, out_k = {
            None: (None, None),
            "given": (np.full_like(x, np.nan), np.full_like(k, np.nan)),
            "in place": (x, k),
            "k in place": (np.full_like(x, np.nan), k),
        }[out_kind]
        if two:
            got = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, out_q=out, out_k=out_k)
        else:
            got = (numba_rope.rotary_embedding(x, cos, sin, ids, out=out),)
        for g, expected in zip(got, want, strict=False):
            assert_bitwise_equal(g, expected)
    assert fast_runs["qk" if two else "one"] == _large_plans_counted(2)


def _caches_of_other_lengths(rng, shape, lengths):
    """For an input of ``shape``: ``(cos, sin, ids)`` with caches of each of
    ``lengths`` rows, signatures that share a ``fast_key``."""
    return [make_case(rng, shape, np.float32, n_positions=n)[1:] for n in lengths]


@pytest.mark.parametrize("size", ["small", "large"])
def test_signatures_sharing_a_key_alternated_keep_a_compiled_plan_each(
    rng, monkeypatch, fast_runs, size
):
    # fast_key holds no cache shapes: calls whose caches have other lengths (two caches
    # in one program) share it. Each keeps its compiled plan; with one plan per key the
    # newer took the place of the other, whose calls went to the general path for good.
    if size == "large":
        monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 64)
    shape = (2, 4, 16, 16)
    x = rng.standard_normal(shape).astype(np.float32)
    signatures = _caches_of_other_lengths(rng, shape, (20, 40, 60))
    assert len(signatures) <= cpu_backend.PLANS_PER_KEY
    for _ in range(cpu_backend.FAST_AFTER + 1):  # the first call makes the Python plan
        for cos, sin, ids in signatures:
            numba_rope.rotary_embedding(x, cos, sin, ids)
    fast_runs["one"][:] = [0, 0]
    for _ in range(2):
        for cos, sin, ids in signatures:
            got = numba_rope.rotary_embedding(x, cos, sin, ids)
            assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))
    # (one numba thread: large calls run serially, unplanned: no compiled plan at all)
    planned = size == "small" or numba.get_num_threads() > 1
    assert len(cpu_backend.FAST) == int(planned)
    assert fast_runs["one"] == (_large_plans_counted(6) if size == "large" else [6, 0])


def test_signatures_sharing_a_key_beyond_its_plans_leave_the_oldest_to_the_general_path(
    rng, monkeypatch, fast_runs
):
    monkeypatch.setattr(cpu_backend, "PLANS_PER_KEY", 2)
    shape = (2, 4, 16, 16)
    x = rng.standard_normal(shape).astype(np.float32)
    signatures = _caches_of_other_lengths(rng, shape, (20, 40, 60))
    for cos, sin, ids in signatures:  # planned in turn: the third pushes out the first
        _repeat(lambda: numba_rope.rotary_embedding(x, cos, sin, ids))  # noqa: B023
    fast_runs["one"][:] = [0, 0]
    for cos, sin, ids in signatures:
        out = np.full_like(x, np.nan)
        assert numba_rope.rotary_embedding(x, cos, sin, ids, out=out) is out
        assert_bitwise_equal(out, float32_contract(x, cos, sin, ids))
    assert fast_runs["one"] == [2, 1]
    assert len(cpu_backend.FAST[next(iter(cpu_backend.FAST))][3]) == 2


def _off_alignment(shape, dtype):
    """An output of ``shape`` whose first element is not on 16 bytes (never streamed)."""
    buffer = np.empty(int(np.prod(shape)) + 16, dtype)
    start = next(i for i in range(16) if buffer[i:].ctypes.data % 16)
    return buffer[start : start + int(np.prod(shape))].reshape(shape)


@pytest.mark.parametrize("planned_out", ["aligned", "off alignment"])
def test_compiled_plan_of_a_large_call_leaves_other_calls_to_the_general_path(
    rng, monkeypatch, fast_runs, large_calls, planned_out
):
    # A large call's compiled plan holds choices of the general path that depend on
    # more than the signature: whether the outputs are streamed (their alignment),
    # the tiles made for the caches (the bytes between their rows), the threads, and whether
    # a parallel region may run. A call that differs goes to the general path, which
    # chooses afresh; every call gives the contract's bits.
    shape = (2, 4, 16, 16)
    x, cos, sin, ids = make_case(rng, shape, np.float32, n_positions=20)
    want = float32_contract(x, cos, sin, ids)
    aligned = np.empty_like(x)
    off = _off_alignment(shape, np.float32)
    planned = aligned if planned_out == "aligned" else off
    other = off if planned_out == "aligned" else aligned
    for _ in range(cpu_backend.FAST_AFTER + 2):  # the last one by the compiled plan
        assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids, out=planned), want)
    counted = _large_plans_counted(1)
    assert fast_runs["one"] == counted
    if counted == [0, 0]:
        pytest.skip("one numba thread: no large call runs in a parallel region")

    def like_planned():  # a new output placed as the planned one is
        return np.empty_like(x) if planned is aligned else _off_alignment(shape, np.float32)

    wide_cos, wide_sin = np.zeros((20, 16), np.float32), np.zeros((20, 16), np.float32)
    wide_cos[:, :8], wide_sin[:, :8] = cos, sin  # rows 64 bytes apart: not dense

    def fewer_threads():
        numba.set_num_threads(numba.get_num_threads() - 1)
        try:
            return numba_rope.rotary_embedding(x, cos, sin, ids, out=like_planned())
        finally:
            numba.set_num_threads(numba.get_num_threads() + 1)

    def no_parallel_regions():
        with monkeypatch.context() as m:
            m.setattr(cpu_backend, "parallel_regions_usable", lambda: False)
            return numba_rope.rotary_embedding(x, cos, sin, ids, out=like_planned())

    def layer_not_known_safe():
        with monkeypatch.context() as m:
            m.setattr(cpu_backend, "_threading_layer_is_safe", False)
            return numba_rope.rotary_embedding(x, cos, sin, ids, out=like_planned())

    others = {
        "other alignment": lambda: numba_rope.rotary_embedding(x, cos, sin, ids, out=other),
        "caches not dense": lambda: numba_rope.rotary_embedding(
            x, wide_cos[:, :8], wide_sin[:, :8], ids, out=like_planned()
        ),
        "fewer threads": fewer_threads,
        "no parallel regions": no_parallel_regions,
        "layer not known safe": layer_not_known_safe,
    }
    for name, call in others.items():
        before = list(fast_runs["one"])
        assert_bitwise_equal(call(), want)
        assert fast_runs["one"] == [before[0], before[1] + 1], name
    # An output starting on a line whose rows do not (68-byte rows): never streamed, so
    # left to the general path by a streaming plan, run by a plan that does not stream.
    rows_off = np.empty((*shape[:-1], 17), np.float32)[..., :16]
    before = list(fast_runs["one"])
    assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids, out=rows_off), want)
    ran_by_plan = planned is not aligned
    assert fast_runs["one"] == [before[0] + ran_by_plan, before[1] + (not ran_by_plan)]
    ran = fast_runs["one"][0]
    assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids, out=planned), want)
    assert fast_runs["one"][0] == ran + 1  # the plan's own call still runs by it


@pytest.mark.parametrize("head_size", [16, 64])
@pytest.mark.parametrize("planned_offset", [0, 16], ids=["on a line", "off a line"])
def test_compiled_plan_of_a_large_bfloat16_call_and_where_its_output_starts(
    rng, fast_runs, large_calls, planned_offset, head_size
):
    # bfloat16 rows of non-interleaved pairs whose halves are not whole 64-byte lines
    # (8 pairs of 16 channels) stream only from a line (backend.stream_start), in the
    # general path's choice and in the compiled plan's check alike: a plan made for an
    # output 16 bytes past a line (ordinary stores) runs the calls into outputs placed
    # so and leaves those on a line (streamed) to the general path, and the other way
    # round. Rows of 64 channels (halves of one line) stream from either where the
    # word steps fill a line (AVX-512 targets, vector.words_fill_lines), and one plan
    # runs both. Every call gives the contract's bits.
    shape = (2, 4, 16, head_size)
    x, cos, sin, ids = make_case(rng, shape, BFLOAT16, n_positions=20)
    want = float32_contract(x, cos, sin, ids)

    def call(offset):
        out = empty_on_line(shape, BFLOAT16, offset=offset)
        assert numba_rope.rotary_embedding(x, cos, sin, ids, out=out) is out
        return out

    for _ in range(cpu_backend.FAST_AFTER + 2):  # the last one by the compiled plan
        assert_bitwise_equal(call(planned_offset), want)
    counted = _large_plans_counted(1)
    assert fast_runs["one"] == counted
    if counted == [0, 0]:
        pytest.skip("one numba thread: no large call runs in a parallel region")
    assert_bitwise_equal(call(planned_offset), want)  # placed alike: by the plan
    assert fast_runs["one"] == _large_plans_counted(2)
    before = list(fast_runs["one"])
    assert_bitwise_equal(call(16 - planned_offset), want)  # placed otherwise
    by_plan = head_size == 64 and words_fill_lines() and _large_plans_counted(1) == [1, 0]
    assert fast_runs["one"] == [before[0] + by_plan, before[1] + (not by_plan)]


def _rows_apart(cache, width):
    """``cache`` (2-D, 8 channels) as the first 8 of rows ``width`` wide."""
    wide = np.zeros((cache.shape[0], width), cache.dtype)
    wide[:, :8] = cache
    return wide[:, :8]


def test_compiled_plan_of_a_large_call_with_cache_rows_apart(
    rng, monkeypatch, fast_runs, large_calls
):
    # Caches whose rows lie apart (transformers' halves: rows twice their width apart)
    # get a compiled plan too, with the general path's short tiles: tiles of 4 tokens
    # here (config.CACHE_SPAN_BYTES over 64 bytes between rows). Caches whose rows lie
    # next to each other, or further apart, go to the general path (tiles of their own).
    monkeypatch.setattr(config, "CACHE_SPAN_BYTES", 4 * 64 + 32)
    x, cos, sin, _ = make_case(rng, (2, 4, 16, 16), np.float32, n_positions=20)
    ids = np.stack([np.arange(16), np.arange(4, 20)])  # each sequence's rows in turn
    want = float32_contract(x, cos, sin, ids)
    apart = _rows_apart(cos, 16), _rows_apart(sin, 16)
    for _ in range(cpu_backend.FAST_AFTER + 2):  # the last one by the compiled plan
        assert_bitwise_equal(numba_rope.rotary_embedding(x, *apart, ids), want)
    counted = _large_plans_counted(1)
    assert fast_runs["one"] == counted
    if counted == [0, 0]:
        pytest.skip("one numba thread: no large call runs in a parallel region")
    (planned,) = cpu_backend.FAST.values()
    assert planned[1][cpu_kernels.PLAN_TILE] == 4
    further = _rows_apart(cos, 24), _rows_apart(sin, 24)
    for name, caches in {"next to each other": (cos, sin), "further apart": further}.items():
        before = list(fast_runs["one"])
        assert_bitwise_equal(numba_rope.rotary_embedding(x, *caches, ids), want)
        assert fast_runs["one"] == [before[0], before[1] + 1], name


def test_compiled_plan_of_large_q_and_k_leaves_other_calls_to_the_general_path(
    rng, monkeypatch, fast_runs, large_calls
):
    # As for one tensor: outputs placed otherwise, or no parallel region possible now,
    # and q and k go to the general path (the same bits).
    x, cos, sin, ids = make_case(rng, (2, 4, 16, 16), np.float32, n_positions=20)
    k = rng.standard_normal((2, 2, 16, 16)).astype(np.float32)
    want = (float32_contract(x, cos, sin, ids), float32_contract(k, cos, sin, ids))

    def call(out_k=None):
        return numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, out_k=out_k)

    for got, expected in zip(_repeat(call), want, strict=True):
        assert_bitwise_equal(got, expected)
    counted = _large_plans_counted(1)
    assert fast_runs["qk"] == counted
    if counted == [0, 0]:
        pytest.skip("one numba thread: no large call runs in a parallel region")
    others = [lambda: call(_off_alignment(k.shape, np.float32))]
    for name in ("parallel_regions_usable", "thread_count"):
        others.append(lambda name=name: _patched(monkeypatch, name, call))
    for other in others:
        before = list(fast_runs["qk"])
        for got, expected in zip(other(), want, strict=True):
            assert_bitwise_equal(got, expected)
        assert fast_runs["qk"] == [before[0], before[1] + 1]


def _patched(monkeypatch, name, call):
    """``call()`` with the backend's ``name`` answering what stops a compiled plan of a
    large call: no parallel region may run, or another thread count than the plan's."""
    with monkeypatch.context() as m:
        m.setattr(cpu_backend, name, (lambda: False) if name.startswith("parallel") else lambda: 99)
        return call()
