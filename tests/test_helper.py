"""The helper thread (numba_rope._cpu.helper, numba_rope._cpu.relay): calls between
``config.HELPER_MIN_ELEMENTS`` and ``config.PARALLEL_MIN_ELEMENTS`` share their chunks
with one more thread, and must give the contract's bits whichever thread takes which
chunk, never wait for a helper that has not taken one, and leave no thread behind.

The chunks a helper takes depend on timing; so the runner (what the helper calls for
a chunk) is also tested on its own, chunk by chunk, from the control block a call
left behind, and the caller alone with a block another caller holds.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time

import numba
import numpy as np
import pytest
from oracles import BFLOAT16, assert_bitwise_equal, float32_contract, make_case
from plan_counting import fresh_plan_tables

import numba_rope
from numba_rope import config
from numba_rope._cpu import backend as cpu_backend
from numba_rope._cpu import helper, relay
from numba_rope._cpu.kernels import DONE
from numba_rope._jit import thread_count

#: For tests of calls that go to the helper: on one numba thread (NUMBA_NUM_THREADS=1,
#: or a machine of one CPU) no call does (``helper.usable``).
TWO_THREADS = pytest.mark.skipif(
    thread_count() < 2, reason="one numba thread: no call goes to the helper"
)

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16]
RUNNER = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64)


@pytest.fixture
def relay_always(monkeypatch):
    """Every call below the parallel kernels' size goes through the helper's job
    protocol, and the options of the relayed kernels launched are recorded."""
    monkeypatch.setattr(config, "HELPER_MIN_ELEMENTS", 0)
    fresh_plan_tables(monkeypatch)
    asked = []
    kernels = cpu_backend.kernels

    def recording(*options):
        chosen = kernels(*options)

        def relayed(*args):
            asked.append(chosen.options)
            return chosen.relayed(*args)

        return chosen._replace(relayed=relayed)

    monkeypatch.setattr(cpu_backend, "kernels", recording)
    return asked


def _case(rng, dtype, positions, shape=(3, 4, 5, 16)):
    """``(x, cos, sin, keyword arguments)`` of a call with positions of this kind."""
    if positions == "per-token caches":
        x, cos, sin, _ = make_case(rng, shape, dtype, position_ids=False)
        return x, cos, sin, {}
    x, cos, sin, ids = make_case(rng, shape, dtype, n_positions=32)
    if positions == "ids":
        return x, cos, sin, {"position_ids": ids}
    if positions == "offset":
        return x, cos, sin, {"position_offset": 7}
    return x, cos, sin, {"position_offset": np.arange(shape[0]) * 7 % 25}


def _expected(x, cos, sin, kwargs):
    ids = kwargs.get("position_ids")
    offset = kwargs.get("position_offset")
    if offset is not None:
        offsets = np.broadcast_to(np.asarray(offset), (x.shape[0],))
        ids = offsets[:, None] + np.arange(x.shape[2])
    return float32_contract(x, cos, sin, ids)


POSITIONS = ["ids", "offset", "offsets", "per-token caches"]
#: Each dtype with position ids, each other kind of positions in float32 (every kind of
#: job compiles a kernel and a runner of its own: the full product would cost minutes).
CASES = [pytest.param(d, "ids", id=f"{d.name}-ids") for d in DTYPES] + [
    pytest.param(DTYPES[0], p, id=f"float32-{p}") for p in POSITIONS[1:]
]
#: CASES out of place; in place (one more kernel option, orthogonal to the positions)
#: with position ids in each dtype: each case compiles 14-21 s on a 2-core CI machine.
RELAYED_CASES = [pytest.param(*case.values, False, id=f"out-{case.id}") for case in CASES] + [
    pytest.param(d, "ids", True, id=f"in-place-{d.name}-ids") for d in DTYPES
]


@TWO_THREADS
@pytest.mark.parametrize(("dtype", "positions", "in_place"), RELAYED_CASES)
def test_relayed_calls_give_the_contract_bits(rng, relay_always, dtype, positions, in_place):
    x, cos, sin, kwargs = _case(rng, dtype, positions)
    k = rng.standard_normal((3, 2, 5, 16)).astype(dtype)
    expected, expected_k = _expected(x, cos, sin, kwargs), _expected(k, cos, sin, kwargs)
    for _ in range(3):  # the first through the general path, the others through plans
        q_in, k_in = x.copy(), k.copy()
        if in_place:
            got = numba_rope.rotary_embedding(q_in, cos, sin, out=q_in, **kwargs)
            got_q, got_k = numba_rope.rotary_embedding_qk(
                x.copy(), k_in, cos, sin, out_k=k_in, **kwargs
            )
        else:
            got = numba_rope.rotary_embedding(q_in, cos, sin, **kwargs)
            got_q, got_k = numba_rope.rotary_embedding_qk(q_in, k_in, cos, sin, **kwargs)
        assert_bitwise_equal(got, expected)
        assert_bitwise_equal(got_q, expected)
        assert_bitwise_equal(got_k, expected_k)
    assert len(relay_always) >= 2  # the job protocol ran, on the general path and on plans


@TWO_THREADS
def test_strided_rows_and_layouts_are_relayed_too(rng, relay_always):
    x, cos, sin, ids = make_case(rng, (2, 6, 3, 32), np.float32, n_positions=16)
    columns = np.ascontiguousarray(x.transpose(0, 2, 1, 3))[..., ::2]  # BSHD, strided rows
    got = numba_rope.rotary_embedding(columns, cos[:, :8], sin[:, :8], ids, layout="bshd")
    expected = float32_contract(
        np.ascontiguousarray(columns.transpose(0, 2, 1, 3)), cos[:, :8], sin[:, :8], ids
    )
    assert_bitwise_equal(got, expected.transpose(0, 2, 1, 3))
    assert relay_always and relay_always[0][2] is False  # the strided row code


@TWO_THREADS
def test_sequences_that_share_cache_lines_stay_on_one_thread(rng, relay_always, monkeypatch):
    # Fortran order holds the sequences' elements side by side: split between two
    # threads by sequence, each would take the other's lines at every store
    # (backend.sequences_apart). Such calls stay on the calling thread, by the general
    # path and by plans, below the parallel kernels' size and above it.
    x, cos, sin, ids = make_case(rng, (2, 6, 3, 32), np.float32, n_positions=16)
    expected = float32_contract(x, cos, sin, ids)
    in_parallel = []
    run_parallel = cpu_backend._run_parallel

    def recording(kernel, args):
        in_parallel.append(True)
        return run_parallel(kernel, args)

    monkeypatch.setattr(cpu_backend, "_run_parallel", recording)
    for parallel_from in (None, 0):
        if parallel_from is not None:
            monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", parallel_from)
        for order, shared in (("F", False), ("C", True)):
            relay_always.clear()
            in_parallel.clear()
            out = np.empty_like(x, order=order)
            for _ in range(3):  # the general path, then plans
                numba_rope.rotary_embedding(np.array(x, order=order), cos, sin, ids, out=out)
                assert_bitwise_equal(out, expected)
            assert bool(relay_always or in_parallel) is shared, (parallel_from, order)
            assert bool(in_parallel) is (shared and parallel_from is not None)


def _kernel_positions(kwargs):
    """The positions as the kernels take them: ids, None, one int64 offset or an int64
    array of offsets."""
    if "position_ids" in kwargs:
        return kwargs["position_ids"]
    offset = kwargs.get("position_offset")
    if offset is None:
        return None
    return np.int64(offset) if np.ndim(offset) == 0 else np.asarray(offset, np.int64)


def _run_chunks_alone(runner, block):
    """What the helper does, chunk by chunk, on this thread."""
    call = RUNNER(runner)
    for chunk in range(int(block[relay.CHUNKS])):
        call(block.ctypes.data, chunk)


@pytest.mark.parametrize(("dtype", "positions"), CASES)
@pytest.mark.parametrize("two", [False, True], ids=["one", "q+k"])
def test_the_runner_rotates_each_chunk_as_the_caller_does(rng, dtype, positions, two):
    # A call on a block of its own (no helper: the caller takes every chunk) leaves
    # its arguments there; the outputs are then wiped and every chunk is run again
    # through the runner, as the helper runs it.
    x, cos, sin, kwargs = _case(rng, dtype, positions, shape=(4, 6, 3, 16))
    k = rng.standard_normal((4, 3, 3, 16)).astype(dtype) if two else None
    block = np.zeros(relay.BLOCK_SLOTS, np.int64)
    storage = cpu_backend.storage_dtype(np.dtype(dtype))
    store = (lambda a: a) if storage is None else (lambda a: a.view(storage))
    out = np.empty_like(x)
    out_k = None if k is None else np.empty_like(k)
    options = (False, False, True, 0, dtype == BFLOAT16, False, False)
    relayed = cpu_backend.kernels(*options).relayed
    positions_arg = _kernel_positions(kwargs)
    arrays = (store(x), None if k is None else store(k), store(cos), store(sin), positions_arg)
    runner = cpu_backend.kernels(*options).runner(*arrays)
    tile, n_groups, n_chunks = cpu_backend.work_split(4, 6, 3, True, 2)
    args = (*arrays, store(out), None if k is None else store(out_k), 16, True)
    status = relayed(*args, tile, n_groups, n_chunks, block, runner)
    assert status == DONE
    expected = _expected(x, cos, sin, kwargs)
    assert_bitwise_equal(out, expected)
    out[...] = 0
    if two:
        out_k[...] = 0
    _run_chunks_alone(runner, block)
    assert_bitwise_equal(out, expected)
    if two:
        assert_bitwise_equal(out_k, _expected(k, cos, sin, kwargs))


def test_a_caller_finding_the_block_taken_runs_alone(rng):
    x, cos, sin, ids = make_case(rng, (4, 6, 3, 16), np.float32, n_positions=16)
    block = np.zeros(relay.BLOCK_SLOTS, np.int64)
    block[relay.OWNER] = 1  # another caller's job
    options = (False, False, True, 0, False, False, False)
    chosen = cpu_backend.kernels(*options)
    relayed, runner = chosen.relayed, chosen.runner(x, None, cos, sin, ids)
    out = np.empty_like(x)
    status = relayed(x, None, cos, sin, ids, out, None, 16, True, 1024, 2, 8, block, runner)
    assert status == DONE
    assert_bitwise_equal(out, float32_contract(x, cos, sin, ids))
    assert block[relay.CLAIM] == 0 and block[relay.OWNER] == 1  # nothing published


def test_after_missed_jobs_calls_run_alone_and_probe_twice_in_a_row(rng):
    # No helper serves this block, so every published job is a miss. After
    # MISSES_BEFORE_ALONE of them calls run alone, publishing two jobs in a row every
    # PROBE_EVERY calls (the first wakes a sleeping helper, the second finds it
    # spinning); a job the helper took part in ends it.
    x, cos, sin, ids = make_case(rng, (4, 6, 3, 16), np.float32, n_positions=16)
    block = np.zeros(relay.BLOCK_SLOTS, np.int64)
    block[relay.SYSCALL] = 1  # as if there were a futex (no helper sleeps on it here)
    block[relay.MOVES] = 5  # the helper's moves so far: taken as calls go alone
    options = (False, False, True, 0, False, False, False)
    chosen = cpu_backend.kernels(*options)
    relayed, runner = chosen.relayed, chosen.runner(x, None, cos, sin, ids)
    out = np.empty_like(x)
    published = []
    for call in range(relay.MISSES_BEFORE_ALONE + 2 * relay.PROBE_EVERY + 2):
        before = block[relay.GENERATION]
        status = relayed(x, None, cos, sin, ids, out, None, 16, True, 1024, 2, 8, block, runner)
        assert status == DONE
        if block[relay.GENERATION] != before:
            published.append(call)
    assert_bitwise_equal(out, float32_contract(x, cos, sin, ids))
    alone = relay.MISSES_BEFORE_ALONE
    probes = [alone + relay.PROBE_EVERY - 2, alone + relay.PROBE_EVERY - 1]
    probes += [p + relay.PROBE_EVERY for p in probes]
    assert published == list(range(alone)) + probes
    assert block[relay.MISSES] == alone + 4 and block[relay.MOVES_SEEN] == 5
    # The helper finished a chunk of the next job: it is back, calls publish again.
    block[relay.MISSES] = 0
    block[relay.SKIPPED] = 0
    for _ in range(3):
        before = block[relay.GENERATION]
        relayed(x, None, cos, sin, ids, out, None, 16, True, 1024, 2, 8, block, runner)
        assert block[relay.GENERATION] == before + 1


@TWO_THREADS
def test_the_helper_takes_chunks_and_the_bits_do_not_change(rng, monkeypatch):
    # Timing decides which chunks the helper takes; with it spinning between calls it
    # takes some within a few calls on any machine with a second core (10 s at most).
    if os.cpu_count() == 1:
        pytest.skip("one core: the helper may never run while the caller does")
    monkeypatch.setattr(config, "HELPER_MIN_ELEMENTS", 0)
    monkeypatch.setattr(config, "HELPER_SPIN_MICROSECONDS", 10**6)
    x, cos, sin, ids = make_case(rng, (64, 16, 1, 128), np.float32, n_positions=256)
    expected = float32_contract(x, cos, sin, ids)
    out = np.empty_like(x)
    block = helper.helper().block
    before = int(block[relay.FINISHED])  # counted over the process's jobs, never reset
    shared = 0
    deadline = time.monotonic() + 10
    while shared == 0 and time.monotonic() < deadline:
        out[...] = np.nan
        # Every call publishes: a loaded machine (CI's tests run two processes with a
        # helper each on two cores) may have sent calls into running alone (see
        # relay.worth_sharing, tested on its own above), which is not what this tests.
        block[relay.MISSES] = 0
        numba_rope.rotary_embedding(x, cos, sin, ids, out=out)
        assert_bitwise_equal(out, expected)
        shared = int(block[relay.FINISHED]) - before  # chunks the helper ran in this test
    assert shared > 0
    # Between jobs the helper has finished every chunk it claimed, and no other.
    assert block[relay.FINISHED] == block[relay.HANDED]
    assert any(t.name == "numba_rope helper" for t in threading.enumerate())
    assert block[relay.STATE] == relay.SERVING and block[relay.OWNER] == 0


@numba.njit
def _claims_across_a_new_job(block):
    """A helper's claims with the CLAIM words it could have read around the
    publication of a job of 8 chunks after one of 2 (no runner is called)."""
    relay.publish(block, 0, 2)  # the caller has chunk 0
    for _ in range(3):  # the caller takes the last job's other chunk, and past its end
        relay.claim_own(block)
    stale = relay.atomic_load(block, relay.CLAIM)  # the caller's count at 4, of the last job
    relay.prepare(block, 0, 8)  # with the new job's CHUNKS (8) the stale word leaves chunks
    closed = relay.atomic_load(block, relay.CLAIM)
    prepared = (relay.try_claim(block, stale), relay.try_claim(block, closed))
    relay.open_claims(block)
    fresh = relay.atomic_load(block, relay.CLAIM)
    opened = (relay.try_claim(block, stale), relay.try_claim(block, closed))
    return prepared, opened, relay.try_claim(block, fresh), relay.claim_own(block)


def test_a_claim_word_of_the_last_job_claims_nothing_of_the_next():
    # The helper reads CLAIM, then CHUNKS, then swaps the word it read for one with a
    # chunk more taken. A word read during the last job (no chunk left of it) must
    # claim nothing of the next job once that job's CHUNKS are larger: publishing
    # closes the old word (new generation, caller's count full) before it writes
    # CHUNKS, then opens it with the caller's chunk 0 taken. When CHUNKS changed first, a helper
    # between the two ran a chunk of the new job that the job handed out again
    # (rotated twice in place) and counted it as finished.
    block = np.zeros(relay.BLOCK_SLOTS, np.int64)
    prepared, opened, fresh, caller = _claims_across_a_new_job(block)
    assert prepared == (-1, -1)  # neither the stale word nor the closed one
    assert opened == (-1, -1)
    assert (fresh, caller) == (7, 1)  # the open job: its last chunk, then the caller's next
    assert block[relay.CHUNKS] == 8 and block[relay.FINISHED] == 0


@numba.njit
def _stale_claims_of_smaller_jobs(block, first, then):
    """Claims the helper could make with the words of a job of ``first`` chunks, read
    after the caller had taken all of them, during and after the publication of a job
    of ``then`` chunks (no more than ``first``: its claims are not closed first)."""
    relay.publish(block, 0, first)  # the caller has chunk 0
    stale = np.empty(first + 1, np.int64)
    for i in range(first):  # each word the caller sees, as run_job claims its chunks
        stale[i] = relay.atomic_load(block, relay.CLAIM)
        relay.claim_own(block)
    stale[first] = relay.atomic_load(block, relay.CLAIM)  # as the caller finished
    taken = np.empty(2 * stale.size, np.int64)
    relay.prepare(block, 0, then)
    for i in range(stale.size):
        taken[i] = relay.try_claim(block, stale[i])
    relay.open_claims(block)
    for i in range(stale.size):
        taken[stale.size + i] = relay.try_claim(block, stale[i])
    return stale, taken, relay.try_claim(block, relay.atomic_load(block, relay.CLAIM))


@pytest.mark.parametrize(("first", "then"), [(2, 2), (8, 8), (8, 2), (3, 1)])
def test_a_job_of_no_more_chunks_needs_no_closing(first, then):
    # Publishing a job of no more chunks than the last leaves the last word in CLAIM
    # until it opens the new one (one write of the line the helper spins on, instead
    # of two). Only the word the caller left at the end of the last job is there
    # then, and it leaves no chunk of the new one; once opened, no old word matches.
    block = np.zeros(relay.BLOCK_SLOTS, np.int64)
    stale, taken, fresh = _stale_claims_of_smaller_jobs(block, first, then)
    ended = stale[-1]  # the last job's word as its caller finished
    assert (ended & relay.CHUNK_MASK) + ((ended >> relay.TAKEN_SHIFT) & relay.CHUNK_MASK) > first
    assert taken[stale.size - 1] == -1  # the ended word, with the new job prepared
    assert (taken[stale.size :] == -1).all()  # every old word, once the job is open
    assert fresh == (then - 1 if then > 1 else -1)  # the open job's last chunk


@numba.njit
def _claims_in_turns(block, n_chunks, turns):
    """The chunks the caller (turn 0) and the helper (turn 1) claim, in the order of
    ``turns``, of a job of ``n_chunks`` chunks (no runner is called): -1 where a claim
    found none."""
    relay.publish(block, 0, n_chunks)
    claimed = np.empty(turns.size, np.int64)
    for i in range(turns.size):
        if turns[i] == 0:
            chunk = relay.claim_own(block)
            claimed[i] = chunk if chunk < n_chunks else -1
        else:
            claimed[i] = relay.try_claim(block, relay.atomic_load(block, relay.CLAIM))
    return claimed


@pytest.mark.parametrize("n_chunks", [1, 2, 3, 8, 9, relay.MAX_CHUNKS])
def test_the_caller_claims_from_the_front_and_the_helper_from_the_back(rng, n_chunks):
    # Whatever the order of their claims, the caller takes the first chunks in order
    # and the helper the last ones, from the end: each chunk once, none after they
    # meet. So each thread rotates the same rows call after call while both keep pace.
    block = np.zeros(relay.BLOCK_SLOTS, np.int64)
    orders = [np.zeros(n_chunks + 2, np.int64), np.ones(n_chunks + 2, np.int64)]
    orders += [rng.integers(0, 2, n_chunks + 2) for _ in range(20)]
    for turns in orders:
        claimed = _claims_in_turns(block, n_chunks, turns)
        # chunk 0 is the caller's as it publishes the job, its claims go on from 1
        caller = np.concatenate(([0], claimed[(turns == 0) & (claimed >= 0)]))
        helper = claimed[(turns == 1) & (claimed >= 0)]
        assert np.array_equal(caller, np.arange(caller.size))
        assert np.array_equal(helper, n_chunks - 1 - np.arange(helper.size))
        assert caller.size + helper.size == n_chunks  # all taken, none twice
        taken = np.flatnonzero(claimed >= 0)
        after = taken[-1] + 1 if taken.size else 0  # (a job of one chunk has no claims)
        assert (claimed[after:] == -1).all()  # nothing after the last one


def test_jobs_shared_with_the_helper_have_at_most_the_chunks_its_claims_count(monkeypatch):
    # The claims count chunks in 16-bit fields: a job never has more than MAX_CHUNKS,
    # whatever HELPER_CHUNKS_PER_THREAD asks; numba's parallel regions (of
    # CHUNKS_PER_THREAD) are not held to it.
    monkeypatch.setattr(config, "HELPER_CHUNKS_PER_THREAD", 10**6)
    monkeypatch.setattr(config, "CHUNKS_PER_THREAD", 10**6)
    assert cpu_backend.work_split(10**6, 32, 1, True, 2)[2] == relay.MAX_CHUNKS
    assert cpu_backend.work_split(10**6, 32, 1, True)[2] > relay.MAX_CHUNKS


def test_jobs_shared_with_the_helper_are_cut_by_their_own_constant(monkeypatch):
    # HELPER_CHUNKS_PER_THREAD cuts the calls shared with the helper (the caller and
    # the helper: 2 threads), CHUNKS_PER_THREAD numba's parallel regions.
    monkeypatch.setattr(config, "HELPER_CHUNKS_PER_THREAD", 3)
    monkeypatch.setattr(config, "CHUNKS_PER_THREAD", 5)
    monkeypatch.setattr(numba, "get_num_threads", lambda: 2)
    assert cpu_backend.work_split(64, 32, 1, True, 2)[2] == 6
    assert cpu_backend.work_split(64, 32, 1, True)[2] == 10
    monkeypatch.setattr(config, "HELPER_CHUNKS_PER_THREAD", 1)
    assert cpu_backend.work_split(64, 32, 1, True, 2)[2] == 2


def test_jobs_of_more_chunks_after_fewer_rotate_each_chunk_once(rng, monkeypatch):
    # The pattern of the race above, run for real: a job of 2 chunks, then one of 8
    # in place, alternately (separate in-place k and q calls of a GQA prefill). A
    # chunk run twice is rotated twice. Timing decides whether the race is hit (once
    # in 1,400 to 20,000 pairs of calls on the 2-core VM before the fix, depending on
    # the load); this runs 4000, and failed with the old order on that VM.
    if os.cpu_count() == 1:
        pytest.skip("one core: the helper may never run while the caller does")
    monkeypatch.setattr(config, "HELPER_SPIN_MICROSECONDS", 10**5)
    monkeypatch.setattr(config, "HELPER_CHUNKS_PER_THREAD", 4)  # the split the race had
    cos, sin = numba_rope.rope_cache(8192, 16)
    small = rng.standard_normal((1, 2, 4096, 16)).astype(np.float32)  # 2 chunks
    small_out = np.empty_like(small)
    x = rng.standard_normal((1, 8, 1024, 16)).astype(np.float32)  # 8 chunks
    want = float32_contract(x, cos, sin, np.arange(5, 5 + 1024)[None])
    work = np.empty_like(x)
    block = helper.helper().block
    for _ in range(4000):
        block[relay.MISSES] = 0  # publish, loaded or not (see the test above)
        numba_rope.rotary_embedding(small, cos, sin, position_offset=3, out=small_out)
        work[...] = x
        block[relay.MISSES] = 0
        numba_rope.rotary_embedding(work, cos, sin, position_offset=5, out=work)
        assert_bitwise_equal(work, want)
    # Jobs of as many chunks as the last are published without closing the last
    # job's claims first (relay.prepare): in place, call after call, each chunk once.
    for _ in range(2000):
        work[...] = x
        block[relay.MISSES] = 0
        numba_rope.rotary_embedding(work, cos, sin, position_offset=5, out=work)
        assert_bitwise_equal(work, want)


def test_the_spin_time_is_read_at_each_call(monkeypatch):
    the_helper = helper.helper()
    monkeypatch.setattr(config, "HELPER_SPIN_MICROSECONDS", 0)
    the_helper.start()
    assert the_helper.block[relay.SPINS] == 0
    monkeypatch.setattr(config, "HELPER_SPIN_MICROSECONDS", 1000)
    the_helper.start()
    assert the_helper.block[relay.SPINS] > 0


def test_a_helper_stops_when_asked():
    own = helper.Helper()
    own.start()
    deadline = time.monotonic() + 10
    while own.block[relay.STATE] != relay.SERVING and time.monotonic() < deadline:
        time.sleep(0.001)
    assert own.block[relay.STATE] == relay.SERVING
    own.stop()
    assert own.thread is not None and not own.thread.is_alive()
    assert own.block[relay.STATE] == relay.STOPPED


def _python(script: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **environment},
    )


DECODE = textwrap.dedent("""
    import threading
    import numpy as np
    import numba_rope
    from numba_rope._cpu import helper
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32, 1, 128)).astype(np.float32)
    cos = rng.standard_normal((64, 64)).astype(np.float32)
    sin = rng.standard_normal((64, 64)).astype(np.float32)
    ids = rng.integers(0, 64, (64, 1))
    expected = numba_rope.reference.rotary_embedding(x, cos, sin, ids, precision="contract")
    def check():
        for _ in range(50):
            got = numba_rope.rotary_embedding(x, cos, sin, ids)
            assert (got.view(np.uint32) == expected.view(np.uint32)).all()
    def helpers():
        return [t for t in threading.enumerate() if t.name == "numba_rope helper"]
