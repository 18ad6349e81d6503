"""The kernel side of the helper thread: how a call hands chunks of its work to one
more thread that it never waits for unless that thread has taken a chunk.

A call too small for numba's parallel regions (whose worker threads the caller waits
for at a barrier, milliseconds when another process holds their core) but large
enough to gain from a second core, such as a decode step, runs as a *job*: the caller
writes its arrays into a control block, publishes the job, and takes chunks itself
from a shared counter; a helper thread (:mod:`numba_rope._cpu.helper`), spinning in
compiled code, takes chunks from the same counter. The caller waits at the end only
for chunks the helper has claimed and not finished. A helper that is asleep or
descheduled claims nothing, and the caller does all the chunks: the job never waits
for a thread that has not started on it. Every element
is computed by the same code whichever thread takes its chunk, so the result does not
depend on the split.

The control block is an int64 array of :data:`BLOCK_SLOTS` slots. Its cache lines (8
slots) are laid out by who writes them, so that a job moves as few lines between the
two cores as it can (a line the other core has read must be taken back from it before
it is written: a round trip of 0.30-0.35 us between the two cores of the Intel VM of
docs/performance.md, "Thirty-second session"):

* ``CLAIM`` (a line of its own, written by both): the job's generation (bits 32 and
  up), the chunks the helper has taken (bits 16 to 31) and the next chunk the caller
  takes (bits 0 to 15). The caller takes chunks from the front with an atomic add (the
  first one as it opens the job); the helper from the back, with a compare-and-swap of
  the whole word, so that a helper that read an old job's word claims nothing of a new
  one (a job of more chunks than the last closes the old word before it says how many
  chunks it has: see :func:`prepare`). From both ends, each thread rotates the same
  rows call after call while both keep pace (a decode step's input and output stay in
  the cache of the core that rotated them last: in the order of claims, they went to
  either core by chance).
* ``FINISHED`` (written by the helper only): the chunks the helper has finished,
  counted over all jobs, never reset; and ``MOVES``, the times it moved off the
  caller's CPU (:func:`keep_apart`).
* written by the callers only: ``OWNER`` (1 while a caller runs a job: a second caller
  runs alone), ``GENERATION``, ``SKIPPED`` (see :func:`worth_sharing`) and
  ``HANDED``, the chunks the helper has claimed over all jobs (the count ``FINISHED``
  reaches when the helper is done with them); ``CALLER_CPU``, the CPU the last
  published job's caller ran on (Linux; see :func:`keep_apart`), and ``MOVES_SEEN``
  (see :func:`worth_sharing`).
* read by the helper, written by callers only when the value changes (a decode loop's
  jobs are alike): ``RUNNER`` (the address of the compiled function that runs a chunk
  of this job's kind, see :func:`numba_rope._cpu.kernels.make_runner`), ``CHUNKS``,
  ``MISSES`` (see :func:`worth_sharing`) and ``SLEEP_UNIT``.
* ``STATE``, ``STOP``, ``SPINS``: whether the helper serves, the request to stop it,
  and how many turns it spins without work before it sleeps.
* ``SLEEPING``, ``TIMESPEC``, ``SYSCALL``, ``FUTEX``: on Linux the helper sleeps on a
  futex (``SLEEPING`` = 1) and the call that publishes a job wakes it; elsewhere it
  sleeps in short steps and joins the calls that find it awake.
* from ``ARGUMENTS`` on: the job's arrays (address, shape, strides) and integers,
  written only where they differ from the last job's (see :func:`put`).
* ``GETCPU``, ``MASKS``, ``GET_AFFINITY``, ``SET_AFFINITY``, ``HELPER_THREAD``
  (written once, before the helper starts, the last once it runs): the C library's
  ``sched_getcpu``, the CPU masks, the system calls that read and set a thread's CPUs
  and the helper thread's id (Linux; 0 elsewhere), for :func:`keep_apart`.

Everything here is a numba intrinsic (the atomics, a pause, calls through function
addresses, arrays over addresses) or a function over them; :func:`serve` is the
helper's loop, which never returns to Python (and so never needs the GIL) until it is
asked to stop.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.arrayobj import populate_array

from numba_rope._conversions import X86
from numba_rope._jit import cached_njit

#: Slots of the control block (int64), in cache lines (8 slots) by who writes them (see
#: the module's documentation).
CLAIM = 0
FINISHED = 8
MOVES = 9  # times the helper moved off the caller's CPU (keep_apart)
OWNER = 16
GENERATION = 17
SKIPPED = 18  # calls run alone since MISSES reached MISSES_BEFORE_ALONE
HANDED = 19
CALLER_CPU = 20  # the CPU the last published job's caller ran on (-1: not known)
MOVES_SEEN = 21  # MOVES when calls went alone, or last shared again (worth_sharing)
RUNNER = 24
CHUNKS = 25
MISSES = 26  # jobs in a row the helper took no chunk of
SLEEP_UNIT = 27  # microseconds per unit of the sleep function's argument
STATE = 32
STOP = 33
SPINS = 34
SLEEPING = 35
TIMESPEC = 36  # and 37: the helper's longest sleep, a struct timespec (Linux)
SYSCALL = 38  # address of the C library's ``syscall`` (Linux), else 0
FUTEX = 39  # the futex system call's number on this machine
ARGUMENTS = 40
GETCPU = 120  # address of the C library's ``sched_getcpu`` (Linux), else 0
MASKS = 121  # address of the CPU masks: 4 x MASK_WORDS int64 words (exclude_cpu)
GET_AFFINITY = 122  # the system calls sched_getaffinity and sched_setaffinity
SET_AFFINITY = 123
HELPER_THREAD = 124  # the helper thread's id (Linux, once it runs), else 0
BLOCK_SLOTS = 128

#: 64-bit words of a CPU mask (:func:`exclude_cpu`): 2048 CPUs; on a kernel built for
#: more, reading a mask fails and the helper stays where it is. The masks at ``MASKS``
#: are four: two for the helper, two for the callers.
MASK_WORDS = 32

#: ``CLAIM`` holds the generation from bit ``GENERATION_SHIFT`` on, the chunks the
#: helper has taken from bit ``TAKEN_SHIFT`` on and the caller's next chunk below them,
#: each count in ``CHUNK_MASK``. A job has at most ``MAX_CHUNKS`` chunks, so that the
#: caller's count, which goes one past the last chunk, stays below ``CHUNK_MASK``
#: (a closed word's caller count).
TAKEN_SHIFT = 16
GENERATION_SHIFT = 32
CHUNK_MASK = (1 << TAKEN_SHIFT) - 1
MAX_CHUNKS = CHUNK_MASK - 2

#: Values of ``STATE``: not started (or stopped), serving (spinning or sleeping).
STOPPED = 0
SERVING = 1

_I64 = ir.IntType(64)


def _slot_pointer(context, builder, block_type, block, slot):
    array = context.make_array(block_type)(context, builder, block)
    return builder.gep(array.data, [slot])


@intrinsic
def atomic_load(typingctx, block, slot):
    """``block[slot]``, read atomically (sequentially consistent)."""

    def codegen(context, builder, signature, args):
        pointer = _slot_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(pointer, "seq_cst", 8)

    return types.int64(block, slot), codegen


@intrinsic
def atomic_store(typingctx, block, slot, value):
    """``block[slot] = value``, atomically (sequentially consistent)."""

    def codegen(context, builder, signature, args):
        pointer = _slot_pointer(context, builder, signature.args[0], args[0], args[1])
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(value, pointer, "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(block, slot, value), codegen


@intrinsic
def fetch_add(typingctx, block, slot, value):
    """Add ``value`` to ``block[slot]`` atomically; return the value before."""

    def codegen(context, builder, signature, args):
        pointer = _slot_pointer(context, builder, signature.args[0], args[0], args[1])
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", pointer, value, "seq_cst")

    return types.int64(block, slot, value), codegen


@intrinsic
def compare_exchange(typingctx, block, slot, expected, new):
    """Set ``block[slot]`` to ``new`` if it holds ``expected``, atomically; return
    whether it did."""

    def codegen(context, builder, signature, args):
        pointer = _slot_pointer(context, builder, signature.args[0], args[0], args[1])
        expected = context.cast(builder, args[2], signature.args[2], types.int64)
        new = context.cast(builder, args[3], signature.args[3], types.int64)
        result = builder.cmpxchg(pointer, expected, new, "seq_cst", "seq_cst")
        return builder.extract_value(result, 1)

    return types.boolean(block, slot, expected, new), codegen


@intrinsic
def pause(typingctx):
    """A spin-wait hint (x86 ``pause``; nothing elsewhere): the spinning thread leaves
    the core's resources to its sibling and does not flood the memory system."""

    def codegen(context, builder, signature, args):
        if X86:
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(function, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def call_address(typingctx, address, argument):
    """Call the C function ``int f(unsigned)`` at ``address`` (``sched_yield``, whose
    argument is ignored, or ``usleep``) and return its result. The address comes at
    run time, so no pointer is compiled into code that numba caches on disk."""

    def codegen(context, builder, signature, args):
        function_type = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
        function = builder.inttoptr(args[0], function_type.as_pointer())
        argument = builder.trunc(args[1], ir.IntType(32))
        return builder.sext(builder.call(function, [argument]), _I64)

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def call_address0(typingctx, address):
    """Call the C function ``int f(void)`` at ``address`` (``sched_getcpu``) and return
    its result."""

    def codegen(context, builder, signature, args):
        function_type = ir.FunctionType(ir.IntType(32), [])
        function = builder.inttoptr(args[0], function_type.as_pointer())
        return builder.sext(builder.call(function, []), _I64)

    return types.int64(types.int64), codegen


@intrinsic
def call_syscall(typingctx, address, number, first, second, third, fourth):
    """``syscall(number, first, second, third, fourth)`` through the C library's
    ``syscall`` at ``address``, called with a fixed prototype (glibc's is a few
    instructions of assembly that read the registers only; on x86-64 and AArch64 Linux
    integer arguments go in the same registers either way)."""

    def codegen(context, builder, signature, args):
        function_type = ir.FunctionType(_I64, [_I64] * 5)
        function = builder.inttoptr(args[0], function_type.as_pointer())
        return builder.call(function, list(args[1:]))

    return types.int64(*(types.int64,) * 6), codegen


@intrinsic
def call_runner(typingctx, address, block, chunk):
    """Call the compiled ``void run(int64 block_address, int64 chunk)`` at
    ``address`` (:func:`numba_rope._cpu.kernels.make_runner`)."""

    def codegen(context, builder, signature, args):
        function_type = ir.FunctionType(ir.VoidType(), [_I64, _I64])
        function = builder.inttoptr(args[0], function_type.as_pointer())
        array = context.make_array(signature.args[1])(context, builder, args[1])
        builder.call(function, [builder.ptrtoint(array.data, _I64), args[2]])
        return context.get_dummy_value()

    return types.void(types.int64, block, types.int64), codegen


def _words_view(context, builder, address, count):
    """A C-contiguous int64 array of ``count`` (an LLVM value) words at ``address``."""
    view = context.make_array(types.Array(types.int64, 1, "C"))(context, builder)
    populate_array(
        view,
        data=builder.inttoptr(address, context.get_data_type(types.int64).as_pointer()),
        shape=cgutils.pack_array(builder, [count]),
        strides=cgutils.pack_array(builder, [context.get_constant(types.intp, 8)]),
        itemsize=context.get_constant(types.intp, 8),
        meminfo=None,
    )
    return view._getvalue()


@intrinsic
def block_at(typingctx, address):
    """The control block at ``address``, as a C-contiguous int64 array of
    :data:`BLOCK_SLOTS` slots (no copy, no reference count)."""

    def codegen(context, builder, signature, args):
        slots = context.get_constant(types.intp, BLOCK_SLOTS)
        return _words_view(context, builder, args[0], slots)

    return types.Array(types.int64, 1, "C")(types.int64), codegen


@intrinsic
def words_at(typingctx, address, count):
    """``count`` int64 words at ``address``, as a C-contiguous array (no copy, no
    reference count)."""

    def codegen(context, builder, signature, args):
        return _words_view(context, builder, args[0], args[1])

    return types.Array(types.int64, 1, "C")(types.int64, types.int64), codegen


@intrinsic
def array_at(typingctx, block, slot, like):
    """An array of ``like``'s dtype and dimensions (layout "A", writable) over the
    address, shape and strides stored in ``block`` from ``slot`` on (see
    :func:`store_array`): no copy, no reference count."""
    if not isinstance(like, types.Array):
        return None
    result = types.Array(like.dtype, like.ndim, "A")  # mutable, whatever ``like`` is

    def codegen(context, builder, signature, args):
        array_type = signature.return_type
        source = context.make_array(signature.args[0])(context, builder, args[0])
        base = args[1]

        def field(i):
            index = builder.add(base, ir.Constant(base.type, i))
            return builder.load(builder.gep(source.data, [index]))

        data_type = context.get_data_type(array_type.dtype).as_pointer()
        ndim = array_type.ndim
        view = context.make_array(array_type)(context, builder)
        populate_array(
            view,
            data=builder.inttoptr(field(0), data_type),
            shape=cgutils.pack_array(builder, [field(1 + i) for i in range(ndim)]),
            strides=cgutils.pack_array(builder, [field(1 + ndim + i) for i in range(ndim)]),
            itemsize=context.get_constant(types.intp, context.get_abi_sizeof(data_type.pointee)),
            meminfo=None,
        )
        return view._getvalue()

    return result(block, slot, like), codegen


@intrinsic
def put(typingctx, block, slot, value):
    """``block[slot] = value`` where it holds another value: a slot the helper has
    read keeps its cache line shared between the cores until a value changes (the
    caller need not take the line back, the helper need not read it again). An
    intrinsic, not a function: numba inlines a function's code at each of its calls,
    and with one at every slot of a job the kernels took 1.7x the time to compile."""

    def codegen(context, builder, signature, args):
        pointer = _slot_pointer(context, builder, signature.args[0], args[0], args[1])
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        with builder.if_then(builder.icmp_signed("!=", builder.load(pointer), value)):
            builder.store(value, pointer)
        return context.get_dummy_value()

    return types.void(block, slot, value), codegen


@cached_njit(inline="always")
def store_array(block, slot, array):
    """Write ``array``'s address, shape and strides into ``block`` from ``slot`` on
    (:func:`put`); return the next free slot."""
    put(block, slot, array.ctypes.data)
    for i in range(array.ndim):
        put(block, slot + 1 + i, array.shape[i])
        put(block, slot + 1 + array.ndim + i, array.strides[i])
    return slot + 1 + 2 * array.ndim


@cached_njit(inline="always")
def store_job(block, x, out, cos, sin, positions, rotary_dim, tile, n_groups, n_units):
    """Write a job's arguments but k's into ``block``: the arrays (see
    :func:`store_array`), the positions and the integers a runner reads (the callers
    add k and its output, for which numba must see ``k is None`` in their own code)."""
    store_array(block, X_AT, x)
    store_array(block, OUT_AT, out)
    store_array(block, COS_AT, cos)
    store_array(block, SIN_AT, sin)
    store_positions(block, POSITIONS_AT, positions)
    put(block, ROTARY_DIM_AT, rotary_dim)
    put(block, TILE_AT, tile)
    put(block, GROUPS_AT, n_groups)
    put(block, UNITS_AT, n_units)


@cached_njit(inline="always")
def take_ownership(block):
    """Whether this caller may publish a job (no other caller is running one)."""
    return compare_exchange(block, OWNER, 0, 1)


@cached_njit(inline="always")
def prepare(block, runner, n_chunks):
    """The first half of :func:`publish`: a new generation, and this job's runner and
    chunks where they differ from the last job's, the claims of the last job closed
    first when this job has more chunks. Closed first: a helper that read the last
    job's ``CLAIM`` word (no chunk left of that job) and then this job's larger
    ``CHUNKS`` would otherwise still swap that word and run a chunk of this job that
    the job then hands out again (rotated twice, in place) and count it in
    ``FINISHED`` (the caller could return before the helper's real chunk is written).
    Closed, the word is of the new generation with the caller's count full: no swap
    of an older word matches it, and it leaves no chunk of any job. With as many
    chunks as the last job or fewer, the last job's words leave no chunk (the caller
    claimed past the helper's count before it finished), so none is closed."""
    generation = block[GENERATION] + 1
    block[GENERATION] = generation
    if n_chunks > block[CHUNKS]:
        atomic_store(block, CLAIM, (generation << GENERATION_SHIFT) | CHUNK_MASK)
    if block[RUNNER] != runner:
        atomic_store(block, RUNNER, runner)
    if block[CHUNKS] != n_chunks:
        atomic_store(block, CHUNKS, n_chunks)


@cached_njit(inline="always")
def open_claims(block):
    """The second half of :func:`publish`: the prepared job's chunks may be claimed,
    chunk 0 taken by the caller as it opens them (one write of ``CLAIM`` less), and a
    sleeping helper is woken. The caller's CPU goes into ``CALLER_CPU`` first, and
    (Linux) the helper is woken with that CPU taken out of its CPUs for the moment
    (:func:`exclude_cpu`), so that it wakes on another: a KVM guest's scheduler puts
    it on the caller's (see :func:`keep_apart`), where it waited for the scheduler to
    preempt the caller before it could move (1.5-2 ms on the 2-core Zen 4 VM, calls
    running alone meanwhile)."""
    cpu = note_caller_cpu(block)
    atomic_store(block, CLAIM, (block[GENERATION] << GENERATION_SHIFT) | 1)
    if atomic_load(block, SLEEPING) != 0:  # after CLAIM: see serve()
        wake_apart(block, cpu)


@cached_njit(inline="always")
def note_caller_cpu(block):
    """The caller's CPU (-1 where ``GETCPU`` is 0), stored in ``CALLER_CPU`` for the
    helper's :func:`keep_apart` (a line only callers write)."""
    cpu = -1
    if block[GETCPU] != 0:
        cpu = call_address0(block[GETCPU])
        put(block, CALLER_CPU, cpu)
    return cpu


@cached_njit(inline="always")
def wake_apart(block, cpu):
    """Wake the sleeping helper (Linux) with the caller's ``cpu`` taken out of its CPUs
    for the moment (:func:`exclude_cpu`): it wakes on another (see :func:`keep_apart`)."""
    masks = block[MASKS] + 16 * MASK_WORDS  # the callers' two masks
    apart = block[HELPER_THREAD] != 0 and exclude_cpu(block, block[HELPER_THREAD], cpu, masks)
    wake(block)
    if apart:
        restore_cpus(block, block[HELPER_THREAD], masks)


@cached_njit(inline="always")
def asleep(block):
    """Whether the helper sleeps on its futex (Linux): a job published now would wake
    it (:func:`open_claims`) too late for most of the job, and the caller would wait at
    the end for the chunks it then claims, on a core whose caches hold none of the
    job (a float16 decode step (64, 32, 1, 128) after 2 ms of other work on the 2-core
    Zen 4 VM: 40.6 us shared so, against 31-33 alone; docs/performance.md, "Fiftieth
    session")."""
    return block[SYSCALL] != 0 and atomic_load(block, SLEEPING) != 0


@cached_njit(inline="always")
def rouse(block):
    """Wake the sleeping helper for the calls after this one, which runs alone: no job
    is published (the block is released), and the call counts as a miss (see
    :func:`worth_sharing`): calls that find it asleep time after time come further apart
    than it spins (``HELPER_SPIN_MICROSECONDS``), and after
    :data:`MISSES_BEFORE_ALONE` of them they stop waking it, but to probe."""
    wake_apart(block, note_caller_cpu(block))
    count_miss(block)
    release(block)


@cached_njit(inline="always")
def count_miss(block):
    """One more job (or call, :func:`rouse`) in a row without the helper."""
    block[MISSES] += 1
    if block[MISSES] == MISSES_BEFORE_ALONE:  # calls go alone: moves from now on count
        block[MOVES_SEEN] = atomic_load(block, MOVES)


@cached_njit(inline="always")
def publish(block, runner, n_chunks):
    """Publish a job of ``n_chunks`` chunks whose arguments are in the block, run by
    the function at ``runner``: a new generation whose chunk 0 is the caller's
    (:func:`prepare`, then :func:`open_claims`); the caller's next claims
    (:func:`claim_own`) go on from chunk 1."""
    prepare(block, runner, n_chunks)
    open_claims(block)


#: The futex operations (private to the process).
FUTEX_WAIT = 128
FUTEX_WAKE = 129


@cached_njit(inline="always")
def wake(block):
    """Wake the helper sleeping on its futex (the ``SLEEPING`` slot)."""
    atomic_store(block, SLEEPING, 0)
    address = block.ctypes.data + 8 * SLEEPING
    call_syscall(block[SYSCALL], block[FUTEX], address, FUTEX_WAKE, 1, 0)


@cached_njit(inline="always")
def claim_own(block):
    """The caller's next chunk from the front, or ``CHUNK_MASK`` (more than any job's
    chunks) when none is left."""
    word = fetch_add(block, CLAIM, 1)
    chunk = word & CHUNK_MASK
    if unclaimed(word, block[CHUNKS]):
        return chunk
    return CHUNK_MASK


@cached_njit(inline="always")
def unclaimed(word, n_chunks):
    """Whether the ``CLAIM`` word leaves a chunk of a job of ``n_chunks`` untaken: the
    caller's next chunk lies before the helper's."""
    return (word & CHUNK_MASK) + ((word >> TAKEN_SHIFT) & CHUNK_MASK) < n_chunks


@cached_njit(inline="always")
def try_claim(block, word):
    """The helper's claim of the last chunk not taken according to ``word``, the
    ``CLAIM`` word it read: that chunk if ``word`` leaves one and ``CLAIM`` still holds
    it (swapped for one more taken by the helper), else -1."""
    n_chunks = atomic_load(block, CHUNKS)
    if unclaimed(word, n_chunks) and compare_exchange(
        block, CLAIM, word, word + (1 << TAKEN_SHIFT)
    ):
        return n_chunks - 1 - ((word >> TAKEN_SHIFT) & CHUNK_MASK)
    return -1


@cached_njit(inline="always")
def finish(block, n_chunks, own):
    """Wait until the helper has finished the chunks it claimed (the caller ran
    ``own``; ``FINISHED`` reaches ``HANDED``), count the job as a miss if it claimed
    none, then release the block to the next caller."""
    handed = block[HANDED] + n_chunks - own
    block[HANDED] = handed
    while atomic_load(block, FINISHED) < handed:
        pause()
    if own == n_chunks:
        count_miss(block)
    else:
        put(block, MISSES, 0)  # a line the helper reads at every turn
        block[SKIPPED] = 0
    atomic_store(block, OWNER, 0)


#: After this many jobs in a row that the helper took no chunk of, calls run alone,
#: publishing two jobs in a row in :data:`PROBE_EVERY` to see whether the helper is
#: back: the first wakes it, the second finds it spinning (a woken helper may come too
#: late for the job that woke it: on the 2-core VM calls stayed alone for 1400 decode
#: steps after the other core fell idle, every single probe missed).
MISSES_BEFORE_ALONE = 8
PROBE_EVERY = 64


@cached_njit(inline="always")
def worth_sharing(block):
    """Whether the owner of the block should publish its job, or run it alone without
    a word to the helper (the caller owns the block; it releases it with
    :func:`release` when it does not publish). A helper that takes no chunk of several
    jobs in a row has no core to run on (another process holds it, or the machine has
    one): publishing, claiming through shared counters and waking it then only cost the
    caller (measured 4-5 us a decode step on a 2-core VM with the other core busy), so
    calls run alone and look again every :data:`PROBE_EVERY` calls, while the helper
    sleeps instead of spinning (:func:`serve`). Without a futex (not Linux) calls keep
    publishing: the sleeping helper, looking in between its sleeps, could otherwise
    only join a probe. A helper that has moved off the caller's CPU since calls went
    alone (:func:`keep_apart`; ``MOVES`` changed since :func:`finish` counted the last
    miss) has a core again: calls publish at once."""
    if block[MISSES] < MISSES_BEFORE_ALONE or block[SYSCALL] == 0:
        return True  # without a futex publishing wakes nobody and costs little
    moves = atomic_load(block, MOVES)
    if moves != block[MOVES_SEEN]:  # it has just left this caller's CPU: share again
        block[MOVES_SEEN] = moves
        put(block, MISSES, 0)
        block[SKIPPED] = 0
        return True
    block[SKIPPED] += 1
    return (block[SKIPPED] + 1) % PROBE_EVERY < 2  # the last two calls of every PROBE_EVERY


@cached_njit(inline="always")
def release(block):
    """Give the block back without having published a job."""
    atomic_store(block, OWNER, 0)


#: Where the job's arguments lie in the block (address, shape, strides of each array;
#: a 4-D tensor takes 9 slots, a cache at most 7, positions at most 5).
X_AT = ARGUMENTS
OUT_AT = X_AT + 9
K_AT = OUT_AT + 9
OUT_K_AT = K_AT + 9
COS_AT = OUT_K_AT + 9
SIN_AT = COS_AT + 7
POSITIONS_AT = SIN_AT + 7
ROTARY_DIM_AT = POSITIONS_AT + 5
TILE_AT = ROTARY_DIM_AT + 1
GROUPS_AT = TILE_AT + 1
UNITS_AT = GROUPS_AT + 1
assert UNITS_AT < GETCPU


def store_positions(block, slot, positions):  # pragma: no cover - see overload
    """Write the kernels' positions (None, one offset, or an array) into the block."""
    raise NotImplementedError


@overload(store_positions, inline="always")
def _store_positions_overload(block, slot, positions):
    if isinstance(positions, types.NoneType):
        return lambda block, slot, positions: None

    if isinstance(positions, types.Integer):

        def store_offset(block, slot, positions):
            put(block, slot, positions)

        return store_offset
    return lambda block, slot, positions: store_array(block, slot, positions) and None


def positions_at(block, slot, like):  # pragma: no cover - see overload
    """The positions :func:`store_positions` wrote, of ``like``'s type."""
    raise NotImplementedError


@overload(positions_at, inline="always")
def _positions_at_overload(block, slot, like):
    if isinstance(like, types.NoneType):
        return lambda block, slot, like: None
    if isinstance(like, types.Integer):
        return lambda block, slot, like: block[slot]
    return lambda block, slot, like: array_at(block, slot, like)


@cached_njit(nogil=True)
def idle_turns(block, turns):
    """``turns`` turns of the helper's loop without work (what it reads, and its
    pause), to measure how many make a microsecond."""
    seen = 0
    for _ in range(turns):
        seen += atomic_load(block, STOP) + atomic_load(block, CLAIM)
        seen += atomic_load(block, CHUNKS)
        pause()
    return seen


@cached_njit(inline="always")
def keep_apart(block):
    """Move the helper off the CPU the caller last ran on (``CALLER_CPU``) if it runs
    there, to any other CPU the thread may run on: the thread's CPUs set to those but
    this one (Linux moves it at once), then set back. Does nothing where
    ``GETCPU`` is 0, or where no other CPU is allowed or the masks cannot be read.

    On one CPU the two threads take turns: the helper claims nothing while the caller
    runs, and its spinning after a wake takes the caller's time (a float32 decode step
    (64, 32, 1, 128) took 58-72 us a call so, against 41 alone and 32 shared, on the
    2-core Zen 4 VM). Linux leaves them there, and in a KVM guest often puts them
    there: an idle virtual CPU reports itself preempted, so a thread is often woken on
    the CPU of the thread that wakes it (375 of 400 wakes in a C test where the waker
    slept now and then, 2 of 400 where it never slept). Called where the helper is
    woken by a job and at each ``sched_yield`` of its spinning (callers also wake it
    off their CPU, see :func:`wake_apart`). Counts each move in ``MOVES``."""
    if block[GETCPU] == 0:
        return
    cpu = call_address0(block[GETCPU])
    if cpu != atomic_load(block, CALLER_CPU):
        return
    if exclude_cpu(block, 0, cpu, block[MASKS]):
        atomic_store(block, MOVES, block[MOVES] + 1)
        restore_cpus(block, 0, block[MASKS])


@cached_njit()
def exclude_cpu(block, thread, cpu, masks_address):
    """Set the CPUs of ``thread`` (a thread id; 0: the calling thread) to those it may
    run on but ``cpu``, keeping its mask in the ``2 * MASK_WORDS`` words at
    ``masks_address`` (the mask, then the mask less ``cpu``) for
    :func:`restore_cpus`; whether it did (not where no other CPU is allowed, or a
    mask cannot be read or set). Linux moves a thread that runs or waits to run on
    ``cpu`` at once, and places a sleeping one elsewhere when it wakes. Not inlined:
    the callers' kernels take one call of it, not its code."""
    if cpu < 0 or cpu >= 64 * MASK_WORDS:
        return False
    masks = words_at(masks_address, 2 * MASK_WORDS)
    size = 8 * MASK_WORDS
    if call_syscall(block[SYSCALL], block[GET_AFFINITY], thread, size, masks_address, 0) <= 0:
        return False
    anywhere_else = 0
    for i in range(MASK_WORDS):
        word = masks[i]
        if i == cpu // 64:
            word &= ~(1 << (cpu % 64))
        masks[MASK_WORDS + i] = word
        anywhere_else |= word
    if anywhere_else == 0:
        return False
    others = masks_address + 8 * MASK_WORDS
    return call_syscall(block[SYSCALL], block[SET_AFFINITY], thread, size, others, 0) == 0


@cached_njit()
def restore_cpus(block, thread, masks_address):
    """Give ``thread`` back the CPUs :func:`exclude_cpu` kept at ``masks_address``: it
    stays where it is."""
    size = 8 * MASK_WORDS
    call_syscall(block[SYSCALL], block[SET_AFFINITY], thread, size, masks_address, 0)


#: Sleeps of the helper after it has spun: from this many microseconds, doubling up to
#: :data:`LONGEST_SLEEP` (a sleeping helper joins the calls that find it awake).
SHORTEST_SLEEP = 50
LONGEST_SLEEP = 10000


@cached_njit(nogil=True)
def serve(block, yield_address, sleep_address):
    """The helper thread's loop: take chunks of published jobs, each run by the function
    whose address the job names, until ``STOP``. After ``SPINS`` turns without work it
    sleeps: on its futex where ``SYSCALL`` is set (woken by the next job, or after
    ``TIMESPEC``), else (``usleep``, or Windows' ``Sleep`` in milliseconds, see
    ``SLEEP_UNIT``, at ``sleep_address``) in doubling steps of
    :data:`SHORTEST_SLEEP` to :data:`LONGEST_SLEEP` microseconds, looking for work
    between them. Every 256 spinning turns it calls ``sched_yield`` at
    ``yield_address`` (0: none), so that it never keeps a runnable caller off a core
    they share, and then, as when a job wakes it, moves off the caller's CPU if it
    finds itself there (:func:`keep_apart`). Returns when asked to stop."""
    atomic_store(block, STATE, SERVING)
    idle = 0
    sleep = SHORTEST_SLEEP
    woken = False  # by a job: spin after it even while callers run alone (a probe)
    while atomic_load(block, STOP) == 0:
        chunk = try_claim(block, atomic_load(block, CLAIM))
        if chunk >= 0:
            # The chunk is ours: its job is live and its arguments stay put until the
            # caller has seen FINISHED count it.
            call_runner(atomic_load(block, RUNNER), block, chunk)
            fetch_add(block, FINISHED, 1)
            idle = 0
            sleep = SHORTEST_SLEEP
            continue
        idle += 1
        # Spin, unless the callers run alone for want of this thread (see
        # worth_sharing): it then sleeps until their next probe, off their cores, and
        # spins after the probe that woke it, for the one that follows.
        if idle < atomic_load(block, SPINS) and (
            woken or atomic_load(block, MISSES) < MISSES_BEFORE_ALONE
        ):
            pause()
            if yield_address != 0 and idle % 256 == 0:
                call_address(yield_address, 0)
                keep_apart(block)
        elif block[SYSCALL] != 0:
            # Announce the sleep, then look for work once more: a caller stores CLAIM
            # and then reads SLEEPING, this thread stores SLEEPING and then reads
            # CLAIM, so one of the two sees the other (the futex sleeps only while
            # SLEEPING is still 1).
            atomic_store(block, SLEEPING, 1)
            word = atomic_load(block, CLAIM)
            if unclaimed(word, atomic_load(block, CHUNKS)) or atomic_load(block, STOP):
                atomic_store(block, SLEEPING, 0)
                continue
            address = block.ctypes.data
            call_syscall(
                block[SYSCALL], block[FUTEX], address + 8 * SLEEPING, FUTEX_WAIT, 1,
                address + 8 * TIMESPEC,
            )  # fmt: skip
            woken = atomic_load(block, SLEEPING) == 0  # by a job: spin again after it
            if woken:
                idle = 0
                keep_apart(block)
            atomic_store(block, SLEEPING, 0)
        elif sleep_address != 0:
            call_address(sleep_address, max(1, sleep // block[SLEEP_UNIT]))
            sleep = min(2 * sleep, LONGEST_SLEEP)
        elif yield_address != 0:
            call_address(yield_address, 0)
    atomic_store(block, STATE, STOPPED)
