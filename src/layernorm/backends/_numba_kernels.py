"""Numba CPU kernels for layer norm and RMSNorm: fused, multithreaded, deterministic.

Imported only on the numba backend's first call (``import layernorm`` compiles nothing).
There are four kernels (``forward_serial``/``forward_parallel``,
``backward_serial``/``backward_parallel``) on tensor addresses; the parallel ones run
their rows over numba's threads (``prange``), the serial ones in the calling thread, and
both run the same compiled row functions. :func:`entry` compiles one of them for one
dtype as a function of C-typed arguments only, which Python calls (``numba_``) and the
compiled dispatch calls from C++ by its address (:func:`address`): one compiled body,
the same bits either way. Everything is ``@njit(cache=True)``: the first call of each
dtype's entry compiles (2–4 s), later processes load it from numba's on-disk cache
(``NUMBA_CACHE_DIR``, else ``__pycache__`` beside this file, else numba's user-wide cache
when the package directory is read-only).

Data layout. Each (M, N) tensor arrives as a flat 1-D array over its storage plus a row
stride, so row ``i`` is ``a[i * stride : i * stride + N]``: strided rows are read in place
(no copy). Every pass over a row (the sums, the residual add, the output, dx) is an
intrinsic of :mod:`layernorm.backends._numba_vectors` that emits its loop inline, on
explicit 64-byte vectors. float16 and bfloat16 arrive as their raw 16-bit patterns (int16
and uint16 arrays; numba has no half types) and are converted in registers, with
round-to-nearest-even on output. Weight and bias arrive in the accumulation dtype; a
missing weight is ones and a missing bias is ``-0.0`` (``v * 1 + -0.0 == v`` bitwise, so
no inner-loop branches).

Numerics (SPEC §3). Accumulation in float32 (float64 for float64 input). Statistics are
the corrected two-pass: ``m1 = mean(z)``, ``d = z - m1``, ``delta = mean(d)``,
``mean = m1 + delta``, ``var = mean((d - delta)²)``, computed as
``mean(d²) - delta²`` so that ``sum(d)`` and ``sum(d²)`` share one pass (``delta`` is a
rounding error of ``m1``: the subtraction cancels nothing). A row is read once from
memory; the two reduction passes and the output pass re-read it from cache.

Determinism. Every row sum goes through :mod:`layernorm.backends._numba_vectors`,
whose summation order is written out in LLVM IR and depends on N alone: not on M, the
row's position, the thread count, the entry (serial or parallel), streaming, or the code
the sum is compiled into (``tests/test_numba_vectors.py`` replays the order in NumPy
bit for bit; ``tests/test_numba_backend.py`` compares the entries and paths). The element
arithmetic carries no fast-math flags, so ``(z - m1) - delta`` is never rewritten, and
no function that computes a statistic is compiled with ``fastmath``. So outputs are
bitwise batch- and thread-invariant, and the same from build to build.
dweight/dbias partial sums come from a fixed partition of the rows into blocks of
:data:`ROW_BLOCK` rows (independent of the thread count), summed row by row within a
block, then over blocks in block order in float64. (Before the explicit order, the sums
were ``reassoc`` loops whose vector order LLVM chose where they were compiled: dropping
an unrelated loop's loads from the backward's block function changed 1-3 ulp in ~10% of
dx; benchmarks/RESULTS.md.)

Inlining. Code that numba inlines itself (``inline="always"``) is lowered with the
caller's fast-math flags; none of these kernels has any, and the forward's row function
is inlined (a call per row passing a dozen array structs cost 20-30% on rows of
768-1024). The row passes are intrinsics: inline by construction.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._numba_vectors import (
    Row,
    add_rows,
    dx_row,
    dx_row_touching,
    normalize_row,
    normalized,
    row_sum,
    row_sum_sq,
    row_sums_backward,
    row_sums_centered,
    splat,
)

ROW_BLOCK = 32  # rows per dweight/dbias partial sum (fixed: never depends on threads)
#: The start of the SHA-256 of ``_numba_vectors.py``, whose intrinsics are compiled into
#: these kernels. numba keys its on-disk cache on this file alone, so a change to that one
#: must change this line, or a stale cached kernel would keep running the old code;
#: ``tests/test_numba_vectors.py`` fails until it does.
VECTORS_SHA256 = "efb58b32f3447a2e"


def _jit(*signature, **options):
    """``numba.njit`` with the on-disk cache, falling back to no cache when numba finds
    no writable cache directory at all (then every process compiles again). Division by
    zero follows IEEE (``1 / 0 = inf``), not Python's ZeroDivisionError. With a
    ``signature``, compiles (or loads from the cache) now."""
    options.setdefault("error_model", "numpy")

    def decorate(func):
        try:
            return njit(*signature, cache=True, **options)(func)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(*signature, cache=False, **options)(func)

    return decorate


# ---------------------------------------------------------------------------------------
# Streaming (non-temporal) stores for large float32 outputs: explicit <8 x float> vectors
# whose stores bypass the cache (no read-for-ownership of the output, which a plain store
# costs), with the arithmetic of ``_numba_vectors.normalize_row`` (same bits). Used only
# when the output is larger than the caches, where it would be evicted before anyone read
# it anyway. (Measured: it makes the forward ~20% faster; the backward, which re-reads two
# rows per written one, got slower with it, so dx keeps plain stores.)

_WIDTH = 8  # floats per streamed vector (AVX); a row's unaligned head and tail go the plain way
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")  # sfence


@intrinsic
def _normalize_vector_nt(typingctx, z, y, k, m1, delta, rstd, w, b):
    """y[k:k+8] = ((z - m1) - delta) * rstd * w + b, streamed; y + k must be 32-aligned."""
    sig = types.void(z, y, k, m1, delta, rstd, w, b)

    def codegen(context, builder, signature, args):
        za, ya, k, m1, delta, rstd, wa, ba = args
        at = signature.args
        zv, wv, bv = (
            Row(context, builder, at[i], a).load(k, _WIDTH) for i, a in ((0, za), (6, wa), (7, ba))
        )
        scalars = (splat(builder, v, _WIDTH) for v in (m1, delta, rstd))
        yv = normalized(builder, zv, wv, bv, *scalars)
        Row(context, builder, at[1], ya).store(yv, k, _WIDTH, streaming=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _copy_vector_nt(typingctx, src, dst, k):
    """dst[k:k+8] = src[k:k+8], streamed; dst + k must be 32-aligned."""
    sig = types.void(src, dst, k)

    def codegen(context, builder, signature, args):
        sa, da, k = args
        at = signature.args
        value = Row(context, builder, at[0], sa).load(k, _WIDTH)
        Row(context, builder, at[1], da).store(value, k, _WIDTH, streaming=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """sfence: the row's streaming stores are globally visible before anything after."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@_jit()
