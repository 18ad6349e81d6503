"""cos/sin caches for :func:`numba_rope.rotary_embedding`: plain RoPE and the scaled
variants that Hugging Face transformers builds (linear, dynamic NTK, YaRN, LongRoPE,
Llama 3), from numba_rope's own arguments or from a transformers config as it is.

Everything is computed in float64 and rounded once to the requested dtype, with the
same bits on every machine: cos, sin, pow and log come from ``numba_rope._sincos``, not
from NumPy or ``math`` (whose last bit depends on the CPU and the platform's libm).
The inverse frequencies follow the formulas of ``transformers/modeling_rope_utils.py``
(``_compute_*_parameters``, transformers 5); the checks and their messages live here,
next to the only function that needs them. A config (``config=`` or ``rope_parameters=``)
is read as transformers reads it (which field wins, which defaults apply) and turned into
the same ``(rotary_dim, base, scaling)`` arguments, so both forms share one computation.
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
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

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
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        ("factor", "attention_factor"),
    ),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
}

# Keys of a transformers config that belong elsewhere in this function's arguments.
_MOVED_KEYS = {
    "rope_theta": "pass it as base=, or pass the whole dict as rope_parameters=",
    "partial_rotary_factor": (
        "pass the number of rotated channels as rotary_dim, or pass the whole dict as "
        "rope_parameters= with head_dim="
    ),
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
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes  # registers its types: NumPy knows the name only after this

        dtype = ml_dtypes.bfloat16
    try:
        resolved = np.dtype(dtype)
    except (TypeError, ValueError):
        resolved = None
    if resolved is None or resolved.name not in CACHE_DTYPES:
        raise TypeError(
            f"dtype must be one of {', '.join(CACHE_DTYPES)} (bfloat16 as "
            f"ml_dtypes.bfloat16), got {dtype!r}"
        )
    # The kernels read native byte order; np.dtype of the scalar type is NumPy's one
    # object of that kind (newbyteorder would make a new one at each call).
    return np.dtype(resolved.type)


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
    elif legacy_type is not None and not _same_type(rope_type, legacy_type):
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
            f"{_former_name_hint(rope_type)}"
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
    given = {key: value for key, value in parameters.items() if value is not None}
    if "truncate" in parameters and parameters["truncate"] is None:
        # transformers reads it as `rope_parameters.get("truncate", True)`, then `if
        # truncate:`: None, unlike an absent key, means no truncation.
        given["truncate"] = False
    return rope_type, given


#: Phi-3's former names of ``"longrope"``: transformers' ``Phi3Config`` (and
#: ``Phi4MultimodalConfig``) turns a ``rope_type`` or ``type`` of ``"su"`` or ``"yarn"``
#: into ``"longrope"``, keeping the former name under ``type``.
_PHI3_FORMER_NAMES = ("su", "yarn")
_PHI3_MODEL_TYPES = ("phi3", "phi4_multimodal")

#: ``(rope_type, type)`` pairs that transformers' config classes leave in a config's
#: rope parameters, and read as ``rope_type``: Phi-3's (above), and the multimodal
#: models' ``"mrope"`` (Qwen2-VL and its kin), whose cos/sin table is the default one
#: (their sections choose positions, not frequencies), turned into ``"default"``.
_CONVERTED_TYPES = {("longrope", name) for name in _PHI3_FORMER_NAMES} | {("default", "mrope")}


def _same_type(rope_type: Any, legacy_type: Any) -> bool:
    """Whether ``rope_type`` and the former key ``type`` name one type: the same name,
    or a pair that a transformers config class leaves (:data:`_CONVERTED_TYPES`)."""
    return legacy_type == rope_type or (rope_type, legacy_type) in _CONVERTED_TYPES


def _former_name_hint(rope_type: Any) -> str:
    if rope_type == "su":
        return " ('su' is Phi-3's former name of 'longrope', as Phi3Config reads it)"
    return ""


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
    rotary_dim: int, base: float, seq_len: int, parameters: dict[str, Any]
) -> tuple[np.ndarray, float]:
    return _base_frequencies(rotary_dim, base), 1.0


def _linear(
    rotary_dim: int, base: float, seq_len: int, parameters: dict[str, Any]
) -> tuple[np.ndarray, float]:
    factor = _check_positive("linear scaling factor", parameters["factor"])
    return _base_frequencies(rotary_dim, base) / factor, 1.0


def _dynamic(
    rotary_dim: int, base: float, seq_len: int, parameters: dict[str, Any]
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
    # it, the base grows with the current sequence length.
    if seq_len > original:
        growth = factor * seq_len / original - (factor - 1)
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
    rotary_dim: int, base: float, seq_len: int, parameters: dict[str, Any]
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


def _check_factors(name: str, values: Any, count: int) -> np.ndarray:
    """``count`` finite numbers ``> 0`` (a list, tuple or 1-D array), as float64."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise TypeError(
            f"{name} must be a list of {count} numbers (one per frequency, rotary_dim / 2), "
            f"got {type(values).__name__}"
        )
    if len(values) != count:
        raise ValueError(
            f"{name} must have one number per frequency, rotary_dim / 2 = {count}, got "
            f"{len(values)}"
        )
    return np.array(
        [_check_positive(f"{name}[{i}]", value) for i, value in enumerate(values)],
        dtype=np.float64,
    )


