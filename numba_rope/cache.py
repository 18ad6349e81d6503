"""cos/sin caches for :func:`numba_rope.rotary_embedding`: plain RoPE and the scaled
variants that Hugging Face transformers builds (linear, dynamic NTK, YaRN, Llama 3).

Everything is computed in float64 and rounded once to the requested dtype, with the
same bits on every machine: cos, sin, pow and log come from ``numba_rope._sincos``, not
from NumPy or ``math`` (whose last bit depends on the CPU and the platform's libm).
The inverse frequencies follow the formulas of ``transformers/modeling_rope_utils.py``
(``_compute_*_parameters``); the checks and their messages live here, next to the only
function that needs them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from numba_rope import _sincos
from numba_rope._rounding import round_once
from numba_rope.typing import NumpyArray

#: Scaling schemes, by their ``rope_type``.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

#: Cache dtypes, by name (bfloat16 is ``ml_dtypes.bfloat16``).
CACHE_DTYPES = ("float32", "float16", "bfloat16", "float64")

#: Keys of ``scaling`` besides ``rope_type``: (required, optional) for each scheme.
SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
    ),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
}

# Keys of a transformers config that belong elsewhere in this function's arguments.
_MOVED_KEYS = {
    "rope_theta": "pass it as base=",
    "partial_rotary_factor": "pass the number of rotated channels as rotary_dim",
}


# ----------------------------------------------------------------------------- checks


def _check_count(name: str, value: Any, minimum: int) -> int:
    """An integer ``>= minimum`` (bools refused), or ``TypeError``/``ValueError``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {value!r} of type {type(value).__name__}"
        ) from None
    if count < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {count}")
    return count


def _check_real(name: str, value: Any, rule: str = "") -> float:
    """A finite real number (bools refused), or ``TypeError``/``ValueError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"{name} must be a real number, got {value!r} of type {type(value).__name__}"
        )
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite{rule and ' and ' + rule}, got {number}")
    return number


def _check_positive(name: str, value: Any, minimum: float = 0.0) -> float:
    """A finite number ``> 0`` (or ``>= minimum`` when a minimum is given)."""
    rule = f">= {minimum:g}" if minimum else "> 0"
    number = _check_real(name, value, rule)
    if (number < minimum) if minimum else (number <= 0.0):
        raise ValueError(f"{name} must be {rule}, got {number}")
    return number


def _check_dtype(dtype: Any) -> np.dtype:
    if dtype is None:  # np.dtype(None) would quietly mean float64
        raise TypeError(f"dtype must be one of {', '.join(CACHE_DTYPES)}, got None")
    try:
        resolved = np.dtype(dtype)
    except (TypeError, ValueError):
        resolved = None
    if resolved is None or resolved.name not in CACHE_DTYPES:
        raise TypeError(
            f"dtype must be one of {', '.join(CACHE_DTYPES)} (bfloat16 as "
            f"ml_dtypes.bfloat16), got {dtype!r}"
        )
    return resolved.newbyteorder("=")  # the kernels read native byte order


def _accepted_keys(rope_type: str) -> str:
    required, optional = SCALING_KEYS[rope_type]
    text = "rope_type" + "".join(f", {key}" for key in required)
    if optional:
        text += f" and optionally {', '.join(optional)}"
    return text


def _check_scaling(scaling: Any) -> tuple[str, dict[str, Any]]:
    """Return ``(rope_type, parameters)`` of a ``scaling`` mapping, or raise.

    Optional keys set to None count as absent, as in transformers (configs loaded
    from JSON carry ``null`` for unset fields); required keys must have a value.
    """
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"scaling must be None or a dict such as {{'rope_type': 'linear', 'factor': 2.0}}, "
            f"got {type(scaling).__name__}"
        )
    parameters = dict(scaling)
    rope_type = parameters.pop("rope_type", None)
    legacy_type = parameters.pop("type", None)  # transformers' former name of the key
    if rope_type is None:
        rope_type = legacy_type
    elif legacy_type is not None and legacy_type != rope_type:
        raise ValueError(
            f"scaling gives two different types, rope_type={rope_type!r} and "
            f"type={legacy_type!r}; keep one"
        )
    if rope_type is None:
        raise ValueError(
            f"scaling needs a 'rope_type' key, one of {', '.join(map(repr, ROPE_TYPES))}; "
            f"got keys {sorted(map(str, scaling))}"
        )
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unknown rope_type {rope_type!r}; accepted: {', '.join(map(repr, ROPE_TYPES))}"
        )

    required, optional = SCALING_KEYS[rope_type]
    unknown = [key for key in parameters if key not in required and key not in optional]
    if unknown:
        hints = "".join(
            f"; {key!r} is not a scaling key here: {_MOVED_KEYS[key]}"
            for key in unknown
            if key in _MOVED_KEYS
        )
        raise ValueError(
            f"unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))} in scaling for rope_type {rope_type!r}; "
            f"accepted keys: {_accepted_keys(rope_type)}{hints}"
        )
    missing = [key for key in required if parameters.get(key) is None]
    if missing:
        raise ValueError(
            f"scaling for rope_type {rope_type!r} is missing {', '.join(map(repr, missing))}; "
            f"it needs {_accepted_keys(rope_type)}"
        )
    return rope_type, {key: value for key, value in parameters.items() if value is not None}


# ------------------------------------------------------------------ inverse frequencies
#
# Each returns (inverse frequencies, attention factor): float64 values of shape
# [rotary_dim/2] and a float by which cos and sin are multiplied.


def _base_frequencies(rotary_dim: int, base: float) -> np.ndarray:
    """``1 / base**(2i / rotary_dim)`` for ``i`` in ``[0, rotary_dim/2)``."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    return 1.0 / _powers(base, exponents)


