"""The suite's own machinery in ``conftest.py``."""

import os
import sys

from numba import njit


def test_numba_inlining_runs_untraced_and_the_trace_function_comes_back():
    # conftest pauses the trace function (coverage's) while numba's pass
    # inline_inlinables runs: that pass is not traced, type inference still is, and
    # the trace function is the same one afterwards, called again.
    seen = []

    def trace(frame, event, arg):
        code = frame.f_code
        seen.append((os.path.basename(code.co_filename), code.co_name))

    @njit(inline="always")
    def plus_one(value):
        return value + 1

    @njit
    def plus_two(value):
        return plus_one(plus_one(value))

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        assert plus_two(1) == 3  # compiled here: a new function, never cached
        traced_inside = len(seen)
        assert sys.gettrace() is trace
        plus_two.py_func(1)
    finally:
        sys.settrace(before)
    names = set(seen[:traced_inside])
    assert ("typeinfer.py", "propagate") in names  # type inference: traced
    assert ("untyped_passes.py", "_do_work") not in names  # InlineInlinables' work
    assert len(seen) > traced_inside  # the call of plus_two.py_func was traced
