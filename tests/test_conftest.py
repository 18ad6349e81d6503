"""The suite's own machinery in ``conftest.py``."""

import os
import pathlib
import sys

from numba import njit
from numba.core import compiler, typed_passes, untyped_passes
from numba.core.extending import intrinsic, overload

import conftest

HERE = os.path.basename(__file__)
TYPE_INFERENCE = ("typeinfer.py", "propagate")
INLINING = ("untyped_passes.py", "_do_work")  # InlineInlinables' work
LOWERING = ("lowering.py", "lower_inst")
PASSES = ("compiler_machinery.py", "_runPass")  # each pass of the pipeline, run


def _compile_traced() -> tuple[set, set]:
    """Compile new functions (never cached) under a trace function of our own: what it
    saw called during the compile, and after it (a call of Python)."""
    seen = []

    def trace(frame, event, arg):
        code = frame.f_code
        seen.append((os.path.basename(code.co_filename), code.co_name))

    def twice(value):  # pragma: no cover - replaced by the overload in compiled code
        raise NotImplementedError

    @overload(twice)
    def twice_overload(value):
        return lambda value: value * 2

    @intrinsic
    def same(typingctx, value):
        def codegen(context, builder, signature, args):
            return args[0]

        return value(value), codegen

    @njit(inline="always")
    def plus_one(value):
        return value + 1

    @njit
    def inner(value):  # compiled while outer is typed: its lowering nested in that
        return same(value)

    @njit
    def outer(value):
        return inner(twice(plus_one(value)))

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        assert outer(1) == 4
        during = len(seen)
        assert sys.gettrace() is trace
        assert plus_one.py_func(1) == 2
    finally:
        sys.settrace(before)
    return set(seen[:during]), set(seen[during:])


def test_numba_compiles_untraced_but_for_this_packages_python():
    # conftest pauses the trace function (coverage's) in numba's pipeline of passes
    # (type inference, the pass inline_inlinables and lowering among them), and traces
    # the @overload and @intrinsic functions that type inference calls and the
    # intrinsics' code generators that lowering calls, also when a callee is compiled
    # inside type inference. Afterwards the trace function is the same one, called again.
    assert conftest.COMPILING_UNTRACED, "numba's internals moved: update conftest._SWITCHES"
    during, after = _compile_traced()
    assert {(HERE, "twice_overload"), (HERE, "same"), (HERE, "codegen")} <= during
    assert TYPE_INFERENCE not in during and INLINING not in during
    assert LOWERING not in during and PASSES not in during
    assert (HERE, "plus_one") in after


def test_without_the_pauses_numba_is_traced(monkeypatch):
    # The control: with the pipeline and the three passes unwrapped, the functions that
    # the test above finds missing are traced, so their absence there is the pauses' doing.
    core = compiler.CompilerBase._compile_core
    monkeypatch.setattr(compiler.CompilerBase, "_compile_core", core.__wrapped__)
    for owner in (
        typed_passes.NopythonTypeInference,
        untyped_passes.InlineInlinables,
        typed_passes.BaseNativeLowering,
    ):
        monkeypatch.setattr(owner, "run_pass", owner.run_pass.__wrapped__)
    during, _ = _compile_traced()
    assert TYPE_INFERENCE in during and INLINING in during and LOWERING in during
    assert PASSES in during


def test_the_long_tests_are_collected_first_and_shuffle_shuffles():
    """The files of conftest.LONG_FIRST move to the front, everything else keeping its
    order (xdist's workers then end on short tests, not on a two-minute one); with
    ``--shuffle SEED`` the order is shuffled."""

    class Item:
        def __init__(self, name):
            self.path = pathlib.Path("tests") / name

    class Config:
        def __init__(self, seed):
            self.seed = seed

        def getoption(self, name, default=None):
            assert name == "--shuffle"
            return self.seed

    items = [Item(name) for name in ("test_a.py", "test_targets.py", "test_b.py")]
    items += [Item("test_targets.py"), Item("test_a.py")]
    expected = [items[1], items[3], items[0], items[2], items[4]]
    conftest.pytest_collection_modifyitems(Config(None), items)
    assert items == expected
    # --shuffle SEED: a permutation of them all, the same for the same seed (every xdist
    # worker must collect one order), another for another seed.
    many = [Item(f"test_{n}.py") for n in range(40)]
    orders = []
    for seed in (1, 1, 2):
        shuffled = list(many)
        conftest.pytest_collection_modifyitems(Config(seed), shuffled)
        assert sorted(map(id, shuffled)) == sorted(map(id, many))
        orders.append([many.index(item) for item in shuffled])
    assert orders[0] == orders[1] != orders[2] and orders[0] != list(range(40))
