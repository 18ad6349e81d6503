"""Every bad input raises the stated exception, with a useful message, before anything
is written: on NumPy arrays and on GPU arrays alike (``device``, see conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import BFLOAT16, make_case

import numba_rope

B, H, S, D = 2, 3, 4, 8


def good(with_ids=True, dtype=np.float32, cache_dtype=None):
    x = np.ones((B, H, S, D), dtype)
    cache_dtype = cache_dtype or dtype
    if with_ids:
        cache = np.ones((10, D // 2), cache_dtype)
        ids = np.zeros((B, S), np.int64)
    else:
        cache = np.ones((B, S, D // 2), cache_dtype)
        ids = None
    return {"input": x, "cos_cache": cache, "sin_cache": cache.copy(), "position_ids": ids}


def call(device, args, **kwargs):
    """The call on ``device`` (NumPy arrays moved there, anything else as it is), ``out``
    by default full of 7.0, which must be as it was afterwards."""
    on, off = device
    dtype = getattr(args["input"], "dtype", np.float32)
    out = np.full((B, H, S, D), 7.0, dtype) if "out" not in kwargs else kwargs.pop("out")
    moved = {name: on(value) for name, value in args.items()}
    device_out = on(out)
    try:
        numba_rope.rotary_embedding(**moved, out=device_out, **kwargs)
    finally:
        if out is not None:
            np.testing.assert_array_equal(off(device_out), out)  # nothing written


def replace(args, **changes):
    return {**args, **changes}


TYPE_ERRORS = {
    "int input": (
        replace(good(), input=np.ones((B, H, S, D), np.int32)),
        r"int32.*astype\(np\.float32\) \(NumPy\) or \.float\(\) \(torch\)",
    ),
    "bool input": (replace(good(), input=np.ones((B, H, S, D), bool)), "bool"),
    "complex input": (replace(good(), input=np.ones((B, H, S, D), np.complex64)), "complex64"),
    "list input": (replace(good(), input=np.ones((B, H, S, D)).tolist()), "list"),
    "list cache": (replace(good(), cos_cache=[[1.0] * 4] * 10), "list"),
    "cos/sin dtypes differ": (
        replace(good(dtype=np.float16), sin_cache=np.ones((10, 4), np.float32)),
        "same dtype",
    ),
    "cos/sin dtypes differ, float16 sin": (
        replace(good(), sin_cache=np.ones((10, 4), np.float16)),
        "same dtype",
    ),
    "float64 caches for float32": (
        replace(good(), cos_cache=np.ones((10, 4)), sin_cache=np.ones((10, 4))),
        r"float64.*cos_cache\.astype\(input\.dtype\).*cos_cache\.to\(input\.dtype\)",
    ),
    "float16 caches for bfloat16": (good(dtype=BFLOAT16, cache_dtype=np.float16), "float16"),
    "float position ids": (
        replace(good(), position_ids=np.zeros((B, S))),
        "position_ids must be an integer.*float64",
    ),
    "list position ids": (replace(good(), position_ids=[[0] * S] * B), "list"),
}


@pytest.mark.parametrize("case", TYPE_ERRORS, ids=str)
def test_type_errors(device, case):
    args, fragment = TYPE_ERRORS[case]
    with pytest.raises(TypeError, match=fragment):
        call(device, args)


@pytest.mark.parametrize("out_dtype", [np.float64, np.float16], ids=str)
def test_out_of_wrong_dtype_is_type_error(device, out_dtype):
    name = np.dtype(out_dtype).name
    with pytest.raises(TypeError, match=f"out must have the input's dtype float32, got {name}"):
        call(device, good(), out=np.zeros((B, H, S, D), out_dtype))


def test_out_of_wrong_kind_is_type_error(device):
    moved = {name: device.on(value) for name, value in good().items()}
    with pytest.raises(TypeError, match=r"out is a builtins\.list"):
        numba_rope.rotary_embedding(**moved, out=[])


@pytest.mark.parametrize("value", [1.5, "2", True, None])
def test_rotary_dim_of_wrong_type(device, value):
    with pytest.raises(TypeError, match="rotary_embedding_dim must be an integer"):
        call(device, good(), rotary_embedding_dim=value)


def test_interleaved_of_wrong_type(device):
    with pytest.raises(TypeError, match="interleaved must be True or False, got 1"):
        call(device, good(), interleaved=1)


UNHASHABLE_OPTIONS = {
    "interleaved": ([1], TypeError, r"interleaved must be True or False, got \[1\]"),
    "inverse": ({}, TypeError, r"inverse must be True or False, got \{\}"),
    "layout": (["bshd"], ValueError, r"layout must be one of .*got \['bshd'\]"),
    "num_heads": ([3], TypeError, r"num_heads must be a positive integer, got \[3\]"),
}


@pytest.mark.parametrize("option", UNHASHABLE_OPTIONS)
def test_options_that_cannot_be_hashed_raise_one_error(device, option):
    """An option that cannot be hashed (the checks' verdicts are remembered by the
    arguments) is refused by the plain check's message alone: not raised while the
    "unhashable type" error is handled, which a traceback prints first, as a second
    error."""
    value, kind, message = UNHASHABLE_OPTIONS[option]
    with pytest.raises(kind, match=message) as raised:
        call(device, good(), **{option: value})
    assert raised.value.__context__ is None or raised.value.__suppress_context__
    moved = {name: device.on(value) for name, value in good().items()}
    with pytest.raises(kind, match=message) as raised:
        numba_rope.rotary_embedding_qk(
            moved["input"], moved["input"], moved["cos_cache"], moved["sin_cache"],
            moved["position_ids"], **{option: value},
        )  # fmt: skip
    assert raised.value.__context__ is None or raised.value.__suppress_context__


VALUE_ERRORS = {
    "3-D input without num_heads": (
        replace(good(), input=np.ones((B, S, D), np.float32)),
        {},
        "needs num_heads=",
    ),
    "5-D input": (replace(good(), input=np.ones((1, B, H, S, D), np.float32)), {}, "5-D"),
    "odd rotary dim": (good(), {"rotary_embedding_dim": 3}, "must be even.*got 3"),
    "negative rotary dim": (good(), {"rotary_embedding_dim": -2}, "got -2"),
    "rotary dim > head": (good(), {"rotary_embedding_dim": 10}, "head size 8, got 10"),
    "odd head size": (
        {
            "input": np.ones((B, H, S, 7), np.float32),
            "cos_cache": np.ones((10, 3), np.float32),
            "sin_cache": np.ones((10, 3), np.float32),
            "position_ids": np.zeros((B, S), np.int64),
        },
        {},
        "head size 7 is odd",
    ),
    "cache last dim": (
        replace(
            good(), cos_cache=np.ones((10, 3), np.float32), sin_cache=np.ones((10, 3), np.float32)
        ),
        {},
        "last dimension must be rotary_dim/2 = 4, got 3",
    ),
    "cache last dim for partial rotary": (good(), {"rotary_embedding_dim": 4}, "= 2, got 4"),
    "3-D caches with ids": (
        replace(
            good(),
            cos_cache=np.ones((B, S, 4), np.float32),
            sin_cache=np.ones((B, S, 4), np.float32),
        ),
        {},
        "must be 2-D",
    ),
    "2-D caches without ids": (
        replace(good(), position_ids=None),
        {},
        r"must be 3-D .* = \(2, 4, 4\)",
    ),
    "caches of another batch": (
        replace(
            good(with_ids=False),
            cos_cache=np.ones((1, S, 4), np.float32),
            sin_cache=np.ones((1, S, 4), np.float32),
        ),
        {},
        r"got \(1, 4, 4\)",
    ),
    "cos and sin shapes differ": (
        replace(good(), sin_cache=np.ones((11, 4), np.float32)),
        {},
        "same shape",
    ),
    "position ids shape": (
        replace(good(), position_ids=np.zeros((B, S + 1), np.int64)),
        {},
        r"\[batch, seq_len\] = \(2, 4\), got \(2, 5\)",
    ),
}


@pytest.mark.parametrize("case", VALUE_ERRORS, ids=str)
def test_value_errors(device, case):
    args, kwargs, fragment = VALUE_ERRORS[case]
    out = np.full(args["input"].shape, 7.0, np.float32) if args["input"].ndim == 4 else None
    with pytest.raises(ValueError, match=fragment):
        call(device, args, out=out, **kwargs)
    # With an out of the usual shape, even one that does not fit, the same error first.
    with pytest.raises(ValueError, match=fragment):
        call(device, args, **kwargs)


@pytest.mark.parametrize("head", [D + 2, D - 2])
def test_out_of_wrong_shape_is_value_error(device, head):
    with pytest.raises(ValueError, match=r"out must have the input's shape \(2, 3, 4, 8\)"):
        call(device, good(), out=np.zeros((B, H, S, head), np.float32))


def test_read_only_out_is_value_error():
    out = np.zeros((B, H, S, D), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        numba_rope.rotary_embedding(**good(), out=out)
    assert not out.any()  # nothing written


@pytest.mark.parametrize(
    ("bad_value", "where", "id_dtype"),
    [
        (-1, [1, 2], np.int64),
        (10, [0, 3], np.int64),
        (2**40, [1, 0], np.int64),
        (-(2**31), [0, 0], np.int32),
        (10, [1, 3], np.int32),
        (10, [0, 3], np.int32),
        (200, [1, 1], np.uint8),
        (2**64 - 1, [1, 1], np.uint64),  # reported exactly, not as -1
    ],
)
def test_out_of_range_position_ids(device, bad_value, where, id_dtype):
    args = good()
    ids = np.zeros((B, S), id_dtype)
    ids[tuple(where)] = bad_value
    message = rf"position_ids\[{where[0]}, {where[1]}\] = {bad_value} .* \[0, 9\]"
    with pytest.raises(IndexError, match=message):
        call(device, replace(args, position_ids=ids))
    # In place: the input is left as it was.
    on, off = device
    x = on(args["input"])
    with pytest.raises(IndexError, match=message):
        numba_rope.rotary_embedding(x, on(args["cos_cache"]), on(args["sin_cache"]), on(ids), out=x)
    np.testing.assert_array_equal(off(x), args["input"])


def test_first_bad_position_is_the_first_in_row_major_order(rng, device):
    on, _ = device
    x, cos, sin, ids = make_case(rng, (3, 1, 5, 4), np.float32, n_positions=6)
    ids[2, 0] = 50
    ids[1, 3] = -7
    ids[1, 4] = 99
    with pytest.raises(IndexError, match=r"position_ids\[1, 3\] = -7"):
        numba_rope.rotary_embedding(on(x), on(cos), on(sin), on(ids))


def test_in_place_input_is_untouched_on_error(device):
    on, off = device
    args = {name: on(value) for name, value in good().items()}
    x = args["input"]
    ids = on(np.full((B, S), 99, np.int64))
    before = off(x).copy()
    with pytest.raises(IndexError):
        numba_rope.rotary_embedding(**replace(args, position_ids=ids), out=x)
    np.testing.assert_array_equal(off(x), before)


def test_bad_ids_are_refused_even_when_there_is_nothing_to_rotate(device):
    on, _ = device
    x = on(np.zeros((B, 0, S, D), np.float32))  # no heads
    cache = on(np.ones((10, D // 2), np.float32))
    ids = np.zeros((B, S), np.int64)
    ids[1, 2] = 10
    with pytest.raises(IndexError, match=r"position_ids\[1, 2\] = 10"):
        numba_rope.rotary_embedding(x, cache, cache, on(ids))
    with pytest.raises(IndexError, match=r"position_offset\[0\] = 8"):
        numba_rope.rotary_embedding(x, cache, cache, position_offset=on(np.array([8, 0])))


def test_caches_too_short_for_any_position_say_so(device):
    # Caches of 0 rows (or fewer rows than the sequence's tokens, with an offset) leave
    # no valid id or offset: the message says so (and, for an offset, how many rows
    # it needs), not an empty range such as [0, -1]. On the (simulated) GPU too.
    on, _ = device
    x = on(np.ones((1, 1, 3, 4), np.float32))
    empty = on(np.ones((0, 2), np.float32))
    with pytest.raises(IndexError, match=r"which have 0 rows: no position id is valid"):
        numba_rope.rotary_embedding(x, empty, empty, on(np.array([[0, 1, 2]])))
    short = on(np.ones((2, 2), np.float32))
    with pytest.raises(
        IndexError,
        match=r"no offset fits seq_len 3 in 2 rows; this offset needs caches of at least 4 rows",
    ):
        numba_rope.rotary_embedding(x, short, short, position_offset=1)
    # with rows enough for some offsets, the range is named
    four = on(np.ones((4, 2), np.float32))
    with pytest.raises(IndexError, match=r"offsets must lie in \[0, 1\] for seq_len 3"):
        numba_rope.rotary_embedding(x, four, four, position_offset=2)
