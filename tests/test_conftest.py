"""The suite's own machinery in ``conftest.py``."""

import os
import sys

from numba import njit
from numba.core.extending import intrinsic, overload

import conftest


def test_numba_compiles_untraced_but_for_this_packages_python():
    # conftest pauses the trace function (coverage's) in numba's type inference and
    # its pass inline_inlinables, and traces the @overload and @intrinsic functions
    # that type inference calls and lowering (the intrinsics' code generators), also
    # when a callee is compiled inside type inference. Afterwards the trace function
    # is the same one, called again.
    assert conftest.COMPILING_UNTRACED, "numba's internals moved: update conftest._SWITCHES"
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
    def inner(value):  # compiled while rotated is typed: its lowering nested in that
        return same(value)

    @njit
    def rotated(value):
        return inner(twice(plus_one(value)))

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        assert rotated(1) == 4  # compiled here: a new function, never cached
        traced_inside = len(seen)
        assert sys.gettrace() is trace
        assert plus_one.py_func(1) == 2  # a call of Python, traced
    finally:
        sys.settrace(before)
    names = set(seen[:traced_inside])
    here = os.path.basename(__file__)
    assert {(here, "twice_overload"), (here, "same"), (here, "codegen")} <= names
    assert ("typeinfer.py", "propagate") not in names  # type inference: untraced
    assert ("untyped_passes.py", "_do_work") not in names  # InlineInlinables' work
    assert (here, "plus_one") in set(seen[traced_inside:])