def _powers(base: float, exponents: np.ndarray) -> np.ndarray:
    """``base**exponents``, each rounded once from 40 digits: not ``np.power``, which
    differs between CPUs in the last bit."""
    return np.array([_sincos.power(base, float(e)) for e in exponents], dtype=np.float64)


def _default(
    rotary_dim: int, base: float, max_position: int, parameters: dict[str, Any]
) -> tuple[np.ndarray, float]:
    return _base_frequencies(rotary_dim, base), 1.0


def _linear(
    rotary_dim: int, base: float, max_position: int, parameters: dict[str, Any]
) -> tuple[np.ndarray, float]:
    factor = _check_positive("linear scaling factor", parameters["factor"])
    return _base_frequencies(rotary_dim, base) / factor, 1.0


def _dynamic(
    rotary_dim: int, base: float, max_position: int, parameters: dict[str, Any]
) -> tuple[np.ndarray, float]:
    factor = _check_positive("dynamic scaling factor", parameters["factor"], 1.0)
    original = _check_count(
        "dynamic scaling original_max_position_embeddings",
        parameters["original_max_position_embeddings"],
        1,
    )
    if rotary_dim < 4:
        raise ValueError(
            f"dynamic scaling needs rotary_dim >= 4 (its base is raised to the power "
            f"rotary_dim / (rotary_dim - 2)), got {rotary_dim}"
        )
    # Up to the original context the model runs with its original frequencies; past
    # it, the base grows with the sequence length, here the cache length.
    if max_position > original:
        growth = factor * max_position / original - (factor - 1)
        base = base * _sincos.power(growth, rotary_dim / (rotary_dim - 2))
    return _base_frequencies(rotary_dim, base), 1.0


def _yarn_attention_factor(factor: float, parameters: dict[str, Any]) -> float:
    if "attention_factor" in parameters:
        return _check_positive("yarn attention_factor", parameters["attention_factor"])

    def magnitude_scale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * _sincos.log(scale) + 1.0

    mscale = _check_real("yarn mscale", parameters.get("mscale", 0.0))
    mscale_all_dim = _check_real("yarn mscale_all_dim", parameters.get("mscale_all_dim", 0.0))
    # As in transformers, mscale counts only together with a non-zero mscale_all_dim.
    if mscale and mscale_all_dim:
        numerator = magnitude_scale(factor, mscale)
        denominator = magnitude_scale(factor, mscale_all_dim)
        if not (numerator > 0 and denominator > 0):
            raise ValueError(
                f"yarn mscale={mscale} and mscale_all_dim={mscale_all_dim} give the magnitude "
                f"scales 0.1*mscale*ln(factor) + 1 = {numerator} and {denominator}; both must "
                f"be > 0"
            )
        return numerator / denominator
    return magnitude_scale(factor)