def _aligned_head(a, n):
    """How many leading elements of the float32 array ``a`` precede a 32-byte boundary."""
    return min(n, ((4 * _WIDTH - a.ctypes.data % (4 * _WIDTH)) % (4 * _WIDTH)) // 4)


def normalize_row_streaming(z, y, m1, delta, rstd, w, b):
    """:func:`normalize_row` with streaming stores where every row is float32 (on x86)."""


@overload(normalize_row_streaming, inline="always")
def _normalize_row_streaming(z, y, m1, delta, rstd, w, b):
    if not (_X86 and y.dtype == z.dtype == w.dtype == b.dtype == types.float32):
        return lambda z, y, m1, delta, rstd, w, b: normalize_row(z, y, m1, delta, rstd, w, b)

    def impl(z, y, m1, delta, rstd, w, b):
        n = y.shape[0]
        head = _aligned_head(y, n)
        normalize_row(z[:head], y[:head], m1, delta, rstd, w[:head], b[:head])
        k = head
        while k + _WIDTH <= n:
            _normalize_vector_nt(z, y, k, m1, delta, rstd, w, b)
            k += _WIDTH
        normalize_row(z[k:], y[k:], m1, delta, rstd, w[k:], b[k:])
        _store_fence()

    return impl


def copy_row_streaming(src, dst):
    """``dst[:] = src`` with streaming stores where both are float32 (on x86)."""


@overload(copy_row_streaming)
def _copy_row_streaming(src, dst):
    if not (_X86 and src.dtype == dst.dtype == types.float32):

        def plain(src, dst):
            for k in range(dst.shape[0]):
                dst[k] = src[k]

        return plain

    def impl(src, dst):
        n = dst.shape[0]
        head = _aligned_head(dst, n)
        for k in range(head):
            dst[k] = src[k]
        k = head
        while k + _WIDTH <= n:
            _copy_vector_nt(src, dst, k)
            k += _WIDTH
        for j in range(k, n):
            dst[j] = src[j]
        _store_fence()

    return impl


# ---------------------------------------------------------------------------------------
# Kernels


@_jit(inline="always")
def _row_statistics(i, x, xs, r, rs, has_r, h, mean, rstd, n, nf, eps, rms, st):
    """Row ``i``'s input ``z`` (``h = x + r``, written first, when ``has_r``) and its
    statistics ``(z, m1, delta, rstd_i)``: the forward's first three passes.

    ``x``, ``r``: flat storage with row strides ``xs``, ``rs``; ``h``: contiguous (M*N,)
    output in x's dtype; ``mean`` (unused for RMSNorm) and ``rstd``: (M,) in the
    accumulation dtype, like ``nf`` (N as a float) and ``eps``, written only when ``st``.
    """
    zero = nf - nf
    one = nf / nf
    z = x[i * xs : i * xs + n]
    if has_r:
        z = h[i * n : (i + 1) * n]
        add_rows(x[i * xs : i * xs + n], r[i * rs : i * rs + n], z)
    if rms:
        m1 = zero
        delta = zero
        var = row_sum_sq(z, zero) / nf
    else:
        m1 = row_sum(z, zero) / nf
        # One pass for Σd and Σd², d = z − m1: Σ(d − delta)² = Σd² − N·delta², and
        # delta is a rounding error of m1, so the subtraction cancels nothing.
        s1, s2 = row_sums_centered(z, m1, zero)
        delta = s1 / nf
        if st:
            mean[i] = m1 + delta
        var = max(s2 / nf - delta * delta, zero)
    r_i = one / np.sqrt(var + eps)
    if st:
        rstd[i] = r_i
    return z, m1, delta, r_i


@_jit(parallel=True)
def forward_kernel(x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, nf, eps, rms, stream, st):
    """Every row's statistics (:func:`_row_statistics`) and output ``y`` (contiguous
    (M*N,)), rows spread over numba's threads. ``stream``: write float32 ``y`` with
    non-temporal stores (same bits, no cache pollution)."""
    for i in prange(m):
        z, m1, delta, r_i = _row_statistics(
            i, x, xs, r, rs, has_r, h, mean, rstd, n, nf, eps, rms, st
        )
        if stream:
            normalize_row_streaming(z, y[i * n : (i + 1) * n], m1, delta, r_i, w, b)
        else:
            normalize_row(z, y[i * n : (i + 1) * n], m1, delta, r_i, w, b)


@_jit()
def forward_kernel_serial(x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, nf, eps, rms, st):
    """:func:`forward_kernel` in the calling thread (no parallel region to launch), without
    streaming stores (inputs this small stay in cache; nor does it compile them): the same
    row functions, so the same bits."""
    for i in range(m):
        z, m1, delta, r_i = _row_statistics(
            i, x, xs, r, rs, has_r, h, mean, rstd, n, nf, eps, rms, st
        )
        normalize_row(z, y[i * n : (i + 1) * n], m1, delta, r_i, w, b)


@_jit()
def _backward_block(blk, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, pw, pb, m, n, nf, rms, stream):
    """dx for the rows of block ``blk`` (rows ``blk*ROW_BLOCK`` to
    ``(blk+1)*ROW_BLOCK - 1``; ``+ dro``: without a residual, dro is one row of ``-0.0``
    with ``ds = 0``, and ``v + -0.0 == v`` bitwise) and the block's partial sums
    ``pw[blk*N:(blk+1)*N] = sum(g * u)``, ``pb[...] = sum(g)``, in row order.

    For RMSNorm the mean is 0 and ``c2`` is 0: ``(z - 0) * rstd`` and ``gh - 0`` are exact.
    ``stream`` (inputs far larger than the caches): each float32 dx row is computed into
    a cached scratch row, then written with non-temporal stores (no read-for-ownership of
    dx; same bits), and the next row of dy and x is loaded meanwhile (``dx_row_touching``):
    it then arrives from memory while this row's arithmetic runs instead of after it
    (measured: the large backward 10-15% faster on rows of 4096 and more; ``llvm.prefetch``
    hints did not do it, and the same loads in the forward's output pass made it slower:
    benchmarks/RESULTS.md). Returns the sum of those loads, for the caller to store so
    they stay (it means nothing).
    """
    zero = nf - nf
    touched = zero
    scratch = np.empty(n if stream else 0, dx.dtype)
    pw_blk = pw[blk * n : (blk + 1) * n]
    pb_blk = pb[blk * n : (blk + 1) * n]
    for k in range(n):
        pw_blk[k] = zero
        pb_blk[k] = zero
    for i in range(blk * ROW_BLOCK, min(m, (blk + 1) * ROW_BLOCK)):
        mu = zero if rms else mean[i]
        r_i = rstd[i]
        dy_i = dy[i * gs : i * gs + n]
        x_i = x[i * xs : i * xs + n]
        s0, s1, s2 = row_sums_backward(dy_i, x_i, w, mu, zero)
        delta = zero if rms else s0 / nf
        c2 = zero if rms else s2 / nf
        c1 = r_i * (s1 / nf - delta * c2)  # mean(gh * u), u = (d - delta) * rstd
        dro_i = dro[i * ds : i * ds + n]
        dx_i = dx[i * n : (i + 1) * n]
        if stream:  # into the scratch row, loading the next row meanwhile
            j = min(i + 1, m - 1)
            touched += dx_row_touching(
                dy_i,
                x_i,
                dro_i,
                scratch,
                w,
                pw_blk,
                pb_blk,
                dy[j * gs : j * gs + n],
                x[j * xs : j * xs + n],
                mu,
                delta,
                r_i,
                c1,
                c2,
            )
            copy_row_streaming(scratch, dx_i)
        else:
            dx_row(dy_i, x_i, dro_i, dx_i, w, pw_blk, pb_blk, mu, delta, r_i, c1, c2)
    return touched


@_jit(parallel=True)
def backward_kernel(
    dy, gs, x, xs, dro, ds, w, mean, rstd, dx, pw, pb, touched, m, n, nf, rms, stream
):
    """:func:`_backward_block` for every block of rows, blocks spread over the threads
    (``touched``: one throwaway value per block)."""
    for blk in prange((m + ROW_BLOCK - 1) // ROW_BLOCK):
        touched[blk] = _backward_block(
            blk, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, pw, pb, m, n, nf, rms, stream
        )


@_jit()
def backward_kernel_serial(
    dy, gs, x, xs, dro, ds, w, mean, rstd, dx, pw, pb, touched, m, n, nf, rms, stream
):
    """:func:`backward_kernel` in the calling thread."""
    for blk in range((m + ROW_BLOCK - 1) // ROW_BLOCK):
        touched[blk] = _backward_block(
            blk, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, pw, pb, m, n, nf, rms, stream
        )


@_jit()
def _add_into(total, part):
    for k in range(total.shape[0]):
        total[k] += part[k]


@_jit()
def column_sum_kernel(p, nblocks, n, out):
    """``out[k] = sum over blocks of p[blk*N + k]``, in block order, in float64.

    Serial on purpose: the partials are ``M / ROW_BLOCK`` rows of N, a few MB at most, and
    a parallel region costs more to launch on a busy machine than this costs to run.
    """
    total = np.zeros(n, np.float64)
    for blk in range(nblocks):
        _add_into(total, p[blk * n : (blk + 1) * n])
    for k in range(n):
        out[k] = total[k]


# ---------------------------------------------------------------------------------------
# Entry points. Python hands over tensors as addresses (``Tensor.data_ptr()``) and sizes:
# numba's dispatcher types a dozen ints in well under a microsecond, where turning each
# tensor into a NumPy array and typing it costs about one microsecond per tensor. ``xt``
# and ``at`` are empty arrays whose dtypes say what the addresses hold: x's storage dtype
# (int16/uint16 for float16/bfloat16 bits) and the accumulation dtype.


@intrinsic
def _pointer(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.intp), codegen


@_jit()
def _view(address, size, tag):
    """The ``size`` elements of ``tag``'s dtype at ``address``, as a 1-D array (no copy)."""
    return carray(_pointer(address), size, tag.dtype)


def _cast(tag, value):
    """``value`` as a scalar of ``tag``'s dtype."""


@overload(_cast)
def _cast_impl(tag, value):
    if tag.dtype == types.float64:
        return lambda tag, value: np.float64(value)
    return lambda tag, value: np.float32(value)


@_jit()
def _forward_views(xt, at, x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, rms, st):
    rows = (m - 1) * xs + n
    return (
        _view(x, rows, xt),
        _view(r, (m - 1) * rs + n if has_r else 1, xt),
        _view(h, m * n if has_r else 1, xt),
        _view(w, n, at),
        _view(b, n, at),
        _view(y, m * n, xt),
        _view(mean, 0 if rms or not st else m, at),
        _view(rstd, m if st else 0, at),
    )


@_jit()
def forward_serial(xt, at, x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, eps, rms, stream, st):
    """The forward on addresses, in the calling thread (for small inputs).

    Rows ``i`` of x and r start at ``x + i * xs`` and ``r + i * rs`` elements; without a
    residual, ``r`` and ``h`` may be any valid address (``has_r`` False). The outputs
    ``h``, ``y`` are contiguous (M*N); ``mean`` (ignored for RMSNorm) and ``rstd`` (M,),
    written only when ``st`` (any address otherwise). ``stream`` is ignored: inputs small
    enough to run here are never streamed (see :func:`forward_kernel_serial`).
    """
    xa, ra, ha, wa, ba, ya, ma, sa = _forward_views(
        xt, at, x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, rms, st
    )
    nf, e = _cast(at, n), _cast(at, eps)
    forward_kernel_serial(xa, xs, ra, rs, has_r, ha, wa, ba, ya, ma, sa, m, n, nf, e, rms, st)


@_jit()
def forward_parallel(
    xt, at, x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, eps, rms, stream, st
):
    """:func:`forward_serial`, rows spread over numba's threads."""
    xa, ra, ha, wa, ba, ya, ma, sa = _forward_views(
        xt, at, x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, rms, st
    )
    nf, e = _cast(at, n), _cast(at, eps)
    forward_kernel(xa, xs, ra, rs, has_r, ha, wa, ba, ya, ma, sa, m, n, nf, e, rms, stream, st)


@_jit()
def _backward_arrays(xt, at, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, m, n, rms):
    """The views over the addresses, the per-block partial sums and the per-block
    throwaway values (see :func:`backward_kernel`)."""
    nblocks = (m + ROW_BLOCK - 1) // ROW_BLOCK
    return (
        _view(dy, (m - 1) * gs + n, xt),
        _view(x, (m - 1) * xs + n, xt),
        _view(dro, (m - 1) * ds + n, xt),
        _view(w, n, at),
        _view(mean, 0 if rms else m, at),
        _view(rstd, m, at),
        _view(dx, m * n, xt),
        np.empty(nblocks * n, at.dtype),
        np.empty(nblocks * n, at.dtype),
        np.empty(nblocks, at.dtype),
    )


@_jit()
def _column_sums(at, pw, pb, dweight, dbias, n):
    """dweight and dbias (addresses; 0 when not wanted) from the block partial sums."""
    nblocks = pw.shape[0] // n
    if dweight != 0:
        column_sum_kernel(pw, nblocks, n, _view(dweight, n, at))
    if dbias != 0:
        column_sum_kernel(pb, nblocks, n, _view(dbias, n, at))


@_jit()
def backward_serial(
    xt, at, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, dweight, dbias, m, n, rms, stream
):
    """The backward on addresses, in the calling thread (for small inputs).

    ``dro``: the residual gradient with row stride ``ds`` (or one row of ``-0.0`` with
    ``ds = 0``); ``dweight``/``dbias``: (N,) outputs in the accumulation dtype, or 0 when
    not wanted.
    """
    g, xa, r, wa, ma, sa, d, pw, pb, touched = _backward_arrays(
        xt, at, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, m, n, rms
    )
    backward_kernel_serial(
        g, gs, xa, xs, r, ds, wa, ma, sa, d, pw, pb, touched, m, n, _cast(at, n), rms, stream
    )
    _column_sums(at, pw, pb, dweight, dbias, n)


@_jit()
def backward_parallel(
    xt, at, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, dweight, dbias, m, n, rms, stream
):
    """:func:`backward_serial`, blocks of rows spread over numba's threads."""
    g, xa, r, wa, ma, sa, d, pw, pb, touched = _backward_arrays(
        xt, at, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, m, n, rms
    )
    nf = _cast(at, n)
    backward_kernel(g, gs, xa, xs, r, ds, wa, ma, sa, d, pw, pb, touched, m, n, nf, rms, stream)
    _column_sums(at, pw, pb, dweight, dbias, n)


# ---------------------------------------------------------------------------------------
# Entries: the four kernels for one dtype, on C types only (addresses, sizes, flags)

_i64, _flag = types.int64, types.boolean
#: (x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, eps, rms, stream, st)
FORWARD_ENTRY = types.void(*[_i64] * 4, _flag, *[_i64] * 8, types.float64, *[_flag] * 3)
#: (dy, gs, x, xs, dro, ds, w, mean, rstd, dx, dweight, dbias, m, n, rms, stream)
BACKWARD_ENTRY = types.void(*[_i64] * 14, _flag, _flag)


def entry(name: str, xt: np.ndarray, at: np.ndarray):
    """Kernel ``name`` (``forward_serial``, ``forward_parallel``, ``backward_serial`` or
    ``backward_parallel``) for the storage and accumulation dtypes of the tags ``xt`` and
    ``at``, compiled now (or loaded from the on-disk cache) for the arguments of that
    kernel without its two tags: all of them C types, so the compiled function also has a
    C address (:func:`address`) that compiled code calls directly. The tags become
    constants of the compiled code (numba keys its cache on them too)."""
    if name == "forward_serial":

        def forward(x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, eps, rms, stream, st):
            forward_serial(xt, at, x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, eps, rms, stream, st)  # fmt: skip

    elif name == "forward_parallel":

        def forward(x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, eps, rms, stream, st):
            forward_parallel(xt, at, x, xs, r, rs, has_r, h, w, b, y, mean, rstd, m, n, eps, rms, stream, st)  # fmt: skip

    elif name == "backward_serial":

        def backward(dy, gs, x, xs, dro, ds, w, mean, rstd, dx, dweight, dbias, m, n, rms, stream):
            backward_serial(xt, at, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, dweight, dbias, m, n, rms, stream)  # fmt: skip

    elif name == "backward_parallel":

        def backward(dy, gs, x, xs, dro, ds, w, mean, rstd, dx, dweight, dbias, m, n, rms, stream):
            backward_parallel(xt, at, dy, gs, x, xs, dro, ds, w, mean, rstd, dx, dweight, dbias, m, n, rms, stream)  # fmt: skip

    else:
        raise ValueError(f"unknown kernel entry {name!r}")
    if name.startswith("forward"):
        return _jit(FORWARD_ENTRY)(forward)
    return _jit(BACKWARD_ENTRY)(backward)


def address(compiled) -> int:
    """The C address of an :func:`entry` (a ``void`` function of its C-typed arguments)."""
    (result,) = compiled.overloads.values()
    return result.library.get_pointer_to_function(result.fndesc.llvm_cfunc_wrapper_name)
