"""The plan tables of ``numba_rope._cpu.backend`` in tests: empty ones for a test that
must not find an earlier test's plans, and a stand-in for ``FAST`` that reports each call
its compiled plans take, for the tests of compiled plans, in this process and in forked
children (``tests/test_robustness.py`` runs scripts that import it from this folder)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fresh_plan_tables(monkeypatch: Any) -> None:
    """Empty tables of plans, Python (``PLANS``) and compiled (``FAST``), for the rest of
    the test (the process's own back after it): a test that wants the general path, or
    that a call of its own made a plan, must find no plan of an earlier test, whatever
    ran before it (xdist's worksteal varies the order). Forgetting ``PLANS`` alone
    leaves the compiled plans, which calls try first; and a table an earlier test
    filled to ``MAX_PLANS`` starts again at the next plan, in the middle of the test."""
    from numba_rope._cpu import backend

    monkeypatch.setattr(backend, "PLANS", {})
    monkeypatch.setattr(backend, "FAST", {})


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