def _longrope(
    rotary_dim: int, base: float, seq_len: int, parameters: dict[str, Any]
) -> tuple[np.ndarray, float]:
    original = _check_count(
        "longrope original_max_position_embeddings",
        parameters["original_max_position_embeddings"],
        1,
    )
    short_factor = _check_factors(
        "longrope short_factor", parameters["short_factor"], rotary_dim // 2
    )
    long_factor = _check_factors("longrope long_factor", parameters["long_factor"], rotary_dim // 2)
    if "attention_factor" in parameters:
        attention_factor = _check_positive(
            "longrope attention_factor", parameters["attention_factor"]
        )
    elif "factor" in parameters:
        factor = _check_positive("longrope factor", parameters["factor"])
        if factor <= 1.0:
            attention_factor = 1.0
        elif original == 1:
            raise ValueError(
                "longrope's attention factor sqrt(1 + ln(factor) / ln(original_max_position_"
                "embeddings)) needs original_max_position_embeddings >= 2, got 1; give "
                "attention_factor instead"
            )
        else:
            # sqrt is correctly rounded by IEEE 754: the same bits everywhere.
            attention_factor = math.sqrt(1 + _sincos.log(factor) / _sincos.log(original))
    else:
        raise ValueError(
            "scaling for rope_type 'longrope' needs 'factor' (transformers' default is "
            "config.max_position_embeddings / original_max_position_embeddings) or "
            "'attention_factor'; or pass the config itself as config= (or its rope_parameters "
            "as rope_parameters= with max_position_embeddings=)"
        )
    # One set of factors for the whole cache, chosen as transformers chooses it for a
    # forward pass: by the current sequence length against the original context.
    factors = long_factor if seq_len > original else short_factor
    positional_frequencies = _powers(
        base, np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    )
    return 1.0 / (factors * positional_frequencies), attention_factor


def _llama3(
    rotary_dim: int, base: float, seq_len: int, parameters: dict[str, Any]
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
    "longrope": _longrope,
    "llama3": _llama3,
}


# ------------------------------------------------------------ transformers' configs

#: The keys transformers knows in a ``rope_parameters`` dict (its ``RopeParameters``),
#: besides ``rope_type``/``type``. Those a type does not use are ignored, as transformers
#: ignores them; any other key (a typo) is refused.
TRANSFORMERS_KEYS = (
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "short_factor",
    "long_factor",
    "low_freq_factor",
    "high_freq_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "mrope_section",
)

#: The keys of :data:`TRANSFORMERS_KEYS` that only a scaled type uses.
_SCALING_ONLY = tuple(
    key
    for key in TRANSFORMERS_KEYS
    if key not in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings")
)

# The fields of a config that rope_cache reads; a config with none of them is refused.
_CONFIG_FIELDS = (
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "head_dim",
    "hidden_size",
    "num_attention_heads",
    "max_position_embeddings",
    "original_max_position_embeddings",
)


def _config_field(config: Any, name: str) -> Any:
    """``config.name`` of a transformers config, or ``config[name]`` of its dict form
    (``config.json``, ``config.to_dict()``); None when absent."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _read_rope_parameters(config: Any, rope_parameters: Any) -> tuple[str, str, dict[str, Any]]:
    """``(where, rope_type, the other keys)`` of the rope parameters as transformers reads
    them: ``rope_parameters=`` if given, else ``config.rope_parameters`` (transformers 5),
    else ``config.rope_scaling`` (4.x); none at all is plain RoPE."""
    if rope_parameters is not None:
        where, found = "rope_parameters", rope_parameters
    else:
        where, found = "config.rope_parameters", _config_field(config, "rope_parameters")
        if not found:
            where, found = "config.rope_scaling", _config_field(config, "rope_scaling")
        found = found or {}
    if not isinstance(found, Mapping):
        raise TypeError(
            f"{where} must be a dict such as {{'rope_type': 'linear', 'factor': 2.0, "
            f"'rope_theta': 10000.0}}, got {type(found).__name__}"
        )
    if "rope_type" not in found and "type" not in found:
        per_layer = [key for key, value in found.items() if isinstance(value, Mapping)]
        if per_layer:
            raise ValueError(
                f"{where} holds one dict per layer type ({', '.join(map(repr, per_layer))}); "
                f"rope_cache builds the cache of one: pass rope_parameters="
                f"{where}[{per_layer[0]!r}] (with config= for the model's other fields)"
            )
    parameters = dict(found)
    rope_type = parameters.pop("rope_type", None)
    legacy_type = parameters.pop("type", None)
    if rope_type is None:
        scaled = [key for key in _SCALING_ONLY if parameters.get(key) is not None]
        if scaled and legacy_type is None:
            # transformers would take "default" for an absent type (and ignore these
            # keys) and fail on a None one (KeyError): neither builds what they say.
            raise ValueError(
                f"{where} names no rope type (rope_type or type) but gives "
                f"{', '.join(f'{key}={parameters[key]!r}' for key in scaled)}, which only "
                f"a scaled type uses; name it, e.g. rope_type='linear' (supported: "
                f"{', '.join(map(repr, ROPE_TYPES))}), or leave those keys out"
            )
        rope_type = "default" if legacy_type is None else legacy_type
    elif legacy_type is not None and not _same_type(rope_type, legacy_type):
        raise ValueError(
            f"{where} gives two different types, rope_type={rope_type!r} and "
            f"type={legacy_type!r}; keep one"
        )
    model_type = _config_field(config, "model_type")
    if rope_type in _PHI3_FORMER_NAMES and model_type in _PHI3_MODEL_TYPES:
        rope_type = "longrope"  # as Phi3Config makes it (a config.json of Phi-3)
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{where} has rope_type {rope_type!r}, which rope_cache does not build; "
            f"supported: {', '.join(map(repr, ROPE_TYPES))}{_former_name_hint(rope_type)}"
        )
    unknown = [key for key in parameters if key not in TRANSFORMERS_KEYS]
    if unknown:
        raise ValueError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"in {where}; transformers' rope parameters are rope_type (or type), "
            f"{', '.join(TRANSFORMERS_KEYS)}"
        )
    return where, rope_type, parameters


def _rotated_channels(
    config: Any, parameters: dict[str, Any], head_dim: Any, rotary_dim: Any
) -> int:
    """transformers' ``int(head_dim * partial_rotary_factor)``, head_dim being
    ``config.head_dim`` or ``hidden_size // num_attention_heads``; it must agree with a
    ``rotary_dim`` given too."""
    fraction = parameters.pop("partial_rotary_factor", None)
    if fraction is None:
        fraction = _config_field(config, "partial_rotary_factor")
    fraction = 1.0 if fraction is None else _check_real("partial_rotary_factor", fraction)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {fraction}")
    if head_dim is None:
        head_dim = _config_field(config, "head_dim")
    if head_dim is None:
        hidden_size = _config_field(config, "hidden_size")
        heads = _config_field(config, "num_attention_heads")
        if hidden_size is not None and heads is not None:
            head_dim = _check_count("config.hidden_size", hidden_size, 1) // _check_count(
                "config.num_attention_heads", heads, 1
            )
    if head_dim is None:
        if rotary_dim is None:
            raise ValueError(
                "rope_cache needs the head size to size the cache: pass head_dim= (as "
                "config.head_dim, or hidden_size // num_attention_heads) or rotary_dim=, or a "
                "config= that has them"
            )
        if fraction != 1.0:
            raise ValueError(
                f"partial_rotary_factor={fraction} rotates a part of the head: pass head_dim= "
                f"so that rope_cache derives the rotated channels as transformers does"
            )
        return _check_count("rotary_dim", rotary_dim, 0)
    head_dim = _check_count("head_dim", head_dim, 1)
    channels = int(head_dim * fraction)
    if channels < 2 or channels % 2:
        raise ValueError(
            f"head_dim * partial_rotary_factor = {head_dim} * {fraction} gives {channels} "
            f"rotated channels (transformers' int(head_dim * partial_rotary_factor)); "
            f"rope_cache needs a positive even number"
        )
    if rotary_dim is not None and _check_count("rotary_dim", rotary_dim, 0) != channels:
        raise ValueError(
            f"rotary_dim={rotary_dim} disagrees with the config's head_dim * "
            f"partial_rotary_factor = {head_dim} * {fraction} = {channels}; leave rotary_dim "
            f"out, it is read from the config"
        )
    return channels


def _from_transformers(
    config: Any,
    rope_parameters: Any,
    head_dim: Any,
    max_position_embeddings: Any,
    rotary_dim: Any,
    base: Any,
) -> tuple[int, Any, dict[str, Any], int | None]:
    """``(rotary_dim, base, scaling, max_position_embeddings)`` of a transformers config,
    each field taken where transformers 5 takes it (``modeling_rope_utils.py``:
    ``standardize_rope_params`` and the ``_compute_*_parameters`` functions)."""
    if (
        config is not None
        and not isinstance(config, Mapping)
        and not any(hasattr(config, name) for name in _CONFIG_FIELDS)
    ):
        raise TypeError(
            f"config must be a transformers PretrainedConfig or a dict of its fields (as in "
            f"config.json), with {', '.join(_CONFIG_FIELDS)}; got {type(config).__name__}"
        )
    where, rope_type, parameters = _read_rope_parameters(config, rope_parameters)

    # The rope parameters' rope_theta wins over the config's (transformers 5 moves the
    # config's into the dict only when the dict has none).
    theta = parameters.pop("rope_theta", None)
    if theta is None:
        theta = _config_field(config, "rope_theta")
    if theta is None:
        theta = 10000.0 if base is None else base
    elif base is not None and _check_real("base", base) != _check_real("rope_theta", theta):
        raise ValueError(
            f"base={base} disagrees with rope_theta={theta} of the config; leave base out, "
            f"it is read from the config"
        )
    channels = _rotated_channels(config, parameters, head_dim, rotary_dim)

    if max_position_embeddings is None:
        max_position_embeddings = _config_field(config, "max_position_embeddings")
    if max_position_embeddings is not None:
        max_position_embeddings = _check_count(
            "max_position_embeddings", max_position_embeddings, 1
        )

    def context_length(use: str) -> int:
        if max_position_embeddings is None:
            raise ValueError(
                f"rope_type {rope_type!r} {use}: pass max_position_embeddings= (the "
                f"config's), or a config= that has it"
            )
        return max_position_embeddings

    def require(*keys: str) -> None:
        missing = [key for key in keys if parameters.get(key) is None]
        if missing:
            raise ValueError(
                f"{where} for rope_type {rope_type!r} is missing {', '.join(map(repr, missing))}"
            )

    scaling: dict[str, Any] = {"rope_type": rope_type}
    original: Any = None
    if rope_type in ("yarn", "longrope", "llama3"):
        # A config-level original_max_position_embeddings (Phi-3 keeps it there) wins
        # over the dict's; with neither, transformers takes max_position_embeddings.
        original = _config_field(config, "original_max_position_embeddings")
        if original is None:
            original = parameters.get("original_max_position_embeddings")
        if original is None:
            original = context_length(
                "needs original_max_position_embeddings (transformers then takes "
                "max_position_embeddings)"
            )
        scaling["original_max_position_embeddings"] = original

    def factor_or_ratio() -> Any:
        """``factor``, or (when None) transformers' ``max_position_embeddings /
        original_max_position_embeddings``."""
        if parameters.get("factor") is not None:
            return parameters["factor"]
        length = context_length(
            "without factor takes factor = max_position_embeddings / "
            "original_max_position_embeddings"
        )
        return length / _check_count(f"{rope_type} original_max_position_embeddings", original, 1)

    if rope_type == "linear":
        require("factor")
        scaling["factor"] = parameters["factor"]
    elif rope_type == "dynamic":
        require("factor")
        scaling["factor"] = parameters["factor"]
        # transformers grows dynamic NTK from max_position_embeddings (a dict's
        # original_max_position_embeddings is ignored, as there).
        scaling["original_max_position_embeddings"] = context_length(
            "grows its base past max_position_embeddings, the context it was trained on"
        )
    elif rope_type == "yarn":
        scaling["factor"] = factor_or_ratio()
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            scaling[key] = parameters.get(key)
        for key in ("beta_fast", "beta_slow"):
            if parameters.get(key):  # transformers: `or 32`, `or 1`: 0 means the default
                scaling[key] = parameters[key]
        # transformers: `rope_parameters.get("truncate", True)`, then `if truncate:`,
        # so an explicit None means no truncation.
        truncate = parameters.get("truncate", True)
        scaling["truncate"] = False if truncate is None else truncate
    elif rope_type == "longrope":
        require("short_factor", "long_factor")
        scaling["short_factor"] = parameters["short_factor"]
        scaling["long_factor"] = parameters["long_factor"]
        scaling["factor"] = factor_or_ratio()
        scaling["attention_factor"] = parameters.get("attention_factor")
    elif rope_type == "llama3":
        require("factor", "low_freq_factor", "high_freq_factor")
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            scaling[key] = parameters[key]
    return channels, theta, scaling, max_position_embeddings


# ------------------------------------------------------------------------------ public


def rope_cache(
    max_position: int | None = None,
    rotary_dim: int | None = None,
    *,
    base: float | None = None,
    scaling: Mapping[str, Any] | None = None,
    dtype: npt.DTypeLike = np.float32,
    seq_len: int | None = None,
    config: Any = None,
    rope_parameters: Mapping[str, Any] | None = None,
    head_dim: int | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[NumpyArray, NumpyArray]:
    r"""cos and sin caches of rotary position embedding, for positions
    ``0 .. max_position - 1``.

    Row ``p``, column ``i`` holds ``a*cos(p * inv_freq[i])`` and ``a*sin(p * inv_freq[i])``,
    where the inverse frequencies ``inv_freq`` and the attention factor ``a`` (1 except
    for yarn and longrope) come from ``base`` and ``scaling`` as in Hugging Face
    transformers. Angles, cos and sin are computed in float64 and rounded once to
    ``dtype``, to nearest even, to the same bits on every machine (see Notes).

    The arguments come in one of two forms:

    * numba_rope's: ``max_position``, ``rotary_dim``, ``base`` and ``scaling``;
    * transformers': ``config=`` (a ``PretrainedConfig``, or the dict of its fields as in
      ``config.json``) and/or ``rope_parameters=`` (its ``rope_parameters`` dict, or a
      4.x ``rope_scaling`` dict), read as they are: ``rope_theta`` is the base,
      ``max_position_embeddings`` the default ``max_position``, and ``rotary_dim`` is
      ``int(head_dim * partial_rotary_factor)``. Without a config, give ``head_dim=``
      (or ``rotary_dim``) and, where the type needs it, ``max_position_embeddings=``.

    Parameters
    ----------
    max_position : int, optional
        Number of positions (cache rows), ``>= 0``. With ``position_ids``, every id
        must be below it. Required in numba_rope's form; in transformers' form it
        defaults to ``max_position_embeddings``.
    rotary_dim : int, optional
        Number of rotated channels, positive and even (``rotary_embedding_dim``, or the
        head size when the whole head rotates). The caches have ``rotary_dim // 2``
        columns. Required in numba_rope's form; in transformers' form it is read from the
        config (and if given must agree with it).
    base : float, default 10000.0
        The RoPE base (``rope_theta``), finite and ``> 0``. In transformers' form the
        config's ``rope_theta`` is the base (a ``base`` given too must equal it).
    scaling : dict or None, default None
        numba_rope's form: None for plain RoPE, or a transformers ``rope_scaling`` dict
        without ``rope_theta`` and with every parameter given: ``rope_type`` (``"type"``
        is accepted as its former name; given both, they must name one type, or be a
        pair that transformers' config classes leave: ``"longrope"`` beside Phi-3's
        former names of it, ``"su"`` and ``"yarn"``, or ``"default"`` beside Qwen2-VL's
        ``"mrope"``) and the parameters below. Unknown
        types, unknown keys and missing parameters raise ``ValueError``; an optional key
        set to None counts as absent, but for yarn's ``truncate``: None means no
        truncation, as in transformers (``if truncate:``).
    dtype : dtype, default numpy.float32
        float32, float16, bfloat16 (``ml_dtypes.bfloat16``) or float64.
    seq_len : int, optional
        The current sequence length (the largest position id of the forward pass, plus
        one), for the two types whose frequencies depend on it, ``"dynamic"`` and
        ``"longrope"``; the others ignore it. Default: ``max_position``, i.e. a cache for
        a sequence that fills it. See Notes for how transformers picks it.
    config : transformers.PretrainedConfig or dict, optional
        A model config (transformers 4.x or 5), or its fields as a dict. Read:
        ``rope_parameters`` (5) or ``rope_scaling`` (4.x), ``rope_theta``,
        ``partial_rotary_factor``, ``head_dim`` (else ``hidden_size //
        num_attention_heads``), ``max_position_embeddings`` and
        ``original_max_position_embeddings`` (Phi-3 keeps it outside the dict; it then
        wins, as in transformers). A Phi-3 config (``model_type`` ``"phi3"`` or
        ``"phi4_multimodal"``) whose type is ``"su"`` or ``"yarn"`` is LongRoPE, as
        ``Phi3Config`` reads it. transformers is not imported. A dict is read as its
        keys say: fields a config class derives in Python (DeepSeek-V3's ``head_dim =
        qk_rope_head_dim``) are in ``config.to_dict()`` but not in ``config.json``; pass
        the config object, ``to_dict()``, or ``head_dim=``.
    rope_parameters : dict, optional
        transformers' rope parameters as they are (``rope_type`` or ``type``,
        ``rope_theta``, ``partial_rotary_factor``, ``factor``, ...), instead of the
        config's (e.g. one layer type's dict of a config with several). Keys transformers
        knows but the type does not use are ignored, as there; other keys are refused.
        A dict that names no type (neither key, or None) is plain RoPE, and is refused
        where it gives a parameter only a scaled type uses (``factor``, ...):
        transformers would ignore that parameter, or fail on a None type.
    head_dim : int, optional
        transformers' form: the head size, if not read from ``config``.
    max_position_embeddings : int, optional
        transformers' form: the model's context length, if not read from ``config``.

    Returns
    -------
    cos, sin : numpy.ndarray
        C-contiguous, shape ``[max_position, rotary_dim // 2]``, of ``dtype``: the
        ``cos_cache`` and ``sin_cache`` of :func:`numba_rope.rotary_embedding` with
        ``position_ids`` (transformers' ``cos``/``sin`` are these, with each row written
        twice: ``cat(cos, cos)``).

    Raises
    ------
    TypeError
        ``max_position``, ``rotary_dim``, ``seq_len`` or a count that is not an integer;
        ``base`` or a scaling number that is not a real number; ``scaling`` or
        ``rope_parameters`` that is not a dict; a ``config`` that is neither a config nor
        a dict; an unsupported ``dtype``; ``max_position`` or ``rotary_dim`` missing in
        numba_rope's form.
    ValueError
        Negative ``max_position``; ``rotary_dim`` not positive and even; ``base`` not
        finite and positive; an unknown ``rope_type`` (the message lists the supported
        ones); unknown or missing keys; a parameter outside its range (given in the
        message); the two forms mixed; a field a type needs missing from the config.

    Notes
    -----
    With ``d = rotary_dim``, ``i = 0 .. d/2 - 1``, ``n`` the
    ``original_max_position_embeddings`` of ``scaling`` (the context the model was
    trained on) and ``L`` the sequence length ``seq_len``:

    ``"default"`` (or ``scaling=None``), as ``_compute_default_rope_parameters``:
        ``inv_freq[i] = 1 / base**(2i / d)``.
    ``{"rope_type": "linear", "factor": f}``, as
    ``_compute_linear_scaling_rope_parameters``:
        ``inv_freq / f`` (the default evaluated at positions ``p / f``); ``f > 0``.
    ``{"rope_type": "dynamic", "factor": f, "original_max_position_embeddings": n}``, as ``_compute_dynamic_ntk_parameters``:
        the default with base ``base * (f*L/n - (f - 1))**(d / (d - 2))`` when
        ``L > n``, and the default unchanged when ``L <= n`` (transformers then keeps
        its original frequencies); ``f >= 1``, ``d >= 4``. transformers takes ``n`` from
        ``config.max_position_embeddings``.
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
    ``{"rope_type": "longrope", "short_factor": s, "long_factor": l, "original_max_position_embeddings": n}``, as ``_compute_longrope_parameters`` (Phi-3); optional ``factor`` ``f``, ``attention_factor``:
        ``inv_freq[i] = 1 / (e[i] * base**(2i/d))`` with ``e = l`` when ``L > n`` and
        ``e = s`` otherwise (``d/2`` numbers each). The attention factor is
        ``attention_factor`` if given, else ``sqrt(1 + ln(f) / ln(n))`` (1 when
        ``f <= 1``). numba_rope's form needs ``f`` or ``attention_factor``; transformers'
        takes ``f = max_position_embeddings / n`` when ``factor`` is absent.
    ``{"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi, "original_max_position_embeddings": n}``, as ``_compute_llama3_parameters``:
        with ``w = 2*pi / inv_freq_default``: ``w < n/hi`` keeps the frequency,
        ``w > n/lo`` divides it by ``f``, and in between ``s = (n/w - lo) / (hi - lo)``
        blends ``(1 - s) * inv_freq / f + s * inv_freq``. ``f >= 1``, ``hi > lo > 0``.

    Which cache transformers uses, for the two types that depend on ``L``: its rotary
    module takes ``L = max(position_ids) + 1`` of each forward pass.

    * longrope picks the short or the long factors anew at every forward pass: the
      cache of a pass is ``rope_cache(..., seq_len=L)``. A cache built for a sequence
      that may grow past ``n`` holds the short factors' angles for ``L <= n`` only:
      build two caches (``seq_len=n`` and ``seq_len=n + 1``) and use the one for the
      current ``L``, as transformers does (the attention factor is the same in both).
    * dynamic NTK recomputes its frequencies when ``L`` exceeds the longest length it
      has computed them for (``max(L, n)``), and returns to the original ones when a pass
      is shorter than ``n``: the cache of a pass is ``rope_cache(..., seq_len=S)`` with
      ``S`` the longest ``L`` since the last such return. The frequencies change with
      ``S``, so the cache must be built again whenever ``S`` grows (every row, not only
      the new ones), as transformers recomputes them.

    transformers computes these in float32 (and its angles too); here everything is
    float64 until the one rounding. In numba_rope's form the factors are taken from
    ``scaling`` as given: without a config there is no ``max_position_embeddings`` to
    derive a missing one from.

    Accuracy and reproducibility: the caches are the same bits on every machine (any
    CPU, with or without AVX-512, x86 or ARM, any OS, any NumPy; measured on x86-64, and
    on other machines a consequence of using IEEE operations only, without fast-math
    or FMA contraction). Each step of the
    formulas is a float64 operation rounded to nearest: ``+ - * /`` and ``sqrt`` by IEEE
    754, the powers and logarithms of the frequency formulas through the ``decimal``
    module (40 digits, then one rounding), and the angle ``p * inv_freq[i]`` a float64
    product. cos and sin of that angle are computed in double-double arithmetic from
    float64 ``+ - * /`` alone (no libm, no FMA, no NumPy SIMD) and rounded once: within
    ``0.5 + 2**-13`` ulp of the exact value, i.e. correctly rounded unless the exact
    value lies within ``2**-13`` ulp of a midpoint (none of 400 000 values tested
    against 45-digit decimal arithmetic did). yarn's and longrope's factor ``a`` then
    multiplies them, one more float64 rounding. The narrower dtypes are that float64
    value rounded once. Building a ``[131072, 64]`` cache takes about 0.6 s on two cores.

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

    A transformers config as it is (``config=model.config``, or its ``config.json``
    as a dict), here Phi-3's LongRoPE with a quarter of the head rotated:

    >>> config = {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 10000.0,
    ...           "partial_rotary_factor": 0.25, "max_position_embeddings": 1024,
    ...           "original_max_position_embeddings": 256,
    ...           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
    ...                            "long_factor": [4.0] * 8}}
    >>> cos, sin = numba_rope.rope_cache(config=config)  # sequences up to 1024: long
    >>> cos.shape  # [max_position_embeddings, 64 * 0.25 / 2]
    (1024, 8)
    >>> round(float(cos[0, 0]), 4)  # sqrt(1 + ln(1024 / 256) / ln(256))
    1.118
    >>> short_cos, _ = numba_rope.rope_cache(config=config, seq_len=256)
    >>> bool(np.array_equal(short_cos[:, 1:], cos[:, 1:]))
    False
    """
    if config is not None or rope_parameters is not None:
        if scaling is not None:
            raise ValueError(
                "scaling= is numba_rope's form of the rope parameters; with config= or "
                "rope_parameters= (transformers' form) leave it out"
            )
        rotary_dim, base, scaling, max_position_embeddings = _from_transformers(
            config, rope_parameters, head_dim, max_position_embeddings, rotary_dim, base
        )
        if max_position is None:
            if max_position_embeddings is None:
                raise ValueError(
                    "rope_cache needs max_position (the cache rows): pass it, or "
                    "max_position_embeddings=, or a config= that has it"
                )
            max_position = max_position_embeddings
    else:
        for name, value in (
            ("head_dim", head_dim),
            ("max_position_embeddings", max_position_embeddings),
        ):
            if value is not None:
                raise ValueError(
                    f"{name}= belongs to transformers' form, with config= or "
                    f"rope_parameters=; with scaling= pass rotary_dim (the rotated channels) "
                    f"and the scaling's own original_max_position_embeddings"
                )
        if max_position is None or rotary_dim is None:
            raise TypeError(
                "rope_cache needs max_position and rotary_dim, or a transformers config "
                "(config= or rope_parameters=) to read them from"
            )
        if base is None:
            base = 10000.0
    max_position = _check_count("max_position", max_position, 0)
    rotary_dim = _check_count("rotary_dim", rotary_dim, 0)
    if rotary_dim == 0 or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim must be positive and even (channels rotate in pairs), got {rotary_dim}"
        )
    base = _check_positive("base", base)
    seq_len = max_position if seq_len is None else _check_count("seq_len", seq_len, 1)
    rope_type, parameters = _check_scaling(scaling)
    dtype = _check_dtype(dtype)

    inverse_frequencies, attention_factor = _FREQUENCIES[rope_type](
        rotary_dim, base, seq_len, parameters
    )
    cos, sin = _sincos.cos_sin(max_position, inverse_frequencies)
    if attention_factor != 1.0:
        cos *= attention_factor
        sin *= attention_factor
    return round_once(cos, dtype), round_once(sin, dtype)
