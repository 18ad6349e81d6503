"""A stand-in for ``numba_rope._cpu.backend.FAST`` that reports each call its compiled
plans take: for the tests of compiled plans, in this process and in forked children
(``tests/test_robustness.py`` runs scripts that import it from this folder)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def counting_plans(note: Callable[[str, bool], None]) -> dict:
    """An empty plans table whose plans, when found, call ``note(kind, ran)`` after
    each call: ``kind`` ``"one"`` (one tensor's plans take 6 arguments) or ``"qk"``
    (8: see ``cpu_backend.fast_call``), ``ran`` whether the plan ran the call (else it
    left it to the general path)."""

    class CountingPlans(dict):
        def get(self, key: Any, default: Any = None) -> Any:
            found = super().get(key, default)
            if found is None:
                return found
            run = found[0]

            def counting(*args: Any) -> Any:
                result = run(*args)
                note("one" if len(args) == 6 else "qk", result is not None)
                return result

            return (counting, *found[1:])

    return CountingPlans()
