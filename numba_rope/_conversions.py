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
from numba.extending import intrinsic, overload

#: The storage dtype that stands for each 16-bit format inside the CPU kernels.
FLOAT16_STORAGE = np.dtype(np.uint16)
BFLOAT16_STORAGE = np.dtype(np.int16)

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)


@intrinsic
def _float16_bits_to_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _float32_to_float16_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

    return types.uint16(value), codegen


@intrinsic
def _bfloat16_bits_to_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _float32_to_bfloat16_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], _I32)
        # NaN becomes the canonical quiet NaN of its sign before rounding (rounding a
        # NaN's bits could carry into infinity). Everything stays 32 bits wide until
        # the final truncation, so the vectorized loop packs to 16 bits only once.
        sign = builder.and_(bits, ir.Constant(_I32, 0x80000000))
        quiet_nan = builder.or_(sign, ir.Constant(_I32, 0x7FC00000))
        is_nan = builder.fcmp_unordered("uno", args[0], args[0])
        bits = builder.select(is_nan, quiet_nan, bits)
        # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit.
        lowest_kept = builder.and_(builder.lshr(bits, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
        bias = builder.add(ir.Constant(_I32, 0x7FFF), lowest_kept)
        rounded = builder.lshr(builder.add(bits, bias), ir.Constant(_I32, 16))
        return builder.trunc(rounded, _I16)

    return types.int16(value), codegen


def widen(value):  # pragma: no cover - replaced by the overload inside kernels
    """Return a stored element in its compute type (see the module docstring)."""
    raise NotImplementedError("widen is only callable from Numba-compiled code")


def narrow_like(value, like):  # pragma: no cover - replaced by the overload
    """Round ``value`` once to the element type of the array ``like``."""
    raise NotImplementedError("narrow_like is only callable from Numba-compiled code")


@overload(widen, inline="always")
def _widen_overload(value):
    if value == types.uint16:
        return lambda value: _float16_bits_to_float32(value)
    if value == types.int16:
        return lambda value: _bfloat16_bits_to_float32(value)
    if value in (types.float32, types.float64):
        return lambda value: value
    return None


@overload(narrow_like, inline="always")
def _narrow_like_overload(value, like):
    target = like.dtype
    if target == types.uint16:
        return lambda value, like: _float32_to_float16_bits(np.float32(value))
    if target == types.int16:
        return lambda value, like: _float32_to_bfloat16_bits(np.float32(value))
    if target == types.float32:
        return lambda value, like: np.float32(value)
    if target == types.float64:
        return lambda value, like: np.float64(value)
    return None
