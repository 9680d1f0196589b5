"""The numba kernel entries' C signatures, written once.

Each entry (``forward_serial``/``forward_parallel`` take :data:`FORWARD`,
``backward_serial``/``backward_parallel`` take :data:`BACKWARD`) is a ``void`` C function
of these positional arguments, in this order. Three places follow this description:
``_numba_kernels.entry`` compiles the entries with the types given here (and checks the
parameter names of the functions it compiles), ``numba_.forward``/``numba_.backward`` pass
the arguments in this order (``tests/test_numba_backend.py`` checks it), and a compiled
caller compares :func:`signature` with its own description at load time, so that a
mismatch raises instead of calling the kernel with the wrong arguments.

Types: ``i64`` (a 64-bit signed integer: a tensor's address from ``data_ptr()``, an
element count or a row stride in elements; an address of 0 means "not wanted" where the
argument says so), ``f64`` (a C double) and ``bool`` (a C ``bool``).

This module imports nothing but the standard library: it can be read without numba.
"""

from __future__ import annotations

__all__ = [
    "BACKWARD",
    "CTYPES",
    "DROPOUT_ADD",
    "DROPOUT_ADD_BACKWARD",
    "FORWARD",
    "KERNELS",
    "MEMORY_EFFICIENT_BACKWARD",
    "SUM3",
    "names",
    "signature",
]

#: the forward entry: rows ``i`` of x and residual start ``i * x_stride`` and
#: ``i * residual_stride`` elements after their addresses; ``residual_out``, ``y`` are
#: contiguous (m * n); ``mean`` (unused for RMSNorm) and ``rstd`` (m,) are written only
#: when ``store_stats``; ``stream`` asks for non-temporal stores of a large float32 ``y``;
#: ``flags`` is (m + 1) bytes: ``flags[i]`` is set when row ``i`` of ``y`` needs the exact
#: fallback (``layernorm.backends._exact``), ``flags[m]`` when any row does.
#: ``weight`` and ``bias`` (N,) hold x's dtype when ``params_x_dtype`` (16-bit ones are
#: widened exactly inside the kernel, once per call), else the accumulation dtype.
#: ``y`` holds the entry's output dtype: x's for the plain entries; an entry for another
#: ``y`` (``numba_.entry(dtype, name, y_dtype)``: float32 from float64 or a 16-bit dtype,
#: a 16-bit dtype from a wider or the other 16-bit one) takes these same arguments,
#: compiled on first use (float32 from a 16-bit dtype by ``numba_.build`` too),
#: each element of ``y`` rounded once into its dtype. The output dtype is a property of the
#: compiled entry, not an argument, so the signature (and a compiled caller's check of it)
#: is the same for every entry.
FORWARD: tuple[tuple[str, str], ...] = (
    ("x", "i64"),
    ("x_stride", "i64"),
    ("residual", "i64"),
    ("residual_stride", "i64"),
    ("has_residual", "bool"),
    ("residual_out", "i64"),
    ("weight", "i64"),
    ("bias", "i64"),
    ("params_x_dtype", "bool"),
    ("y", "i64"),
    ("mean", "i64"),
    ("rstd", "i64"),
    ("m", "i64"),
    ("n", "i64"),
    ("eps", "f64"),
    ("rms", "bool"),
    ("stream", "bool"),
    ("store_stats", "bool"),
    ("flags", "i64"),
)

#: the backward entry: ``dresidual_out`` is one row of ``-0.0`` with a stride of 0 when
#: there is no residual gradient; ``dweight`` and ``dbias`` are 0 when not wanted; ``x``
#: is the normalized input ``z`` (``x + residual``), whose statistics the kernel
#: recomputes with ``eps`` (``mean``/``rstd`` are the forward's, a starting point only);
#: ``dy`` holds x's dtype (a ``dy`` of a narrower ``y`` is widened to it by the caller,
#: exactly: ``layernorm._op``); ``flags`` is (m + 1) bytes as in :data:`FORWARD`:
#: ``flags[i]`` is set when row ``i`` of
#: ``dx`` needs the exact fallback (``layernorm.backends._exact``), ``flags[m]`` when any
#: row does. ``weight`` holds x's dtype when ``params_x_dtype``, else the accumulation
#: dtype, as in :data:`FORWARD`; ``dweight`` and ``dbias`` are in the accumulation dtype.
BACKWARD: tuple[tuple[str, str], ...] = (
    ("dy", "i64"),
    ("dy_stride", "i64"),
    ("x", "i64"),
    ("x_stride", "i64"),
    ("dresidual_out", "i64"),
    ("dresidual_out_stride", "i64"),
    ("weight", "i64"),
    ("params_x_dtype", "bool"),
    ("mean", "i64"),
    ("rstd", "i64"),
    ("dx", "i64"),
    ("dweight", "i64"),
    ("dbias", "i64"),
    ("m", "i64"),
    ("n", "i64"),
    ("rms", "bool"),
    ("stream", "bool"),
    ("eps", "f64"),
    ("flags", "i64"),
)

