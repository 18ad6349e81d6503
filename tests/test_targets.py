"""The CPU kernels keep the numerical contract on CPUs other than this one: compiled for
other x86 targets (``NUMBA_CPU_NAME``, in a subprocess with its own cache folder; nothing
runs), their machine code has no fused multiply-add, which would round once where the
contract rounds twice, but where the products are exact (float16 rows and caches), and
there has one; nor has ``rope_cache``'s cos/sin, whose double-double arithmetic
depends on it. The vector registers each target's code uses are reported, and the
hand-written vector steps must use the full 512 bits on the AVX-512 targets; bfloat16
results (words, and the elements of rows with float32 caches) are narrowed with
AVX512_BF16's instructions on the targets that have it (znver4, sapphirerapids) only,
not on an Emerald Rapids whose hypervisor hides it and AVX512-FP16, whose
instructions appear on no target without it; the streaming
vector steps store every result non-temporally (sapphirerapids, whose AVX512-FP16
changes how LLVM handles float16 vectors, included); and float16 results for ordinary
stores are converted into registers, never into memory, on every target but
sapphirerapids (interleaved rows included, whose 512-bit vectors once aborted LLVM on
AVX2); interleaved rows taken token by token rotate their pairs as they lie, with one
sum; and float32 rows into another array prefetch rows ahead,
16-bit ones none. And where this CPU can run haswell's code, its bfloat16 kernels run
here, with the bits of the float64 reference's contract (an AVX-512 machine otherwise
never runs an AVX2 machine's bfloat16 code); so do the kernels of every dtype compiled
for the oldest x86-64 (SSE2, no F16C), which every x86-64 CPU runs. Last, the kernels'
code as numba_rope generates it on 64-bit Arm, compiled by LLVM for aarch64 (nothing
runs): it compiles, with fused multiply-adds only where the products are exact, float16
by ``fcvt``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
from llvmlite import binding

LLVM_VERSION = binding.llvm_version_info

# A CPU name, or a name and the features numba is told (NUMBA_CPU_FEATURES): as a
# hypervisor that hides AVX512_BF16, AVX512-FP16 and AMX from an Emerald Rapids guest
# reports it (seen on a 2-core VM, 2026-12-02), which must get neither instruction set.
MASKED_EMERALDRAPIDS = (
    "emeraldrapids:+avx512f,+avx512dq,+avx512vl,+avx512bw,+f16c,"
    "-avx512bf16,-avx512fp16,-amx-bf16,-amx-fp16,-amx-tile"
)

#: Whether this machine runs x86-64 code (the tests that run or compile x86 CPUs' code).
X86_64_HOST = platform.machine().lower() in ("x86_64", "amd64")

TARGETS = ["haswell", "skylake-avx512", "znver4", "sapphirerapids", MASKED_EMERALDRAPIDS]
AVX512 = {"skylake-avx512", "znver4", "sapphirerapids", MASKED_EMERALDRAPIDS}
AVX512_BF16 = {"znver4", "sapphirerapids"}
AVX512_FP16 = {"sapphirerapids"}

#: A piece of the scripts below: rope_cache's two cos/sin kernels, compiled.
SINCOS = r"""
def sincos_kernels():
    import numpy as np
    from numba import typeof
    from numba_rope import _sincos

    table, row = _sincos._TABLE, np.zeros((2, 3))
    for name, kernel, arguments in (
        ("cos/sin", _sincos._cos_sin_serial, (np.ones(3), row, row, table)),
        ("cos/sin reduced", _sincos._reduced_kernel,
         (np.zeros(3, np.int64), np.zeros(3), np.zeros(3), np.zeros(3), np.zeros(3), table)),
    ):
        signature = tuple(typeof(a) for a in arguments)
        kernel.compile(signature)
        yield name, kernel, signature
"""

SCRIPT = r"""
import json, re
import numpy as np
from numba_rope._cpu.backend import storage_dtype
from numba_rope._cpu.helper import _like
from numba_rope._cpu.kernels import make_runner
from numba_rope.bench import make_arrays

report = {}
# AVX512-FP16's own instructions (F16C's vcvtps2ph / vcvtph2ps are not among them).
FP16 = re.compile(r"\bv(?:cvtps2phx|cvtph2psx|cvtsh2ss|cvtss2sh|movsh|movw|(?:add|sub|mul)[ps]h)\b")