def _yarn(
    rotary_dim: int, base: float, max_position: int, parameters: dict[str, Any]
) -> tuple[np.ndarray, float]:
    factor = _check_positive("yarn factor", parameters["factor"], 1.0)
    original = _check_count(
        "yarn original_max_position_embeddings", parameters["original_max_position_embeddings"], 1
    )
    beta_fast = _check_positive("yarn beta_fast", parameters.get("beta_fast", 32.0))
    beta_slow = _check_positive("yarn beta_slow", parameters.get("beta_slow", 1.0))
    if beta_fast < beta_slow:
        raise ValueError(
            f"yarn beta_fast must be >= beta_slow, got beta_fast={beta_fast} and "
            f"beta_slow={beta_slow}"
        )
    truncate = parameters.get("truncate", True)
    if not isinstance(truncate, (bool, np.bool_)):
        raise TypeError(f"yarn truncate must be True or False, got {truncate!r}")
    if base == 1.0:
        raise ValueError("yarn needs base != 1: its correction range divides by log(base)")
    attention_factor = _yarn_attention_factor(factor, parameters)

    def dimension_of(rotations: float) -> float:
        """The (fractional) dimension whose wavelength spans ``original`` / ``rotations``."""
        return (rotary_dim * _sincos.log(original / (rotations * 2 * math.pi))) / (
            2 * _sincos.log(base)
        )

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp

    positional_frequencies = _powers(
        base, np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    )
    extrapolated = 1.0 / positional_frequencies
    interpolated = 1.0 / (factor * positional_frequencies)
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inverse_frequencies = (
        interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    )
    return inverse_frequencies, attention_factor


def _llama3(
    rotary_dim: int, base: float, max_position: int, parameters: dict[str, Any]
) -> tuple[np.ndarray, float]:
    factor = _check_positive("llama3 factor", parameters["factor"], 1.0)
    low_freq_factor = _check_positive("llama3 low_freq_factor", parameters["low_freq_factor"])
    high_freq_factor = _check_positive("llama3 high_freq_factor", parameters["high_freq_factor"])
    if high_freq_factor <= low_freq_factor:
        raise ValueError(
            f"llama3 high_freq_factor must be > low_freq_factor, got high_freq_factor="
            f"{high_freq_factor} and low_freq_factor={low_freq_factor}"
        )
    original = _check_count(
        "llama3 original_max_position_embeddings",
        parameters["original_max_position_embeddings"],
        1,
    )
    low_freq_wavelength = original / low_freq_factor
    high_freq_wavelength = original / high_freq_factor

    inverse_frequencies = _base_frequencies(rotary_dim, base)
    wavelengths = 2 * math.pi / inverse_frequencies
    # Long wavelengths are interpolated (divided by factor), short ones kept, and the
    # band between them blends the two smoothly.
    scaled = np.where(
        wavelengths > low_freq_wavelength, inverse_frequencies / factor, inverse_frequencies
    )
    smooth = (original / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelengths < high_freq_wavelength) & ~(wavelengths > low_freq_wavelength)
    return np.where(medium, blended, scaled), 1.0


_FREQUENCIES = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
}


# ---------------------------------------------------------------------------- rounding


# ------------------------------------------------------------------------------ public


