"""The output pool of allocating CPU calls (``config.OUTPUT_POOL_BYTES``).

An output taken from the pool must be one that nothing refers to any more: no result a
caller still holds, nor any view of one, may be written by a later call. Results must
be the contract's bits whether the pool is on or off.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import BFLOAT16, assert_bitwise_equal, float32_contract, make_case

import numba_rope
from numba_rope import config
from numba_rope._cpu import pool


@pytest.fixture
def pooled(monkeypatch):
    """Pool on for tiny arrays, and every call on the general path (``run``)."""
    monkeypatch.setattr(pool, "MIN_BYTES", 0)
    monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(config, "OUTPUT_POOL_BYTES", 1 << 20)
    pool.clear()  # buffers of earlier calls in this process (in use or not)
    yield
    pool.clear()


def _address(array):
    return array.__array_interface__["data"][0]


def test_on_by_default_for_large_outputs_within_its_bound(rng):
    assert config.OUTPUT_POOL_BYTES == 256 << 20
    assert pool.MIN_BYTES == 16 << 20
    x, cos, sin, ids = make_case(rng, (1, 8, 4096, 128), np.float32)  # 16 MiB
    expected = float32_contract(x, cos, sin, ids)
    pool.clear()  # buffers of earlier calls in this process (in use or not)
    try:
        for _ in range(3):  # the general path, then the plan's: both pooled
            result = numba_rope.rotary_embedding(x, cos, sin, ids)
            assert result.base is not None and pool.held_bytes() == x.nbytes
            assert _address(result) % 64 == 0  # on a line (see test_pooled_outputs_...)
            assert_bitwise_equal(result, expected)
            del result
        half = np.ascontiguousarray(x[:, :4])
        for _ in range(3):
            small = numba_rope.rotary_embedding(half, cos, sin, ids)
            assert pool.held_bytes() == x.nbytes  # under pool.MIN_BYTES: not pooled
        assert_bitwise_equal(small, expected[:, :4])
    finally:
        pool.clear()


def _on_line(array):
    return _address(array) % 64 == 0


@pytest.mark.parametrize("shape", [(64, 32, 1, 128), (2, 4, 512, 32)], ids=["decode", "prefill"])
def test_float32_outputs_of_allocating_calls_start_on_lines(rng, shape):
    # From pool.LINE_MIN_BYTES up, below the pool's bound: the general path, then the
    # compiled plan's (the third call), one tensor and q with k, on a line every time,
    # whatever glibc's heap state (small arrays allocated in between move it).
    assert pool.LINE_MIN_BYTES <= 4 * np.prod(shape) < pool.MIN_BYTES
    x, cos, sin, ids = make_case(rng, shape, np.float32)
    k = np.ascontiguousarray(x[:, : shape[1] // 4])
    expected = float32_contract(x, cos, sin, ids)
    for step in range(4):
        clutter = [np.empty(16 * step + 8, np.uint8) for _ in range(step + 1)]
        out = numba_rope.rotary_embedding(x, cos, sin, ids)
        q_out, k_out = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids)
        assert _on_line(out) and _on_line(q_out), step
        assert out.flags.c_contiguous and out.flags.writeable and out.shape == x.shape
        assert_bitwise_equal(out, expected)
        assert_bitwise_equal(q_out, expected)
        assert_bitwise_equal(k_out, expected[:, : shape[1] // 4])
        del clutter
    three_d = x.transpose(0, 2, 1, 3).reshape(shape[0], shape[2], -1)
    for _ in range(3):
        assert _on_line(numba_rope.rotary_embedding(three_d, cos, sin, ids, num_heads=shape[1]))


@pytest.mark.parametrize(
    "dtype", [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16], ids=lambda d: d.name
)
def test_pooled_outputs_start_on_lines(rng, pooled, dtype):
    # Pooled buffers are NumPy arrays, whose large ones start 16 bytes past a 64-byte
    # line (glibc's chunk header): the outputs made on them start on the line after,
    # every call (the general path, the plan, the compiled plan; one tensor, q and k),
    # whatever the heap's state, reused buffers too.
    x, cos, sin, ids = make_case(rng, (2, 4, 6, 64), dtype)
    k = np.ascontiguousarray(x[:, :1])
    expected = float32_contract(x, cos, sin, ids)
    addresses = set()
    for step in range(12):
        clutter = [np.empty(16 * (step % 4) + 8, np.uint8) for _ in range(step % 3 + 1)]
        out = numba_rope.rotary_embedding(x, cos, sin, ids)
        q_out, k_out = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids)
        for result in (out, q_out, k_out):
            assert any(result.base is buffer for buffer in pool._buffers), step  # pooled
            assert _on_line(result), step
        assert_bitwise_equal(out, expected)
        assert_bitwise_equal(q_out, expected)
        assert_bitwise_equal(k_out, expected[:, :1])
        addresses.add(_address(out))
        del out, q_out, k_out, result, clutter
    # Each call's buffers were free again at the next: the same one for the single
    # tensor's output every time, and no more buffers than one step uses. (Before
    # compilations ran on a thread of their own, a call that compiled -- the first of
    # a signature, on a cold cache -- left its buffers held by numba's cycles.)
    assert len(addresses) == 1
    assert pool.held_bytes() == 2 * x.nbytes + k.nbytes


@pytest.mark.parametrize(
    "dtype", [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16], ids=lambda d: d.name
)
def test_only_outputs_nothing_refers_to_are_reused(rng, pooled, dtype):
    _, cos, sin, ids = make_case(rng, (2, 3, 4, 16), dtype)

    def call():
        x = rng.standard_normal((2, 3, 4, 16)).astype(dtype)
        return numba_rope.rotary_embedding(x, cos, sin, ids), float32_contract(x, cos, sin, ids)

    first, first_expected = call()
    freed = {_address(first)}
    second, second_expected = call()  # the first is still held
    assert not np.shares_memory(first, second)
    view = first[1, ::2]  # held through a view only
    view_expected = first_expected[1, ::2]
    del first
    third, third_expected = call()
    freed.add(_address(third))
    assert not np.shares_memory(view, third) and not np.shares_memory(second, third)
    assert_bitwise_equal(third, third_expected)
    assert_bitwise_equal(view, view_expected)
    assert_bitwise_equal(second, second_expected)
    del view, third
    held = pool.held_bytes()
    fourth, fourth_expected = call()
    assert _address(fourth) in freed  # the first's or the third's, free now: reused
    assert pool.held_bytes() == held  # and no new buffer
    assert_bitwise_equal(fourth, fourth_expected)
    assert fourth.dtype == dtype and fourth.shape == (2, 3, 4, 16) and fourth.flags.c_contiguous


def test_q_and_k_get_outputs_of_their_own(rng, pooled):
    q, cos, sin, ids = make_case(rng, (2, 4, 3, 16), np.float32)
    k = rng.standard_normal((2, 4, 3, 16)).astype(np.float32)  # the same size as q
    held = []
    for _ in range(3):
        out_q, out_k = numba_rope.rotary_embedding_qk(q, k, cos, sin, ids)
        assert not np.shares_memory(out_q, out_k)
        assert not any(np.shares_memory(out_q, h) or np.shares_memory(out_k, h) for h in held)
        assert_bitwise_equal(out_q, float32_contract(q, cos, sin, ids))
        assert_bitwise_equal(out_k, float32_contract(k, cos, sin, ids))
        held += [out_q, out_k]


def test_the_limit_bounds_what_is_kept(rng, pooled, monkeypatch):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 16), np.float32)  # 1536 bytes
    results = [numba_rope.rotary_embedding(x, cos, sin, ids) for _ in range(4)]
    assert pool.held_bytes() == 4 * x.nbytes
    monkeypatch.setattr(config, "OUTPUT_POOL_BYTES", 2 * x.nbytes)  # releases at once
    assert pool.held_bytes() == 2 * x.nbytes
    del results
    monkeypatch.setattr(config, "OUTPUT_POOL_BYTES", x.nbytes - 1)  # too small for x
    result = numba_rope.rotary_embedding(x, cos, sin, ids)
    assert result.base is None and pool.held_bytes() == 0
    assert_bitwise_equal(result, float32_contract(x, cos, sin, ids))


def test_threads_never_share_an_output(rng, pooled):
    from concurrent.futures import ThreadPoolExecutor

    _, cos, sin, ids = make_case(rng, (2, 3, 4, 16), np.float32)
    inputs = [[rng.standard_normal((2, 3, 4, 16)).astype(np.float32) for _ in range(30)]]
    inputs *= 4

    def work(xs):
        kept = []
        for i, x in enumerate(xs):
            result = numba_rope.rotary_embedding(x, cos, sin, ids)
            if i % 2:  # keep every other result; the others go back to the pool
                kept.append((x, result))
        return kept

    with ThreadPoolExecutor(4) as executor:
        kept = [pair for pairs in executor.map(work, inputs) for pair in pairs]
    for x, result in kept:
        assert_bitwise_equal(result, float32_contract(x, cos, sin, ids))
    addresses = [_address(result) for _, result in kept]
    assert len(set(addresses)) == len(addresses)


def test_a_bad_limit_is_refused():
    with pytest.raises(ValueError, match="OUTPUT_POOL_BYTES must be an integer >= 0, got -1"):
        config.OUTPUT_POOL_BYTES = -1
    assert config.OUTPUT_POOL_BYTES == 256 << 20


def test_torch_cpu_results_hold_their_outputs(rng, pooled):
    torch = pytest.importorskip("torch")
    _, cos, sin, ids = make_case(rng, (2, 3, 4, 16), np.float32)
    cos_t, sin_t, ids_t = (torch.from_numpy(a) for a in (cos, sin, ids))
    held = []
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        x = torch.from_numpy(rng.standard_normal((2, 3, 4, 16)).astype(np.float32)).to(dtype)
        result = numba_rope.rotary_embedding(x, cos_t.to(dtype), sin_t.to(dtype), ids_t)
        expected = float32_contract(
            x.float().numpy(), cos_t.to(dtype).float().numpy(), sin_t.to(dtype).float().numpy(), ids
        )
        held.append((result, expected, dtype))
    # The three outputs came from the pool (held: none reused).
    assert pool.held_bytes() == sum(r.numel() * r.element_size() for r, _, _ in held)
    for result, expected, dtype in held:  # none overwritten by the calls after it
        want = torch.from_numpy(expected).to(dtype)  # float32 -> dtype rounds once
        assert torch.equal(result, want)