def counts(asm):  # the instructions the assertions below look for, in one kernel's assembly
    return {
        "fma": len(re.findall(r"\bv?f(n?m(add|sub)|madd|msub)\w*", asm)),
        "zmm": asm.count("%zmm"), "ymm": asm.count("%ymm"), "xmm": asm.count("%xmm"),
        "nontemporal": len(re.findall(r"\bv?movnt", asm)),
        "bf16": asm.count("vcvtne2ps2bf16"), "bf16 elements": asm.count("vcvtneps2bf16"),
        "fpclass": asm.count("vfpclassps"),
        "vpermt2w": asm.count("vpermt2w"), "vpternlogd": asm.count("vpternlogd"),
        "vptestmd": len(re.findall(r"\bvptestn?md\b", asm)),
        "fp16": len(FP16.findall(asm)),
        "float16 into memory": len(re.findall(r"\bvcvtps2ph\s+\$\d+, %[xyz]mm\d+, -?\d*\(", asm)),
        "vaddsubps": asm.count("vaddsubps"), "vsubps": len(re.findall(r"\bvsubps\b", asm)),
        "prefetcht0": len(re.findall(r"\bprefetcht0\b", asm)),
        "prefetchw": len(re.findall(r"\bprefetchw\b", asm)),
        "loop spills": loop_spills(asm),
    }


SPILL = re.compile(r"^\s+v\w+\s+%[xyz]mm\d+, -?\d*\(%rsp\)")


def loop_spills(asm):
    # The most vector spills (stores of a vector register to the stack) in one loop
    # that multiplies: a block from a label to a backward jump to it. Spills, not
    # reloads: the rare paths laid out of line (NaN and subnormal lanes) jump back into
    # the code they left, and the constants they reload from the stack (spilled once,
    # on entry) lie in such a block without being in a loop.
    lines = asm.splitlines()
    labels = {}
    most = 0
    for number, line in enumerate(lines):
        label = re.match(r"^(\.LBB\w+):", line)
        if label:
            labels[label.group(1)] = number
        jump = re.match(r"^\s+j\w+\s+(\.LBB\w+)", line)
        if jump and jump.group(1) in labels:
            body = lines[labels[jump.group(1)] : number + 1]
            if any("vmulps" in text for text in body):
                most = max(most, sum(bool(SPILL.match(text)) for text in body))
    return most

variants = [(d, w, streaming, False, False) for d, w in (("float32", False),
            ("float16", False), ("bfloat16", True)) for streaming in (False, True)]
variants += [  # decode steps (float16: cache rows widened once per token)
    ("float32", False, False, True, False), ("float16", False, False, True, False),
    ("bfloat16", True, False, True, False),
]
variants += [("float16", False, False, False, True)]  # interleaved: 512-bit vectors
# interleaved, token by token: the pairs rotated as they lie (vaddsubps on AVX2)
variants += [("float32", False, False, True, True), ("float16", False, False, True, True)]
# Every kernel rotates its rows by the runner of its options (make_runner): what the
# calling thread, numba's threads and the helper thread run.
for dtype, words, streaming, token_major, interleaved in variants:
    x, cos, sin, ids = make_arrays(np.random.default_rng(0), (1, 2, 3, 64), dtype)
    storage = storage_dtype(x.dtype)
    view = (lambda a: a) if storage is None else (lambda a: a.view(storage))
    likes = (_like(view(x)), None, _like(view(cos)), _like(view(sin)), _like(ids))
    run = make_runner((interleaved, False, True, 0, words, streaming, token_major), likes)
    asm = run._library.get_asm_str()
    name = dtype + (" streaming" if streaming else "") + (" token-major" if token_major else "")
    name += " interleaved" if interleaved else ""
    report[name] = counts(asm)
# The vector steps alone, streaming: every store of a rotated result must be
# non-temporal (an ordinary vector store to the output is a store LLVM made of a
# non-temporal one; stores to the stack are spills).
from numba import njit
from numba_rope._cpu.vector import vector_pairs