def rope_cache(
    max_position: int,
    rotary_dim: int,
    *,
    base: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    dtype: npt.DTypeLike = np.float32,
) -> tuple[NumpyArray, NumpyArray]:
    r"""cos and sin caches of rotary position embedding, for positions
    ``0 .. max_position - 1``.

    Row ``p``, column ``i`` holds ``a*cos(p * inv_freq[i])`` and ``a*sin(p * inv_freq[i])``,
    where the inverse frequencies ``inv_freq`` and the attention factor ``a`` (1 except
    for yarn) come from ``base`` and ``scaling`` as in Hugging Face transformers. Angles,
    cos and sin are computed in float64 and rounded once to ``dtype``, to nearest even,
    to the same bits on every machine (see Notes).

    Parameters
    ----------
    max_position : int
        Number of positions (cache rows), ``>= 0``. With ``position_ids``, every id
        must be below it.
    rotary_dim : int
        Number of rotated channels, positive and even (``rotary_embedding_dim``, or the
        head size when the whole head rotates). The caches have ``rotary_dim // 2``
        columns.
    base : float, default 10000.0
        The RoPE base (``rope_theta``), finite and ``> 0``.
    scaling : dict or None, default None
        None for plain RoPE, or a transformers ``rope_scaling`` dict: ``rope_type``
        (``"type"`` is accepted as its former name) and the parameters below. Unknown
        types, unknown keys and missing parameters raise ``ValueError``; an optional
        key set to None counts as absent.
    dtype : dtype, default numpy.float32
        float32, float16, bfloat16 (``ml_dtypes.bfloat16``) or float64.

    Returns
    -------
    cos, sin : numpy.ndarray
        C-contiguous, shape ``[max_position, rotary_dim // 2]``, of ``dtype``: the
        ``cos_cache`` and ``sin_cache`` of :func:`numba_rope.rotary_embedding` with
        ``position_ids``.

    Raises
    ------
    TypeError
        ``max_position``, ``rotary_dim`` or a scaling count that is not an integer;
        ``base`` or a scaling number that is not a real number; ``scaling`` that is not
        a dict; an unsupported ``dtype``.
    ValueError
        Negative ``max_position``; ``rotary_dim`` not positive and even; ``base`` not
        finite and positive; an unknown ``rope_type``; unknown or missing keys; a
        parameter outside its range (given in the message).

    Notes
    -----
    With ``d = rotary_dim``, ``i = 0 .. d/2 - 1`` and ``n`` the
    ``original_max_position_embeddings`` of ``scaling`` (the context the model was
    trained on, ``config.max_position_embeddings`` in transformers):

    ``"default"`` (or ``scaling=None``), as ``_compute_default_rope_parameters``:
        ``inv_freq[i] = 1 / base**(2i / d)``.
    ``{"rope_type": "linear", "factor": f}``, as
    ``_compute_linear_scaling_rope_parameters``:
        ``inv_freq / f`` (the default evaluated at positions ``p / f``); ``f > 0``.
    ``{"rope_type": "dynamic", "factor": f, "original_max_position_embeddings": n}``, as ``_compute_dynamic_ntk_parameters`` at sequence length ``L = max_position``:
        the default with base ``base * (f*L/n - (f - 1))**(d / (d - 2))`` when
        ``L > n``, and the default unchanged when ``L <= n`` (transformers then keeps
        its original frequencies); ``f >= 1``, ``d >= 4``.
    ``{"rope_type": "yarn", "factor": f, "original_max_position_embeddings": n}``, as ``_compute_yarn_parameters``; optional ``beta_fast`` (32), ``beta_slow`` (1), ``truncate`` (True), ``attention_factor``, ``mscale``, ``mscale_all_dim``:
        ``low, high`` are the dimensions ``d*ln(n / (2*pi*beta)) / (2*ln(base))`` for
        ``beta_fast`` and ``beta_slow`` (floored and ceiled when ``truncate``), clipped
        to ``[0, d - 1]``; ``ramp[i] = clip((i - low) / (high - low), 0, 1)``;
        ``inv_freq[i] = ramp[i] / (f * base**(2i/d)) + (1 - ramp[i]) / base**(2i/d)``
        (interpolated where ``ramp`` is 1, extrapolated where it is 0). The attention factor is ``attention_factor`` if
        given, else ``m(f, mscale) / m(f, mscale_all_dim)`` when both are non-zero,
        else ``m(f, 1)``, with ``m(f, c) = 0.1*c*ln(f) + 1`` (1 when ``f <= 1``); it
        multiplies cos and sin, as transformers' rotary modules do. ``f >= 1``,
        ``beta_fast >= beta_slow > 0``.
    ``{"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi, "original_max_position_embeddings": n}``, as ``_compute_llama3_parameters``:
        with ``w = 2*pi / inv_freq_default``: ``w < n/hi`` keeps the frequency,
        ``w > n/lo`` divides it by ``f``, and in between ``s = (n/w - lo) / (hi - lo)``
        blends ``(1 - s) * inv_freq / f + s * inv_freq``. ``f >= 1``, ``hi > lo > 0``.

    transformers computes these in float32 (and its angles too); here everything is
    float64 until the one rounding. The factor is taken from ``scaling`` as given: this
    function has no ``config.max_position_embeddings`` to derive it from.

    Accuracy and reproducibility: the caches are the same bits on every machine (any
    CPU, with or without AVX-512, x86 or ARM, any OS, any NumPy; measured on x86-64, and
    on other machines a consequence of using IEEE operations only, without fast-math
    or FMA contraction). Each step of the
    formulas is a float64 operation rounded to nearest: ``+ - * /`` by IEEE 754, the
    powers and logarithms of the frequency formulas through the ``decimal`` module (40
    digits, then one rounding), and the angle ``p * inv_freq[i]`` a float64 product.
    cos and sin of that angle are computed in double-double arithmetic from float64
    ``+ - * /`` alone (no libm, no FMA, no NumPy SIMD) and rounded once: within
    ``0.5 + 2**-13`` ulp of the exact value, i.e. correctly rounded unless the exact
    value lies within ``2**-13`` ulp of a midpoint (none of 400 000 values tested
    against 45-digit decimal arithmetic did). yarn's factor ``a`` then multiplies them,
    one more float64 rounding. The narrower dtypes are that float64 value rounded once.
    Building a ``[131072, 64]`` cache takes about 0.6 s on two cores.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_rope
    >>> cos, sin = numba_rope.rope_cache(4, 8)
    >>> cos.shape, cos.dtype
    ((4, 4), dtype('float32'))
    >>> cos[0], sin[0]
    (array([1., 1., 1., 1.], dtype=float32), array([0., 0., 0., 0.], dtype=float32))
    >>> x = np.ones((1, 2, 3, 8), dtype=np.float32)  # [batch, num_heads, seq_len, head_size]
    >>> y = numba_rope.rotary_embedding(x, cos, sin, np.array([[0, 1, 3]]))
    >>> bool(np.array_equal(y[:, :, 0], x[:, :, 0]))  # position 0 does not turn
    True

    Scaled caches take transformers' ``rope_scaling`` dict; yarn folds its attention
    factor ``0.1 ln(f) + 1`` into cos and sin:

    >>> cos, sin = numba_rope.rope_cache(
    ...     16, 8, scaling={"rope_type": "yarn", "factor": 4.0,
    ...                     "original_max_position_embeddings": 4})
    >>> round(float(cos[0, 0]), 4)
    1.1386
    """
    max_position = _check_count("max_position", max_position, 0)
    rotary_dim = _check_count("rotary_dim", rotary_dim, 0)
    if rotary_dim == 0 or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim must be positive and even (channels rotate in pairs), got {rotary_dim}"
        )
    base = _check_positive("base", base)
    rope_type, parameters = _check_scaling(scaling)
    dtype = _check_dtype(dtype)

    inverse_frequencies, attention_factor = _FREQUENCIES[rope_type](
        rotary_dim, base, max_position, parameters
    )
    cos, sin = _sincos.cos_sin(max_position, inverse_frequencies)
    if attention_factor != 1.0:
        cos *= attention_factor
        sin *= attention_factor
    return round_once(cos, dtype), round_once(sin, dtype)