""")


def test_calls_share_with_the_helper_from_the_threshold_in_every_dtype(monkeypatch):
    # Elements, whatever their size: with compiled plans the float16 and bfloat16
    # calls below 64 Ki elements ran faster alone too (docs/performance.md).
    monkeypatch.setattr(config, "HELPER_MIN_ELEMENTS", 1 << 16)
    monkeypatch.setattr(helper, "thread_count", lambda: 2)
    assert helper.usable(1 << 16) and not helper.usable((1 << 16) - 1)
    monkeypatch.setattr(helper, "thread_count", lambda: 1)
    assert not helper.usable(1 << 20)


def test_one_numba_thread_starts_no_helper():
    result = _python(
        DECODE + "check()\nassert helper._helper is None and not helpers()\nprint('ok')",
        NUMBA_NUM_THREADS="1",
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_starts_a_helper_of_its_own_and_both_exit_cleanly():
    script = DECODE + textwrap.dedent("""
    check()
    parent_helper = helper._helper
    assert parent_helper is not None and len(helpers()) == 1
    pid = os.fork()
    if pid == 0:
        check()
        ok = helper._helper is not parent_helper and len(helpers()) == 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    check()
    print("ok")
    """)
    result = _python("import os\n" + script, NUMBA_NUM_THREADS="2")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_python_threads_calling_at_once_make_one_helper_and_start_one_thread():
    # Making the helper (it looks up the C library) and starting its thread (it times
    # the idle loop, compiles the loop) let other Python threads run. Both are slowed
    # here, each by a sleep, so that the four threads are inside them at once. Without
    # a lock, a helper made and dropped kept its thread, which wrote into its freed
    # CPU masks, and two threads could serve one block.
    script = DECODE + textwrap.dedent("""
    import gc, time
    def slowed(function):
        def slow(*arguments):
            time.sleep(0.05)
            return function(*arguments)
        return slow
    helper._libc_address = slowed(helper._libc_address)
    helper._turns_per_microsecond = slowed(helper._turns_per_microsecond)
    barrier, failed = threading.Barrier(4), []
    def call():
        barrier.wait()
        try:
            check()
        except BaseException as error:
            failed.append(error)
    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failed, failed
    made = [o for o in gc.get_objects() if type(o) is helper.Helper]
    assert len(made) == 1 and made[0] is helper._helper, made
    assert len(helpers()) == 1, helpers()
    print("ok")
    """)
    result = _python(script, NUMBA_NUM_THREADS="2")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_while_the_helper_is_being_started_starts_its_own():
    # The parent's lock is held at the fork (as by another thread starting the
    # helper): the child's first helper call must not wait on it for ever.
    script = DECODE + textwrap.dedent("""
    import time
    with helper._lock:
        pid = os.fork()
        if pid == 0:
            check()
            os._exit(0 if len(helpers()) == 1 else 1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise SystemExit("the child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    check()
    print("ok")
    """)
    result = _python("import os\n" + script, NUMBA_NUM_THREADS="2")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_thread_count_follows_numba_without_starting_its_threads():
    # Asking numba (numba.get_num_threads) starts its worker threads; a decode step
    # must not, or a later fork child would lose its parallel regions.
    script = textwrap.dedent("""
    import numba
    from numba.np.ufunc import parallel
    from numba_rope._jit import thread_count
    assert thread_count() == 2 and not parallel._is_initialized
    numba.set_num_threads(1)
    assert thread_count() == 1 == numba.get_num_threads()
    numba.set_num_threads(2)
    assert thread_count() == 2
    print("ok")
    """)
    result = _python(script, NUMBA_NUM_THREADS="2")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_set_num_threads_1_keeps_calls_off_the_helper():
    script = DECODE + textwrap.dedent("""
    import numba
    numba.set_num_threads(1)
    check()
    assert helper._helper is None and not helpers()
    numba.set_num_threads(2)
    check()
    assert len(helpers()) == 1
    print("ok")
    """)
    result = _python(script, NUMBA_NUM_THREADS="2")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_relayed_call_checks_positions_before_anything_is_written(rng, relay_always):
    x, cos, sin, ids = make_case(rng, (3, 4, 5, 16), np.float32, n_positions=32)
    ids[2, 3] = 32  # one past the caches
    out = np.full_like(x, 7.0)
    for _ in range(2):  # the general path, then the plan (which hands back to it)
        with pytest.raises(IndexError, match="outside the caches"):
            numba_rope.rotary_embedding(x, cos, sin, ids, out=out)
        assert (out == 7.0).all()


@TWO_THREADS
def test_without_a_futex_the_helper_sleeps_in_steps_and_still_joins(rng, monkeypatch):
    # macOS and Windows have no futex: the helper sleeps in growing steps (usleep,
    # Sleep) and joins the calls that find it awake. Forced here with SYSCALL = 0.
    if os.cpu_count() == 1:
        pytest.skip("one core: the helper may never run while the caller does")
    own = helper.Helper()
    own.block[relay.SYSCALL] = 0
    monkeypatch.setattr(helper, "_helper", own)
    monkeypatch.setattr(config, "HELPER_MIN_ELEMENTS", 0)
    monkeypatch.setattr(config, "HELPER_SPIN_MICROSECONDS", 0)  # straight to sleeping
    x, cos, sin, ids = make_case(rng, (64, 16, 1, 128), np.float32, n_positions=256)
    expected = float32_contract(x, cos, sin, ids)
    shared = 0
    deadline = time.monotonic() + 10
    try:
        while shared == 0 and time.monotonic() < deadline:
            assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids), expected)
            shared = int(own.block[relay.FINISHED])
    finally:
        own.stop()
    assert shared > 0
    assert own.block[relay.STATE] == relay.STOPPED and own.block[relay.SLEEPING] == 0


#: Linux moves a thread whose CPUs no longer include its own at once; elsewhere the
#: helper does not move (``relay.GETCPU`` is 0).
LINUX_WITH_CPUS = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not hasattr(os, "sched_getaffinity")
    or len(os.sched_getaffinity(0)) < 2
    or not helper.Helper().block[relay.GETCPU],
    reason="keep_apart moves threads on Linux, with a second CPU to move to",
)


def _on_cpu(cpu, allowed):
    """Put the calling thread on ``cpu`` (its CPUs narrowed to it, which moves it), then
    give it ``allowed`` back: it stays there until the scheduler moves it."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setaffinity(0, allowed)


def _current_cpu() -> int:
    getcpu = ctypes.CDLL(None).sched_getcpu
    getcpu.restype = ctypes.c_int
    return getcpu()


def _in_a_thread(function):
    """``function()``'s result, run on a new thread (whose CPUs it may change)."""
    results = []
    thread = threading.Thread(target=lambda: results.append(function()))
    thread.start()
    thread.join()
    return results[0]


@LINUX_WITH_CPUS
def test_a_helper_on_the_callers_cpu_moves_off_it_and_keeps_its_cpus():
    # relay.keep_apart on a thread standing in for the helper: on the CPU the caller
    # last ran on it moves to another (its CPUs set to the others, then set back) and
    # counts the move; with the caller's CPU not known, or no other CPU to go to, it
    # stays.
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    unstarted = helper.Helper()  # its addresses, masks and system calls only
    block = unstarted.block
    keep_apart = numba.njit(lambda block: relay.keep_apart(block))

    def on_the_callers_cpu():
        # The scheduler may move the thread between the two reads of its CPU (here and
        # in keep_apart): then nothing moves it. And once keep_apart has given the
        # thread its CPUs back, it may move it back before the read after (seen once in
        # CI, both cores busy). Either way the next try is the test.
        for _ in range(50):
            _on_cpu(cpu, allowed)
            here = _current_cpu()
            block[relay.CALLER_CPU] = here
            before = block[relay.MOVES]
            keep_apart(block)
            if block[relay.MOVES] == before + 1:
                now = _current_cpu()
                if now != here:
                    return here, now, os.sched_getaffinity(0)
        return here, here, os.sched_getaffinity(0)

    was, moved_to, cpus = _in_a_thread(on_the_callers_cpu)
    moves = block[relay.MOVES]  # one per try that moved it: 1 unless moved back
    assert moves >= 1
    assert moved_to != was and moved_to in allowed
    assert cpus == allowed

    def caller_not_known():
        _on_cpu(cpu, allowed)
        block[relay.CALLER_CPU] = -1  # no job published yet
        keep_apart(block)
        return os.sched_getaffinity(0)

    assert _in_a_thread(caller_not_known) == allowed
    assert block[relay.MOVES] == moves

    def on_one_cpu():
        os.sched_setaffinity(0, {cpu})
        block[relay.CALLER_CPU] = cpu
        keep_apart(block)
        return _current_cpu(), os.sched_getaffinity(0)

    assert _in_a_thread(on_one_cpu) == (cpu, {cpu})
    assert block[relay.MOVES] == moves


@LINUX_WITH_CPUS
def test_a_sleeping_helper_is_woken_with_the_callers_cpu_taken_out_of_its_cpus():
    # What a caller does around waking the helper (relay.open_claims), on a thread
    # asleep: its CPUs less the caller's (the kernel then wakes it on another), then
    # its CPUs back; nothing where no other CPU is allowed.
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    unstarted = helper.Helper()
    block = unstarted.block
    masks = block[relay.MASKS] + 16 * relay.MASK_WORDS  # the callers' two
    exclude = numba.njit(
        lambda block, thread, cpu, masks: relay.exclude_cpu(block, thread, cpu, masks)
    )
    restore = numba.njit(lambda block, thread, masks: relay.restore_cpus(block, thread, masks))
    asleep, done = threading.Event(), threading.Event()

    def sleeper():
        asleep.set()
        done.wait()

    thread = threading.Thread(target=sleeper)
    thread.start()
    asleep.wait()
    try:
        assert exclude(block, thread.native_id, cpu, masks)
        assert os.sched_getaffinity(thread.native_id) == allowed - {cpu}
        restore(block, thread.native_id, masks)
        assert os.sched_getaffinity(thread.native_id) == allowed
        os.sched_setaffinity(thread.native_id, {cpu})
        assert not exclude(block, thread.native_id, cpu, masks)
        assert os.sched_getaffinity(thread.native_id) == {cpu}
        assert not exclude(block, thread.native_id, 64 * relay.MASK_WORDS, masks)
    finally:
        done.set()
        thread.join()


def test_a_call_that_finds_the_helper_asleep_runs_alone_and_wakes_it(rng):
    # Woken by a job, the helper would come late to it and the caller would wait for
    # the chunks it claimed: a call that finds it asleep on its futex wakes it for the
    # calls after and runs alone, a miss. After MISSES_BEFORE_ALONE of them in a row
    # calls stop waking it, but for the probes (see the test above).
    x, cos, sin, ids = make_case(rng, (4, 6, 3, 16), np.float32, n_positions=16)
    block = helper.Helper().block  # never started: no thread sleeps on its futex
    if block[relay.SYSCALL] == 0:
        pytest.skip("no futex here: a sleeping helper is not woken by calls")
    options = (False, False, True, 0, False, False, False)
    chosen = cpu_backend.kernels(*options)
    relayed, runner = chosen.relayed, chosen.runner(x, None, cos, sin, ids)
    expected = float32_contract(x, cos, sin, ids)
    woken = []
    for call in range(relay.MISSES_BEFORE_ALONE + relay.PROBE_EVERY):
        out = np.full_like(x, np.nan)
        block[relay.SLEEPING] = 1
        before = block[relay.GENERATION]
        status = relayed(x, None, cos, sin, ids, out, None, 16, True, 1024, 2, 8, block, runner)
        assert status == DONE and block[relay.GENERATION] == before  # run alone
        assert block[relay.OWNER] == 0
        assert_bitwise_equal(out, expected)
        if block[relay.SLEEPING] == 0:
            woken.append(call)
    alone = relay.MISSES_BEFORE_ALONE
    assert woken == [*range(alone), alone + relay.PROBE_EVERY - 2, alone + relay.PROBE_EVERY - 1]
    assert block[relay.MISSES] == alone + 2
    # Awake (spinning, or busy elsewhere): the job is published as before.
    block[relay.MISSES] = block[relay.SKIPPED] = 0
    before = block[relay.GENERATION]
    relayed(x, None, cos, sin, ids, out, None, 16, True, 1024, 2, 8, block, runner)
    assert block[relay.GENERATION] == before + 1 and block[relay.MISSES] == 1


def test_calls_run_alone_share_again_once_the_helper_has_moved(rng):
    # A helper that has moved off the caller's CPU (MOVES changed) has a core again:
    # calls running alone for want of it publish at once, without waiting for a probe.
    x, cos, sin, ids = make_case(rng, (4, 6, 3, 16), np.float32, n_positions=16)
    block = np.zeros(relay.BLOCK_SLOTS, np.int64)
    block[relay.SYSCALL] = 1  # as if there were a futex (no helper sleeps on it here)
    block[relay.MISSES] = relay.MISSES_BEFORE_ALONE
    block[relay.SKIPPED] = 1  # between probes
    block[relay.MOVES] = block[relay.MOVES_SEEN] = 3  # moves before calls went alone
    options = (False, False, True, 0, False, False, False)
    chosen = cpu_backend.kernels(*options)
    relayed, runner = chosen.relayed, chosen.runner(x, None, cos, sin, ids)
    out = np.empty_like(x)

    def call():
        before = block[relay.GENERATION]
        status = relayed(x, None, cos, sin, ids, out, None, 16, True, 1024, 2, 8, block, runner)
        assert status == DONE
        return block[relay.GENERATION] != before

    assert not call()  # alone
    block[relay.MOVES] += 1
    assert call()  # published: a miss (no helper here) counted from 0 again
    assert block[relay.MISSES] == 1 and block[relay.MOVES_SEEN] == block[relay.MOVES]
    assert all(call() for _ in range(relay.MISSES_BEFORE_ALONE - 1))
    assert not call()  # alone again after as many misses as ever
    assert_bitwise_equal(out, float32_contract(x, cos, sin, ids))


@TWO_THREADS
@LINUX_WITH_CPUS
def test_a_helper_put_on_the_callers_cpu_ends_off_it(rng, monkeypatch):
    # The caller kept on one CPU, the helper put there too: every call gives the
    # contract's bits, each published job names the caller's CPU, and within a few
    # calls the helper runs elsewhere with its CPUs as they were (keep_apart when a
    # job wakes it or while it spins; the scheduler may move it first, so this does
    # not show which did: the test above does, on a thread of its own).
    allowed = os.sched_getaffinity(0)
    own = helper.Helper()
    monkeypatch.setattr(helper, "_helper", own)
    monkeypatch.setattr(config, "HELPER_MIN_ELEMENTS", 0)
    x, cos, sin, ids = make_case(rng, (64, 16, 1, 128), np.float32, n_positions=256)
    expected = float32_contract(x, cos, sin, ids)
    cpu = _current_cpu()
    os.sched_setaffinity(0, {cpu})
    try:
        assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids), expected)
        helper_id = own.thread.native_id
        os.sched_setaffinity(helper_id, {cpu})
        os.sched_setaffinity(helper_id, allowed)

        def helper_cpu():
            with open(f"/proc/self/task/{helper_id}/stat") as stat:
                return int(stat.read().rsplit(")", 1)[1].split()[36])

        # Off the caller's CPU with its CPUs as they were, seen at one look: the helper
        # sets its CPUs back just after it moves (keep_apart), and a look between the
        # two (a VM's CPU may stop the helper there) found it moved, its CPUs not yet
        # set back (once in a clean-clone CI on the 2-core Zen 4 VM, 2026-12-08).
        deadline = time.monotonic() + 10
        while True:
            where, cpus = helper_cpu(), os.sched_getaffinity(helper_id)
            if (where != cpu and cpus == allowed) or time.monotonic() > deadline:
                break
            assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids), expected)
        assert where != cpu and cpus == allowed, (where, cpus, cpu, allowed)
        assert own.block[relay.CALLER_CPU] == cpu
    finally:
        os.sched_setaffinity(0, allowed)
        own.stop()