# (vpmov*: a truncating store, vcvtps2ph / vcvtneps2bf16: a conversion into memory)
ordinary_store = re.compile(
    r"^\s+v(mov(?!nt)\w*|extract\w*|pmov\w+|cvtps2ph\w*|cvtneps2bf16\w*)\s+"
    r"(\$\d+, )?%[xyz]mm\d+, (-?\d*\((?!%rsp)[^)]*\))",
    re.M,
)
# bfloat16 with float32 caches: rows of elements, not words (a 16-bit cache only), also
# with ordinary stores (a decode step's).
for dtype, words, cache, streaming in (
    ("float32", False, None, True), ("float16", False, None, True),
    ("bfloat16", True, None, True), ("float16", False, "float32", True),
    ("bfloat16", False, "float32", True), ("bfloat16", False, "float32", False),
):  # fmt: skip
    for interleaved in (False, True):
        x, cos, sin, ids = make_arrays(np.random.default_rng(0), (1, 1, 1, 128), dtype)
        if cache is not None:
            cos, sin = cos.astype(cache), sin.astype(cache)
        storage = storage_dtype(x.dtype)
        view = (lambda a: a) if storage is None else (lambda a: a.view(storage))

        def make_steps(interleaved, words, streaming):  # the options as constants
            @njit
            def steps(x_row, cos_row, sin_row, out_row):
                return vector_pairs(
                    x_row, cos_row, sin_row, out_row, 64, 1.0, interleaved, words, streaming
                )

            return steps

        steps = make_steps(interleaved, words, streaming)
        cache_view = view if cache is None else (lambda a: a)  # float32 caches as they are
        rows = (
            view(x)[0, 0, 0], cache_view(cos)[0], cache_view(sin)[0],
            np.empty_like(view(x)[0, 0, 0]),
        )  # fmt: skip
        # compiled, never called: this machine may lack the target's instructions
        steps_signature = tuple(__import__("numba").typeof(a) for a in rows)
        steps.compile(steps_signature)
        asm = steps.inspect_asm(steps_signature)
        caches = "" if cache is None else f" ({cache} caches)"
        name = dtype + caches + (" interleaved" if interleaved else "")
        name += " streaming steps" if streaming else " steps"
        report[name] = {
            **counts(asm), "ordinary stores": len(ordinary_store.findall(asm))
        }
# rope_cache's cos/sin: double-double arithmetic (Dekker's split and products), which a
# fused multiply-add would silently change.
for name, kernel, signature in sincos_kernels():
    report[name] = counts(kernel.inspect_asm(signature))