#: the dropout-add entry (``_numba_dropout.entry("dropout_add")``): rows ``row_lo ..
#: row_hi - 1`` of a call of ``m`` rows of ``h = RN(k0·s·x0·rowscale + k1·s·x1 +
#: residual)`` (layernorm.backends._numba_dropout), every tensor in the entry's one dtype
#: but ``rowscale`` (float64, ``m``) and the masks (bool); an entry of a (terms, stream)
#: pair (``numba_.STREAM_PAIRS``) has ``residual`` and ``h`` in the stream's dtype (and
#: the backward ``dh`` and ``dresidual``, the sum ``residual`` and ``h``); rows ``i`` of
#: x0, x1 and residual start ``i * stride`` elements after their addresses, ``h`` and the masks are
#: contiguous (m * n). An absent ``x1``, ``residual``, ``rowscale`` or mask (its ``has_*``
#: or ``want_masks`` false) is not read: any valid address. ``(k0, k1)`` is the seed's
#: Philox key (``_philox.seed_key``), ``p32`` the keep threshold (a float32 value),
#: ``s`` the scale (``_philox.threshold``, ``_philox.dropout_scale``). The span arguments
#: make every entry one span of a threaded call.
DROPOUT_ADD: tuple[tuple[str, str], ...] = (
    ("x0", "i64"),
    ("x0_stride", "i64"),
    ("x1", "i64"),
    ("x1_stride", "i64"),
    ("residual", "i64"),
    ("residual_stride", "i64"),
    ("rowscale", "i64"),
    ("h", "i64"),
    ("mask0", "i64"),
    ("mask1", "i64"),
    ("m", "i64"),
    ("n", "i64"),
    ("k0", "i64"),
    ("k1", "i64"),
    ("p32", "f64"),
    ("s", "f64"),
    ("has_x1", "bool"),
    ("has_residual", "bool"),
    ("has_rowscale", "bool"),
    ("want_masks", "bool"),
    ("row_lo", "i64"),
    ("row_hi", "i64"),
)

#: the exact three-term sum ``h = RN(x0 + x1 + residual)`` (``_numba_dropout.entry("sum3")``:
#: the dropout-add where every element is kept, ``s`` is 1 and there is no rowscale),
#: with :data:`DROPOUT_ADD`'s layout; no residual is one row of ``-0.0`` with stride 0.
SUM3: tuple[tuple[str, str], ...] = (
    ("x0", "i64"),
    ("x0_stride", "i64"),
    ("x1", "i64"),
    ("x1_stride", "i64"),
    ("residual", "i64"),
    ("residual_stride", "i64"),
    ("h", "i64"),
    ("m", "i64"),
    ("n", "i64"),
    ("row_lo", "i64"),
    ("row_hi", "i64"),
)

#: the dropout-add's backward (``_numba_dropout.entry("dropout_add_backward")``): rows
#: ``row_lo .. row_hi - 1`` of ``dx0 = RN(dh·k0·s·rowscale)``, ``dx1 = RN(dh·k1·s)``
#: (``has_x1``) and ``dresidual = RN(dh)`` (``has_residual``: a residual of another
#: dtype than ``dh``'s; of the same one its gradient is ``dh`` itself), with
#: :data:`DROPOUT_ADD`'s layout and key; the gradients are contiguous, each in the dtype of
#: the entry.
DROPOUT_ADD_BACKWARD: tuple[tuple[str, str], ...] = (
    ("dh", "i64"),
    ("dh_stride", "i64"),
    ("rowscale", "i64"),
    ("dx0", "i64"),
    ("dx1", "i64"),
    ("dresidual", "i64"),
    ("m", "i64"),
    ("n", "i64"),
    ("k0", "i64"),
    ("k1", "i64"),
    ("p32", "f64"),
    ("s", "f64"),
    ("has_rowscale", "bool"),
    ("has_x1", "bool"),
    ("has_residual", "bool"),
    ("row_lo", "i64"),
    ("row_hi", "i64"),
)

#: the memory-efficient backward (``_numba_recompute.entry``): rows ``row_lo .. row_hi - 1``
#: (whole blocks of ``_numba_recompute.BLOCK`` rows) of ``dx`` from ``dy`` (row stride
#: ``dy_stride``) and the saved output ``y`` (contiguous), ``gamma`` and ``beta`` (float64
#: rows of ``n``), ``rstd`` (``m`` float32), and their blocks' float64 partial sums of
#: ``dweight`` (``need_dw``) and ``dbias`` (``need_db``) at ``dw_part`` / ``db_part``
#: (``blocks · n``, zeros); ``dy``, ``y``, ``dx`` in the entry's dtype.
MEMORY_EFFICIENT_BACKWARD: tuple[tuple[str, str], ...] = (
    ("dy", "i64"),
    ("dy_stride", "i64"),
    ("y", "i64"),
    ("gamma", "i64"),
    ("beta", "i64"),
    ("rstd", "i64"),
    ("dx", "i64"),
    ("dw_part", "i64"),
    ("db_part", "i64"),
    ("m", "i64"),
    ("n", "i64"),
    ("rms", "bool"),
    ("need_dw", "bool"),
    ("need_db", "bool"),
    ("row_lo", "i64"),
    ("row_hi", "i64"),
)

KERNELS = {
    "forward": FORWARD,
    "backward": BACKWARD,
    "dropout_add": DROPOUT_ADD,
    "sum3": SUM3,
    "dropout_add_backward": DROPOUT_ADD_BACKWARD,
    "memory_efficient_backward": MEMORY_EFFICIENT_BACKWARD,
}
#: the C type of each type name
CTYPES = {"i64": "int64_t", "f64": "double", "bool": "bool"}


def names(direction: str) -> tuple[str, ...]:
    """The argument names of the ``direction`` entries (a key of :data:`KERNELS`), in
    order."""
    return tuple(name for name, _ in KERNELS[direction])


def signature(direction: str) -> str:
    """The compact form of the ``direction`` entries' arguments (a key of :data:`KERNELS`),
    for a caller to compare
    with its own, e.g. ``"x:i64,x_stride:i64,...,store_stats:bool"``."""
    return ",".join(f"{name}:{kind}" for name, kind in KERNELS[direction])
