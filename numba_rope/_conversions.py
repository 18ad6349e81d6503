"""float16 and bfloat16 inside Numba CPU kernels.

Numba's CPU target has no float16 type and knows nothing of bfloat16, so the kernels
receive these arrays as 16-bit integer views. The integer type tells the format:

==============  ==================  ===============================================
storage dtype   numerical format    widening / narrowing
==============  ==================  ===============================================
``uint16``      IEEE float16        LLVM ``half``: ``fpext`` / ``fptrunc`` (F16C)
``int16``       bfloat16            shift by 16 / round to nearest even in integers
``float32``     float32             none
``float64``     float64             none
==============  ==================  ===============================================

:func:`widen` turns a stored element into its compute type (float64 stays float64,
everything else becomes float32) and :func:`narrow_like` rounds a computed value once,
to nearest even, into the element type of a given array. Both are resolved at compile
time from the argument types, so a kernel is written once for all formats.

NaN stays NaN and infinities stay infinite. The payload of a NaN is not preserved
bit for bit: bfloat16 NaNs become the canonical quiet NaN of their sign, as
``ml_dtypes`` does, and float16 NaNs are quieted by the hardware conversion.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

#: The storage dtype that stands for each 16-bit format inside the CPU kernels.
FLOAT16_STORAGE = np.dtype(np.uint16)
BFLOAT16_STORAGE = np.dtype(np.int16)

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)


def _float16_to_float32(builder, bits):
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())


def _float32_to_float16(builder, value):
    return builder.bitcast(builder.fptrunc(value, ir.HalfType()), _I16)


def _bfloat16_to_float32(builder, bits):
    wide = builder.shl(builder.zext(bits, _I32), ir.Constant(_I32, 16))
    return builder.bitcast(wide, ir.FloatType())


def _float32_to_bfloat16(builder, value):
    bits = builder.bitcast(value, _I32)
    # NaN becomes the canonical quiet NaN of its sign before rounding (rounding a NaN's
    # bits could carry into infinity). Everything stays 32 bits wide until the final
    # truncation, so the vectorized loop packs to 16 bits only once.
    sign = builder.and_(bits, ir.Constant(_I32, 0x80000000))
    quiet_nan = builder.or_(sign, ir.Constant(_I32, 0x7FC00000))
    is_nan = builder.fcmp_unordered("uno", value, value)
    bits = builder.select(is_nan, quiet_nan, bits)
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit.
    lowest_kept = builder.and_(builder.lshr(bits, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
    bias = builder.add(ir.Constant(_I32, 0x7FFF), lowest_kept)
    rounded = builder.lshr(builder.add(bits, bias), ir.Constant(_I32, 16))
    return builder.trunc(rounded, _I16)


#: Per storage type: (widening, narrowing) of a 16-bit format.
_HALF_FORMATS = {
    types.uint16: (_float16_to_float32, _float32_to_float16),
    types.int16: (_bfloat16_to_float32, _float32_to_bfloat16),
}


@intrinsic
def widen(typingctx, value):
    """Return a stored element in its compute type (see the module docstring).

    Intrinsics, not inlined overloads, emit these conversions: they cost nothing to
    compile (inlining numba IR is most of the compile time of these kernels).
    """
    if value in _HALF_FORMATS:
        to_float32 = _HALF_FORMATS[value][0]
        return types.float32(value), lambda context, builder, sig, args: to_float32(
            builder, args[0]
        )
    if value in (types.float32, types.float64):
        return value(value), lambda context, builder, sig, args: args[0]
    return None


@intrinsic
def narrow_like(typingctx, value, like):
    """Round ``value`` once to the element type of the array ``like``."""
    if not isinstance(like, types.Array) or not isinstance(value, types.Float):
        return None
    target = like.dtype
    if target in _HALF_FORMATS:
        from_float32 = _HALF_FORMATS[target][1]

        def narrow(context, builder, sig, args):
            single = context.cast(builder, args[0], sig.args[0], types.float32)
            return from_float32(builder, single)

        return target(value, like), narrow
    if target in (types.float32, types.float64):

        def cast(context, builder, sig, args):
            return context.cast(builder, args[0], sig.args[0], target)

        return target(value, like), cast
    return None