print(json.dumps(report))
"""


def _script_for(cpu, features, cache, script, *arguments):
    """``script`` run in a Python of its own, numba compiling for ``cpu`` with
    ``features`` (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES) into the cache folder ``cache``
    (never mixing this target's code into another's): the finished process."""
    env = {
        **os.environ,
        "NUMBA_CPU_NAME": cpu,
        "NUMBA_CPU_FEATURES": features,
        "NUMBA_CACHE_DIR": str(cache),
    }
    return subprocess.run(
        [sys.executable, "-c", script, *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.skipif(not X86_64_HOST, reason="x86 targets")
@pytest.mark.parametrize("cpu", TARGETS, ids=lambda cpu: cpu.replace(":", " ")[:28])
def test_kernels_compiled_for_other_x86_cpus_fuse_only_exact_products(tmp_path, cpu):
    name, _, features = cpu.partition(":")
    done = _script_for(name, features, tmp_path, SINCOS + SCRIPT)
    if done.returncode and "is not a recognized processor" in done.stderr:
        # numba's oldest supported versions (0.60: LLVM 14) predate znver4 and
        # emeraldrapids; the code for such a CPU is then the code for its features.
        pytest.skip(f"LLVM {LLVM_VERSION} does not know the CPU {name!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(cpu, report)  # the vector registers each target uses (pytest -s shows them)
    for variant, counts in report.items():
        # No fused multiply-add, which would round once where the contract rounds
        # twice, but where float16 rows rotate by float16 caches: there each product is
        # exact, and the vector steps fuse it with the sum on every target with FMA,
        # all of these (numba_rope._cpu.vector._Stream.rotate): the same bits, one
        # instruction fewer.
        fused = variant.startswith("float16") and "float32 caches" not in variant
        assert (counts["fma"] > 0) == fused, f"{cpu} {variant}: {counts['fma']} FMA"
        if "streaming" in variant:
            assert counts["nontemporal"] > 0, f"{cpu} {variant}: no non-temporal store"
        if variant.endswith("streaming steps") and LLVM_VERSION >= (20,):
            # LLVM 14 and 15 (numba 0.60, 0.61) sink the last store of each half of a row
            # of 64 float32 pairs, alike on its two paths (on and off a 64-byte line),
            # into one and drop its !nontemporal: an ordinary store there (slower, the
            # same bits).
            assert counts["ordinary stores"] == 0, f"{cpu} {variant}: ordinary stores"
        if not variant.startswith("cos/sin"):  # scalar double-double code
            assert counts["ymm"] + counts["zmm"] > 0, f"{cpu} {variant}: not vectorized"
        # The hand-written vector steps (streaming rows, bfloat16 words) are 16 lanes,
        # which LLVM legalizes into the target's registers: the full 512 bits on both
        # AVX-512 targets (skylake-avx512 included, whose tuning keeps LLVM's own loop
        # vectorizer at 256 bits), two ymm halves on haswell (whose bfloat16 words
        # take steps of 8: vector.NARROW_WORD_WIDTHS).
        hand_written = "streaming" in variant or variant.startswith("bfloat16")
        if hand_written and cpu in AVX512:
            assert counts["zmm"] > 0, f"{cpu} {variant}: the vector steps use no zmm"
        if cpu not in AVX512:
            assert counts["zmm"] == 0, f"{cpu} {variant}: zmm on a target without AVX-512"
        # bfloat16 results are narrowed by AVX512_BF16's instruction where the target has
        # it, behind a class test per vector (NaN and subnormal lanes take the integer
        # code); nowhere else.
        # bfloat16 rows with float32 caches are elements, not words: 16 lanes converted
        # by vcvtneps2bf16, 32 (interleaved pairs) by vcvtne2ps2bf16, in their order.
        bfloat16_words = variant.startswith("bfloat16") and "float32 caches" not in variant
        converts = variant.startswith("bfloat16") and cpu in AVX512_BF16
        conversions = counts["bf16"] + counts["bf16 elements"]
        assert (conversions > 0) == converts, f"{cpu} {variant}: {conversions} conversions"
        if bfloat16_words:
            assert counts["bf16 elements"] == 0, f"{cpu} {variant}: vcvtneps2bf16 in words"
            # Steps as wide as the target's registers hold (vector.NARROW_WORD_WIDTHS):
            # nothing spilled in the loops (a third of haswell's 16-word steps was).
            spills = counts["loop spills"]
            assert spills == 0, f"{cpu} {variant}: {spills} spills and reloads in a loop"
        assert counts["fpclass"] >= conversions, f"{cpu} {variant}: conversion without test"
        # bfloat16 words on AVX-512 without AVX512_BF16 (see pair_constants): rounded
        # with a bit test into a mask register, merged with a shift and vpternlogd,
        # not with the word permutation LLVM makes of constants it sees.
        # AVX512_BF16's results are permuted (vpermt2w).
        if bfloat16_words and cpu in AVX512 - AVX512_BF16:
            assert counts["vpermt2w"] == 0, f"{cpu} {variant}: vpermt2w"
            assert counts["vpternlogd"] > 0, f"{cpu} {variant}: no vpternlogd"
            assert counts["vptestmd"] > 0, f"{cpu} {variant}: no vptestmd"
        if cpu not in AVX512_FP16:
            assert counts["fp16"] == 0, f"{cpu} {variant}: AVX512-FP16 instructions"
        # Interleaved rows taken token by token rotate their pairs as they lie (see
        # numba_rope._cpu.kernels.duplicates_pairs) by one sum (the sin rows hold
        # -sin in their even lanes), which float16 fuses with a product: no
        # vaddsubps (AVX2) nor a difference and a sum blended (AVX-512).
        if variant.endswith("token-major interleaved"):
            assert counts["vaddsubps"] == 0, f"{cpu} {variant}: vaddsubps"
            assert counts["vsubps"] == 0, f"{cpu} {variant}: a difference"
        # float32 rows taken token by token into another array prefetch rows ahead:
        # the input's for reading (prefetcht0), the output's for writing (prefetchw,
        # which LLVM emits as prefetcht0 on haswell, without PRFCHW); 16-bit rows,
        # bound by their conversions, carry no prefetch (numba_rope._cpu.kernels.
        # _prefetches_ahead).
        if "token-major" in variant:
            prefetches = counts["prefetcht0"] + counts["prefetchw"]
            if variant.startswith("float32"):
                assert counts["prefetcht0"] > 0, f"{cpu} {variant}: no read prefetch"
                if cpu != "haswell":
                    assert counts["prefetchw"] > 0, f"{cpu} {variant}: no prefetchw"
            else:
                assert prefetches == 0, f"{cpu} {variant}: {prefetches} prefetches"
        # Head by head, float32 rows with ordinary stores read ahead too (the rows
        # written in place ahead, prefetchw, are every dtype's); streamed rows, whose
        # stores read no line, and 16-bit rows read none ahead (haswell's write
        # prefetches are prefetcht0, so it is left out of the second check).
        elif variant == "float32":
            assert counts["prefetcht0"] > 0, f"{cpu} {variant}: no read prefetch"
        elif variant in ("float16", "bfloat16", "float32 streaming") and cpu != "haswell":
            assert counts["prefetcht0"] == 0, f"{cpu} {variant}: a read prefetch"
        # float16 results stored with ordinary stores are converted into a register,
        # then stored: F16C's conversion into memory took twice as long on Zen 3 (see
        # numba_rope._cpu.vector._Stream.narrow).
        if variant.startswith("float16") and "streaming" not in variant:
            if cpu not in AVX512_FP16:
                assert counts["float16 into memory"] == 0, f"{cpu} {variant}: vcvtps2ph to memory"


RUN_SCRIPT = r"""
import sys
import numpy as np
import numba_rope
from numba_rope import config, reference
from ml_dtypes import bfloat16

