"""numba as numba_rope uses it, decided in one place.

* Every ``@njit`` function of the package is made by :func:`cached_njit`: cached on
  disk where numba finds a writable cache location (``NUMBA_CACHE_DIR``, the
  ``__pycache__`` next to the source, the user's cache directory), compiled in memory
  only where it finds none (a read-only site-packages and no writable home, such as a
  container run as an unprivileged user), where ``numba.njit(cache=True)`` itself
  raises ``RuntimeError: cannot cache function ...: no locator available``. The
  compiled code is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba

#: What ``numba.njit(cache=True)`` raises when no cache location is usable.
_NO_LOCATOR = "no locator available"


def cached_njit(**options: Any) -> Callable[[Callable], Any]:
    """``numba.njit(cache=True, **options)``, or ``numba.njit(**options)`` (compiled in
    memory, each process) where numba finds no usable cache location for the function's
    file. numba's own choice of location, ``NUMBA_CACHE_DIR`` first, is kept."""

    def decorate(function: Callable) -> Any:
        try:
            return numba.njit(cache=True, **options)(function)
        except RuntimeError as error:
            if _NO_LOCATOR not in str(error):
                raise
        return numba.njit(**options)(function)

    return decorate