rng = np.random.default_rng(7)
checked = 0
# Inputs of the dtypes named in argv, with caches of their dtype and float32: full and
# partial rotations whose pairs leave 0 or 8 past a multiple of 16 (bfloat16's word
# loops take steps of 8 on AVX2), interleaved and not, head by head and token by
# token, ordinary stores and streamed ones (STREAMING_MIN_BYTES 0), in place.
for name in sys.argv[1].split(","):
    dtype = bfloat16 if name == "bfloat16" else np.dtype(name)
    for cache_dtype in dict.fromkeys(map(np.dtype, (dtype, np.float32))):
        for head, rotary, interleaved in ((128, 128, False), (64, 16, False), (96, 48, False),
                                          (80, 80, False), (128, 128, True), (64, 48, True)):
            for shape, positions in (((2, 3, 5, head), "ids"), ((6, 4, 1, head), "ids"),
                                     ((2, 5, 3, head), "bshd")):
                layout = "bshd" if positions == "bshd" else "bhsd"
                x = rng.standard_normal(shape).astype(dtype)
                angles = rng.uniform(-20, 20, (40, rotary // 2))
                cos = np.cos(angles).astype(cache_dtype)
                sin = np.sin(angles).astype(cache_dtype)
                tokens = shape[1] if layout == "bshd" else shape[2]
                ids = rng.integers(0, 40, (shape[0], tokens))
                options = dict(rotary_embedding_dim=rotary, interleaved=interleaved, layout=layout)
                want = reference.rotary_embedding(x, cos, sin, ids, precision="contract", **options)
                bits = want.view(f"u{want.itemsize}")
                for streaming in (1 << 62, 0):
                    config.STREAMING_MIN_BYTES = streaming
                    got = numba_rope.rotary_embedding(x, cos, sin, ids, **options)
                    assert np.array_equal(got.view(bits.dtype), bits), (
                        name, cache_dtype, head, rotary, interleaved, shape, streaming)
                    inplace = x.copy()
                    numba_rope.rotary_embedding(inplace, cos, sin, ids, out=inplace, **options)
                    assert np.array_equal(inplace.view(bits.dtype), bits)
                    checked += 1
print(checked)
"""


def _run_compiled_for(cpu, dtypes, cache):
    """The number of calls RUN_SCRIPT checked with the kernels compiled for ``cpu``
    (no features beyond its own) and run here, on inputs of ``dtypes``."""
    done = _script_for(cpu, "", cache, RUN_SCRIPT, ",".join(dtypes))
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


#: The features of LLVM's haswell, which this machine must have to run its code.
HASWELL_FEATURES = {"avx", "avx2", "fma", "f16c", "bmi", "bmi2", "lzcnt", "movbe", "popcnt"}

#: The vector features of LLVM's skylake-avx512 (AVX-512 without AVX512_BF16: Skylake-SP,
#: Cascade Lake; Ice Lake's code takes the same bfloat16 path) on top of haswell's.
SKYLAKE_AVX512_FEATURES = HASWELL_FEATURES | {"avx512f", "avx512cd", "avx512bw", "avx512dq",
                                              "avx512vl"}  # fmt: skip


def _host_runs(features):
    host = {f[1:] for f in binding.get_host_cpu_features().flatten().split(",") if f[0] == "+"}
    return X86_64_HOST and features <= host


@pytest.mark.parametrize(
    "cpu, features",
    [("haswell", HASWELL_FEATURES), ("skylake-avx512", SKYLAKE_AVX512_FEATURES)],
    ids=["avx2", "avx512-without-bf16"],
)
def test_bfloat16_code_for_other_cpus_runs_with_the_contracts_bits(tmp_path, cpu, features):
    # Where this CPU has AVX512_BF16, the kernels it runs are not the ones a CPU without
    # it gets: on AVX2 bfloat16 word steps of 8 (vector.NARROW_WORD_WIDTHS) and the
    # integer rounding, on AVX-512 without AVX512_BF16 (Skylake-SP to Ice Lake servers)
    # the integer rounding on 512-bit vectors. Compiled for such a CPU in a subprocess
    # and run here, they give the bits of the float64 reference's contract, exact (one
    # rounding per operation, no FMA), on every CPU that can run them.
    if not _host_runs(features):
        pytest.skip(f"runs {cpu}'s code: needs an x86 CPU with its features")
    assert _run_compiled_for(cpu, ["bfloat16"], tmp_path) == 2 * 6 * 3 * 2


@pytest.mark.skipif(not X86_64_HOST, reason="x86 code")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_code_for_x86_64_without_avx_runs_with_the_contracts_bits(tmp_path, dtype):
    # The oldest x86-64 (SSE2 only; no AVX, no F16C): every x86-64 CPU runs its code.
    # Such CPUs are still sold (Atoms, Pentiums and Celerons without AVX) and virtual
    # CPUs are masked so (QEMU's default model); NUMBA_CPU_NAME=generic compiles so
    # too. float16 there once aborted the process (LLVM's fpext / fptrunc of half called
    # compiler-rt functions numba cannot link: "LLVM ERROR: Symbol not found:
    # __extendhfsf2"); its integer code (numba_rope._conversions) gives F16C's bits.
    # One dtype a test (each compiles its own kernels, 20-60 s): .ci/run's job of the
    # oldest versions runs float16's alone.
    cache_dtypes = 1 if dtype == "float32" else 2  # its own, and float32 for 16-bit x
    assert _run_compiled_for("x86-64", [dtype], tmp_path) == cache_dtypes * 6 * 3 * 2


ARM64_SCRIPT = r"""
import json, re
import numpy as np
import numba_rope._conversions as conversions
import numba_rope._cpu.relay as relay
import numba_rope._cpu.vector as vector

# Code generated as on a 64-bit Arm machine (the choices numba_rope makes from the
# machine it runs on), compiled by LLVM for aarch64: this machine cannot run it.
conversions.X86, conversions.ARM64, vector.X86, relay.X86 = False, True, False, False
import ctypes
from llvmlite import binding

# This machine's own code of float16 on Arm's terms (LLVM's half conversions, without
# F16C here) calls compiler-rt, which numba cannot link: named, never called.
never_called = ctypes.cast(ctypes.pythonapi.Py_IsInitialized, ctypes.c_void_p).value
for name in ("__extendhfsf2", "__truncsfhf2", "__gnu_h2f_ieee", "__gnu_f2h_ieee"):
    binding.add_symbol(name, never_called)  # (the last two: LLVM 14's names)
from numba_rope._cpu.backend import storage_dtype
from numba_rope._cpu.helper import _like
from numba_rope._cpu.kernels import make_runner
from numba_rope.bench import make_arrays

binding.initialize_all_targets()
binding.initialize_all_asmprinters()
target = binding.Target.from_triple("aarch64-unknown-linux-gnu")
machine = target.create_target_machine(cpu="neoverse-v1", opt=3)


def aarch64(ir):
    # numba's runtime (linked into every module, generated for this machine) holds the
    # one x86 intrinsic of the module, in NRT_decref: replaced, as its code is not ours.
    ir = re.sub(r"(%\S+) = tail call i8 @llvm\.x86\.atomic\.sub\.cc\.i64\([^)]*\)",
                r"\1 = add i8 0, 0", ir)
    ir = re.sub(r"declare i8 @llvm\.x86\.atomic\.sub\.cc\.i64.*", "", ir)
    module = binding.parse_assembly(ir)
    module.triple, module.data_layout = target.triple, str(machine.target_data)
    return machine.emit_assembly(module)


def counts(asm):
    return {
        "fma": len(re.findall(r"\bf(?:n?madd|n?msub|mla|mls)\b", asm)),
        "float16 calls": len(re.findall(r"\b(?:__extendhfsf2|__truncsfhf2|__gnu_\w+)", asm)),
        "fcvt": len(re.findall(r"\bfcvt[ln]?2?\b", asm)),
    }


report = {}
for dtype in ("float32", "float16", "bfloat16"):
    for cache in dict.fromkeys((dtype, "float32")):
        for words in (False, True) if dtype == "bfloat16" and cache == dtype else (False,):
            for streaming in (False, True):
                for token_major, interleaved in ((False, False), (False, True), (True, False)):
                    x, cos, sin, ids = make_arrays(np.random.default_rng(0), (1, 2, 3, 64), dtype)
                    cos, sin = cos.astype(cache), sin.astype(cache)
                    def view(a):
                        storage = storage_dtype(a.dtype)
                        return a if storage is None else a.view(storage)
                    likes = (_like(view(x)), None, _like(view(cos)), _like(view(sin)), _like(ids))
                    options = (interleaved, False, True, 0, words, streaming, token_major)
                    run = make_runner(options, likes)
                    name = f"{dtype} {cache} caches" + " words" * words
                    name += " streaming" * streaming + " token-major" * token_major
                    name += " interleaved" * interleaved
                    report[name] = counts(aarch64(run._library.get_llvm_str()))
for name, kernel, signature in sincos_kernels():
    report[name] = counts(aarch64(kernel.inspect_llvm(signature)))
print(json.dumps(report))
"""


def _has_aarch64_backend():
    """Whether this llvmlite was built with LLVM's AArch64 backend (its wheels are)."""
    binding.initialize_all_targets()
    try:
        binding.Target.from_triple("aarch64-unknown-linux-gnu")
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not X86_64_HOST, reason="x86 host")
@pytest.mark.skipif(not _has_aarch64_backend(), reason="llvmlite without LLVM's AArch64 backend")
def test_kernels_compile_for_64_bit_arm_with_the_contract(tmp_path):
    # No Arm machine runs this suite: the kernels' code, generated as on one, compiled by
    # LLVM for aarch64 (NUMBA_CPU_NAME=generic: no x86 features in it). Every kernel
    # compiles (the empty inline assembly that keeps vectors in registers on x86 named
    # no Arm register: LLVM ended the process on bfloat16 rows streamed), with no fused
    # multiply-add but where the products are exact, and float16 converts with fcvt,
    # never a compiler-rt call.
    done = _script_for("generic", "", tmp_path, SINCOS + ARM64_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # float32; float16 with both caches; bfloat16 words, elements, float32 caches: 6 each
    assert len(report) == 2 + 6 * (1 + 2 + 3), sorted(report)
    print(report)
    for variant, counts in report.items():
        # Fused only where the products are exact (float16 rows and caches: see
        # test_kernels_compiled_for_other_x86_cpus_fuse_only_exact_products).
        fused = variant.startswith("float16 float16 caches")
        assert (counts["fma"] > 0) == fused, f"aarch64 {variant}: {counts['fma']} FMA"
        assert counts["float16 calls"] == 0, f"aarch64 {variant}: float16 by a library call"
        if variant.startswith("float16") or " float16 caches" in variant:
            assert counts["fcvt"] > 0, f"aarch64 {variant}: no fcvt"
