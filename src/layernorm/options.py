"""The keyword options of the four functions (issue 23), as compositions on the op.

A call with every option at its default never comes here: :mod:`layernorm.ops` sends it
down the plain path after one check. Every option here is written as torch operations
around the public op (``ops._norm``), so each keeps what the op has (every backend, the
C++ front door, autograd, ``torch.compile``, ``torch.func``, forward AD, export and
tracing: ``docs/contract.md`` §6) without a kernel or an autograd formula of its own.
The commonest, ``offset``, the "gemma" and "llama" casting modes, ``out`` /
``residual_out`` and a narrower ``out_dtype``, run those same operations in C++ when the
compiled front door takes the call (:func:`_front_door`).
What each one rounds (``docs/contract.md`` §2, "Options"):

- ``offset``: the gain is ``weight + offset`` rounded once to the accumulation dtype (the
  exact sum rounded once for float32, bfloat16 and float16 weights when ``offset`` is a
  float32 value, ``±1.0`` say; see :func:`offset_gain`). The output is then correctly
  rounded for that gain, as for any weight.
- ``casting_mode`` (RMSNorm): Liger's three casting orders, with the arithmetic between
  two casts exact (:func:`cast_rms_norm`).
- ``out_dtype``: an output at least as wide as the input: the input converted to it
  (exactly), then normalized, so the output is correctly rounded in ``out_dtype`` (float32
  from a 16-bit input without a gradient or residual: the kernels of the pair, the same
  bits, :func:`_rounds_into`); a narrower one (float32 from float64, a 16-bit one from
  float32 or float64, float16 from bfloat16 and back): the kernels round each element
  once into it (``layernorm::forward_to``, ``ops._norm`` with ``out_dtype``).
- ``residual_dtype`` (add_layer_norm, add_rms_norm; quack's ``residual_dtype``,
  flash-attn's ``residual_in_fp32``), and a residual wider than ``x``: the residual
  stream in its own dtype (:func:`residual_stream`): ``residual_out`` the exact
  ``x + residual`` rounded once into it, ``y`` the norm of that rounded once into ``x``'s
  dtype (or ``out_dtype``).
- ``out`` / ``residual_out``: preallocated outputs, by torch's ``out=`` rules: written
  by the numba kernels directly where they run the call (:func:`write_into`), else the
  result copied in (:func:`store`); the same bits either way.
- ``memory_efficient`` (layer_norm, rms_norm): apex's backward from the saved output,
  :mod:`layernorm.recompute` (an ``autograd.Function``: the one option that is not a
  composition).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._prims_common.wrappers import _maybe_resize_out

from . import _op, backends, ops, recompute
from . import compiled as _compiled
from .backends import torch_
from .backends.torch_ import accumulation_dtype

__all__ = [
    "CASTING_MODES",
    "OPTIONS",
    "call",
    "cast_rms_norm",
    "check_out",
    "norm",
    "offset_gain",
    "residual_sum",
    "signed",
    "store",
    "write_into",
]

#: Liger's casting modes; ``None`` is this library's (one rounding)
CASTING_MODES = (None, "llama", "gemma", "none")

#: the dtypes an input of each dtype converts to exactly
_WIDER = {
    torch.float16: (torch.float16, torch.float32, torch.float64),
    torch.bfloat16: (torch.bfloat16, torch.float32, torch.float64),
    torch.float32: (torch.float32, torch.float64),
    torch.float64: (torch.float64,),
}
#: the output dtypes narrower than each input dtype (the kernels round into them:
#: ``torch_.OUT_DTYPES`` outside ``_WIDER``)
_NARROWER = {
    x: tuple(y for y in torch_.OUT_DTYPES if y not in wider) for x, wider in _WIDER.items()
}


#: each public function's options, with their defaults and types
_ALL: dict[str, tuple[Any, Any]] = {
    "offset": (0.0, "float"),
    "casting_mode": (None, "str | None"),
    "out_dtype": (None, "torch.dtype | None"),
    "out": (None, "Tensor | None"),
    "residual_out": (None, "Tensor | None"),
    "residual_dtype": (None, "torch.dtype | None"),
    "memory_efficient": (False, "bool"),
}
OPTIONS = {
    "layer_norm": ("offset", "out_dtype", "out", "memory_efficient"),
    "rms_norm": ("offset", "casting_mode", "out_dtype", "out", "memory_efficient"),
    "add_layer_norm": ("offset", "out_dtype", "out", "residual_out", "residual_dtype"),
    "add_rms_norm": (
        "offset",
        "casting_mode",
        "out_dtype",
        "out",
        "residual_out",
        "residual_dtype",
    ),
}


def call(
    op: str,
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    backend: str | None,
    options: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    """The public function ``op`` called with keyword ``options`` (a non-empty dict):
    a name ``op`` does not take raises Python's ``TypeError``, then :func:`norm`."""
    known = OPTIONS[op]
    for name in options:
        if name not in known:
            raise TypeError(f"{op}() got an unexpected keyword argument '{name}'")
    out = _front_door(op, x, residual, normalized_shape, weight, bias, eps, rms, backend, options)
    if out is not None:
        return out
    return norm(op, x, residual, normalized_shape, weight, bias, eps, rms, backend, **options)


#: the casting modes the compiled front door takes, by its numbers for them
_FRONT_DOOR_MODES = {None: 0, "gemma": 1, "llama": 2}


def _front_door(
    op: str,
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    backend: str | None,
    options: dict[str, Any],
) -> tuple[Tensor, Tensor | None] | None:
    """The call in C++ (``layernorm.compiled``'s ``norm`` with the options) when its only
    options are ``offset``, a ``casting_mode`` of None, "gemma" or "llama", ``out``,
    ``residual_out``, a narrower ``out_dtype`` (with a gradient too), a wider one
    (without a residual or casting mode: the kernels of the pair where
    :func:`_rounds_into` says so, else the input converted to it first, as :func:`norm`
    does, once: :func:`norm` goes on with it where C++ does not take the call) and
    ``memory_efficient`` alone (without a gradient the plain call, as
    :func:`layernorm.recompute.norm` makes it; with one, C++'s autograd node in the place
    of ``recompute.MemoryEfficientNorm``, the same bits): the torch operations of :func:`norm` (the gain of
    :func:`offset_gain` or :func:`cast_rms_norm`, the llama product) around the same
    kernel call, where each is one IEEE operation (an offset that is a float32 value, and
    for the one rounding and "gemma" a weight of float32 values or a float64
    computation), the kernels writing into ``out`` and ``residual_out`` where
    :func:`write_into` would (not with "llama"); a residual of another dtype than
    ``x``'s: :func:`_stream_front_door`. None for every other call, before any
    work (or with the fast paths off, ``ops.FAST_PATHS``, or under ``torch.compile``):
    :func:`norm` then runs it, or raises."""
    if not ops.FAST_PATHS or torch.compiler.is_compiling():
        return None
    if isinstance(residual, Tensor) and isinstance(x, Tensor) and residual.dtype != x.dtype:
        return _stream_front_door(x, residual, normalized_shape, weight, bias, eps, rms,
                                  backend, options)  # fmt: skip
    mode = options.get("casting_mode")
    if not (_FRONT_DOOR_OPTIONS.issuperset(options) and isinstance(x, Tensor)):
        return None
    if residual is not None and not isinstance(residual, Tensor):
        return None
    if not (mode is None or type(mode) is str) or mode not in _FRONT_DOOR_MODES:
        return None
    memory_efficient = options.get("memory_efficient", False)
    if memory_efficient is not False and (memory_efficient is not True or len(options) > 1):
        return None  # (alone: without a gradient the plain call, with one C++'s node)
    y_dtype = options.get("out_dtype")
    if y_dtype is not None and mode is not None:  # norm's ValueError
        return None
    converted = False
    if y_dtype is None or y_dtype == x.dtype or y_dtype in _NARROWER.get(x.dtype, ()):
        y_dtype = None if y_dtype == x.dtype else y_dtype
    elif (
        isinstance(y_dtype, torch.dtype)
        and y_dtype in _WIDER.get(x.dtype, ())
        and residual is None
        and mode is None
        and not torch._C._is_tracing()
    ):  # a wider one, eps by the input's rule
        eps = _op.default_eps(x.dtype) if eps is None else eps
        if not _rounds_into(x, y_dtype, residual, weight, bias, front_door=True):
            x, y_dtype, converted = x.to(y_dtype), None, True  # (exactly)
    else:
        return None
    out = _compiled.norm(
        x, residual, normalized_shape, weight, bias, eps, rms, backend,
        options.get("offset", 0.0), _FRONT_DOOR_MODES[mode], options.get("out"),
        options.get("residual_out"), y_dtype, memory_efficient,
    )  # fmt: skip
    if out is None and converted:  # (out_dtype is now x's dtype)
        return norm(op, x, residual, normalized_shape, weight, bias, eps, rms, backend, **options)
    return out


def _stream_front_door(
    x: Tensor,
    residual: Tensor,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    backend: str | None,
    options: dict[str, Any],
) -> tuple[Tensor, Tensor | None] | None:
    """:func:`residual_stream`'s call in C++ for a float32 residual of 16-bit ``x``
    (flash-attn's ``residual_in_fp32``), its only options a ``residual_dtype`` of None or
    float32 and an ``out_dtype`` of None or ``x``'s: ``compiled.fused`` without a
    dropout-add runs the same composition (``h = x + residual``, one IEEE addition, then
    the norm of ``h`` rounded into ``x``'s dtype, with a ``-0.0`` residual where a
    gradient is recorded) through the norm's front door; ``eps=None`` by ``x``'s rule,
    as here. None for every other call (:func:`norm` then runs it, or raises)."""
    rdtype, y_dtype = options.get("residual_dtype"), options.get("out_dtype")
    if not (
        _STREAM_FRONT_DOOR_OPTIONS.issuperset(options)
        and residual.dtype == torch.float32
        and rdtype in (None, torch.float32)
        and y_dtype in (None, x.dtype)
    ):
        return None
    done = _compiled.fused(
        x, normalized_shape, weight, bias, eps, rms, residual, None, None, None, 0.0, None,
        None, None, torch.float32, None, 0.0, False, backend,
    )  # fmt: skip
    return None if done is None else (done[0], done[2])


#: the options :func:`_stream_front_door` takes
_STREAM_FRONT_DOOR_OPTIONS = frozenset(("residual_dtype", "out_dtype"))

#: the options :func:`_front_door` takes
_FRONT_DOOR_OPTIONS = frozenset(
    ("offset", "casting_mode", "out", "residual_out", "out_dtype", "memory_efficient")
)


def signed(function: Callable[..., Any], names: tuple[str, ...]) -> None:
    """Gives ``function`` (one of the four, which take ``**options``) the signature it
    behaves as: ``**options`` replaced by the keyword-only ``names`` with their defaults,
    for ``inspect.signature`` and ``help``."""
    sig = inspect.signature(function)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [
        inspect.Parameter(
            n, inspect.Parameter.KEYWORD_ONLY, default=_ALL[n][0], annotation=_ALL[n][1]
        )
        for n in names
    ]
    function.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]


def norm(
    op: str,
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    backend: str | None,
    *,
    offset: float = 0.0,
    casting_mode: str | None = None,
    out_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    memory_efficient: bool = False,
    residual_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One call of ``op`` with options: the checks of every option first (before any
    work), then the composition. Returns ``(y, residual_out)`` as ``ops._norm`` does."""
    if (
        isinstance(residual, Tensor)
        and isinstance(x, Tensor)
        and (residual_dtype is not None or residual.dtype != x.dtype)
    ):
        rdtype = _residual_dtype(op, x, residual, residual_dtype)
        if rdtype != x.dtype or residual.dtype != x.dtype:
            return residual_stream(
                op, x, residual, normalized_shape, weight, bias, eps, rms, backend,
                rdtype, offset=offset, casting_mode=casting_mode, out_dtype=out_dtype,
                out=out, residual_out=residual_out,
            )  # fmt: skip
    if memory_efficient:
        if offset or casting_mode is not None or out is not None:
            raise ValueError(
                f"{op}: memory_efficient=True does not combine with offset, casting_mode or out"
            )
        if out_dtype is not None and isinstance(x, Tensor):
            if _check_out_dtype(op, x, out_dtype):
                raise ValueError(
                    f"{op}: memory_efficient=True takes an out_dtype at least as wide as "
                    f"the input's {x.dtype}, got out_dtype={out_dtype}"
                )
            eps = _op.default_eps(x.dtype) if eps is None else eps
            x = x.to(out_dtype)
        y = recompute.norm(op, x, normalized_shape, weight, bias, eps, rms, backend)
        return y, None
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: expected input to be a torch.Tensor, got {type(x).__name__}")
    offset = _check_offset(op, offset, weight)
    if casting_mode not in CASTING_MODES:
        raise ValueError(
            f"{op}: casting_mode must be one of {list(CASTING_MODES)}, got {casting_mode!r}"
        )
    narrow = False  # y rounded into a dtype narrower than the input's, by the kernels
    if out_dtype is not None:
        narrow = _check_out_dtype(op, x, out_dtype)
        if casting_mode is not None:
            raise ValueError(
                f"{op}: casting_mode={casting_mode!r} fixes the output's dtype (the input's); "
                "it does not combine with out_dtype"
            )
    if out is not None or residual_out is not None:
        _check_no_grad(op, x, residual, weight, bias)
        if out is not None:
            check_out(op, "out", out, x.dtype if out_dtype is None else out_dtype, x.device)
        if residual_out is not None:
            if residual is None:
                raise TypeError(f"{op}: residual_out= is for the fused add_* functions")
            check_out(op, "residual_out", residual_out, x.dtype, x.device)
    if eps is None:  # the input's rule, not the wider dtype's
        eps = _op.default_eps(x.dtype)
    compute = x.dtype if out_dtype is None or narrow else out_dtype

    if casting_mode is not None:
        y, h = cast_rms_norm(op, x, residual, normalized_shape, weight, eps, backend,
                             offset, casting_mode)  # fmt: skip
    else:
        gain = weight if not offset else offset_gain(weight, offset, compute)  # type: ignore[arg-type]
        # y rounded by the kernels into out_dtype (a narrower one, or a wider one of the pair)
        into = narrow or (compute != x.dtype and _rounds_into(x, compute, residual, gain, bias))
        direct = (out is not None or residual_out is not None) and (into or compute == x.dtype)
        if direct and x.numel() * x.element_size() >= WRITE_INTO_BYTES:
            written = write_into(
                op, x, residual, normalized_shape, gain, bias, eps, rms, backend,
                out_dtype if into else None, out, residual_out,
            )  # fmt: skip
            if written is not None:
                return written
        if into:
            y, h = ops._norm(op, x, residual, normalized_shape, gain, bias, eps, rms,
                             backend, out_dtype)  # type: ignore[arg-type]  # fmt: skip
        elif compute == x.dtype:
            y, h = ops._norm(op, x, residual, normalized_shape, gain, bias, eps, rms, backend)
        else:
            h = None if residual is None else residual_sum(op, x, residual)
            z = (x if h is None else h).to(compute)
            y = ops._norm(op, z, None, normalized_shape, gain, bias, eps, rms, backend)[0]
    if out is not None:
        y = store(op, "out", y, out)
    if residual_out is not None and h is not None:
        h = store(op, "residual_out", h, residual_out)
    return y, h


# ---------------------------------------------------------------------------------------
# offset


def _check_offset(op: str, offset: float, weight: Tensor | None) -> float:
    if isinstance(offset, bool) or not isinstance(offset, int | float):
        raise TypeError(f"{op}: offset must be a float, got {type(offset).__name__}")
    offset = float(offset)
    if not math.isfinite(offset):
        raise ValueError(f"{op}: offset must be finite, got offset={offset}")
    if offset and weight is None:
        raise ValueError(
            f"{op}: offset={offset} needs a weight (the gain is weight + offset); "
            "pass a weight of zeros for a constant gain"
        )
    return offset


def offset_gain(weight: Tensor, offset: float, dtype: torch.dtype) -> Tensor:
    """The gain ``weight + offset`` rounded once to the accumulation dtype of ``dtype``
    (the dtype the norm computes in).

    Where ``offset`` and every value of ``weight``'s dtype are values of the accumulation
    dtype (float32, bfloat16 and float16 weights with an offset such as ``±1.0`` for
    float32; any float weight for float64), the gain is one IEEE addition in it: the
    exact sum rounded once. Otherwise (an offset such as ``0.1`` for float32, or a float64
    weight of a float32 computation) the sum is formed in float64 and rounded once to the
    accumulation dtype: within one float64 rounding of the once-rounded sum. (For
    float32, bfloat16 and float16 weights and such offsets that float64 route gives the
    same bits as the addition: the float64 sum is exact unless the terms' exponents lie
    more than 29 apart, and then it is too far from every float32 midpoint to round
    across one: ``tests/test_options.py::test_offset_gain_is_the_exact_sum_rounded_once``.)
    Differentiable: the gradient of ``weight`` is the gain's, in ``weight``'s dtype.
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"expected weight to be a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point():
        raise TypeError(f"offset expects a floating-point weight, got {weight.dtype}")
    acc = accumulation_dtype(dtype)
    if acc == torch.float64 or (weight.dtype in _SINGLE_VALUED and _is_single(offset)):
        return (weight if weight.dtype == acc else weight.to(acc)) + offset
    return (weight.to(torch.float64) + offset).to(acc)


#: the dtypes whose every value is a float32 value
_SINGLE_VALUED = (torch.float32, torch.bfloat16, torch.float16)


def _is_single(v: float) -> bool:
    """Whether the finite float ``v`` is a float32 value: at most 24 significant bits
    at or above 2^-149, and not past float32's largest. Plain Python (tracing and export
    see a constant)."""
    m, e = math.frexp(v)  # |m| in [0.5, 1): v = m · 2^e
    if e - 1 < -126:  # float32's subnormal range: multiples of 2^-149
        return math.ldexp(v, 149).is_integer()
    return abs(v) <= _FLOAT32_MAX and math.ldexp(m, 24).is_integer()


_FLOAT32_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------------------------------
# out_dtype


def _rounds_into(
    x: Tensor,
    y_dtype: torch.dtype,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    front_door: bool = False,
) -> bool:
    """Whether ``y`` in ``y_dtype``, a dtype wider than ``x``'s, comes from the kernels of
    that pair (which round each element into it, as into a narrower one: ``ops._norm``
    with ``out_dtype``) rather than from the norm of ``x`` converted to it: the same bits
    (each element the exact value rounded once into ``y_dtype`` either way) where the two
    dtypes share their accumulation dtype (float32 from bfloat16 or float16: the same gain,
    statistics and bound), without a residual, and without a gradient (whose backward is
    the conversion's composition: ``dx`` in float32, then rounded into ``x``'s dtype) or
    a mechanism that would see the call (``front_door``: the compiled front door's call,
    which declines those itself). It saves the converted copy of the input."""
    if residual is not None or accumulation_dtype(y_dtype) != accumulation_dtype(x.dtype):
        return False
    if front_door:
        return not _op.records_gradient(x, weight, bias)
    return _no_gradient(x, weight, bias)


def _check_out_dtype(op: str, x: Tensor, out_dtype: torch.dtype) -> bool:
    """Checks ``out_dtype`` (``TypeError`` unless a floating dtype, ``ValueError`` for one
    the kernels do not write, or an input they do not take); returns whether it is
    narrower than ``x``'s dtype (it cannot hold every value of it: the kernels then round
    into it), False when it holds every value (the input is converted to it exactly)."""
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"{op}: out_dtype must be a floating torch.dtype, got {out_dtype!r}")
    if out_dtype in _WIDER.get(x.dtype, (x.dtype,)):
        return False
    if x.dtype not in _WIDER or out_dtype not in torch_.OUT_DTYPES:
        raise ValueError(
            f"{op}: out_dtype={out_dtype} from a {x.dtype} input: the output dtypes are "
            "float64, float32, bfloat16 and float16, from inputs of those dtypes"
        )
    return True


# ---------------------------------------------------------------------------------------
# residual_dtype: the residual stream in a dtype of its own


def holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether ``wide`` holds every value of ``narrow`` (both floating dtypes)."""
    return wide in _WIDER.get(narrow, (narrow,))


def _residual_dtype(
    op: str, x: Tensor, residual: Tensor, residual_dtype: torch.dtype | None
) -> torch.dtype:
    """The residual stream's dtype: ``residual_dtype``, else the residual's; checked
    (``TypeError`` for a non-floating one, ``ValueError`` unless it holds ``x``'s and the
    residual's values) after the residual's own check (a residual narrower than ``x``,
    or of another shape: ``ops.NormalizedShapeError``, as today)."""
    if not holds(residual.dtype, x.dtype) or residual.shape != x.shape:
        _check(_check_residual, op, x, residual)  # raises
    if residual_dtype is None:
        return residual.dtype
    if not isinstance(residual_dtype, torch.dtype) or not residual_dtype.is_floating_point:
        raise TypeError(
            f"{op}: residual_dtype must be a floating torch.dtype, got {residual_dtype!r}"
        )
    if not (holds(residual_dtype, x.dtype) and holds(residual_dtype, residual.dtype)):
        raise ValueError(
            f"{op}: residual_dtype={residual_dtype} must hold every value of the input "
            f"({x.dtype}) and of the residual ({residual.dtype})"
        )
    return residual_dtype


def residual_stream(
    op: str,
    x: Tensor,
    residual: Tensor,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    backend: str | None,
    rdtype: torch.dtype,
    *,
    offset: float = 0.0,
    casting_mode: str | None = None,
    out_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``add_*_norm`` with the residual stream in ``rdtype`` (float32 or float64, holding
    ``x``'s and the residual's values; :func:`_residual_dtype`):

    - ``residual_out = RN_rdtype(x + residual)``: both converted to ``rdtype`` (exactly:
      it holds their values), then one IEEE addition in ``rdtype``, which rounds their
      exact sum once. (It was formed in float64 and converted, the same bits by
      Figueroa's double-rounding theorem for addition, 53 >= 2·24 + 1, at the cost of
      three full-size float64 temporaries.)
    - ``y``: the fused op on ``residual_out`` and a residual of ``-0.0`` (``h + -0.0 = h``
      bitwise; without a gradient, ``_op.records_gradient``, the norm of ``h`` alone: the
      same bits), ``y`` rounded once into ``out_dtype`` (default: ``x``'s dtype; a narrower
      one through ``layernorm::forward_to``), with ``eps=None`` resolved by ``x``'s dtype.
      Going through the fused op keeps ``residual_out``'s gradient inside the kernel's
      one rounding: the stream's gradient ``dh = RN_rdtype(dz + d residual_out)`` is
      correctly rounded (docs/contract.md §3).
    - Gradients: ``dresidual`` is ``dh`` in the residual's dtype (exact when it is
      ``rdtype``, else rounded once from it); ``dx`` is ``dh`` rounded to ``x``'s dtype:
      two roundings of the exact value when ``x`` is narrower (as flash-attn and quack,
      whose ``dx`` is their float32 ``dresidual`` converted; docs/contract.md §3 states
      the bound).

    ``casting_mode`` does not combine with it (``ValueError``); ``residual_out=`` must
    have ``rdtype``."""
    if casting_mode is not None:
        raise ValueError(
            f"{op}: casting_mode={casting_mode!r} does not combine with a residual stream "
            f"in another dtype ({rdtype}) than the input's ({x.dtype})"
        )
    ops._check_device("residual", residual, x)
    if residual_out is not None:
        _check_no_grad(op, x, residual, weight, bias)
        check_out(op, "residual_out", residual_out, rdtype, x.device)
    if eps is None:  # the input's rule, as for out_dtype
        eps = _op.default_eps(x.dtype)
    # both exact in rdtype: one IEEE addition (promoted where it can: one operation)
    if torch.promote_types(x.dtype, residual.dtype) == rdtype:
        h = x + residual
    else:
        h = x.to(rdtype) + residual.to(rdtype)
    # without a gradient the -0.0 residual changes nothing (h + -0.0 = h): the norm of h
    # (a gradient under torch.func's transforms too: their inputs require grad there)
    zero = torch.full_like(h, -0.0) if _op.records_gradient(x, residual, weight, bias) else None
    options: dict[str, Any] = {
        "offset": offset,
        "out_dtype": x.dtype if out_dtype is None else out_dtype,
    }
    if out is not None:
        options["out"] = out
    # the norm of h in C++ where the front door takes it
    fast = _front_door(op, h, zero, normalized_shape, weight, bias, eps, rms, backend, options)
    y, stream = fast or norm(op, h, zero, normalized_shape, weight, bias, eps, rms, backend,
                             **options)  # fmt: skip
    if stream is None:
        stream = h
    if residual_out is not None:
        stream = store(op, "residual_out", stream, residual_out)
    return y, stream


def _no_gradient(*tensors: Tensor | None) -> bool:
    """Whether an eager call on ``tensors`` records no gradient of any kind and no
    mechanism sees it (``_op.unseen``, ``_op.records_gradient``)."""
    return _op.unseen(*tensors) and not _op.records_gradient(*tensors)


# ---------------------------------------------------------------------------------------
# residual sums


def residual_sum(op: str, x: Tensor, residual: Tensor) -> Tensor:
    """``x + residual`` rounded to ``x``'s dtype, as the kernels form ``residual_out``
    (the sum in the accumulation dtype, then one conversion: ``docs/contract.md`` §1),
    after the checks of the fused functions."""
    _check(_check_residual, op, x, residual)
    acc = accumulation_dtype(x.dtype)
    return (x.to(acc) + residual.to(acc)).to(x.dtype)


def _check_residual(op: str, x: Tensor, residual: Tensor) -> None:
    if not isinstance(residual, Tensor):
        raise TypeError(
            f"{op}: expected residual to be a torch.Tensor, got {type(residual).__name__}"
        )
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ops.NormalizedShapeError(
            f"{op}: residual must match input in shape and dtype, but got input "
            f"{list(x.shape)} {x.dtype} and residual {list(residual.shape)} {residual.dtype}"
        )
    ops._check_device("residual", residual, x)


def _check(check, *args) -> None:  # type: ignore[no-untyped-def]
    """``check(*args)``; under jit.trace without its TracerWarnings about shapes, which
    the check reads for the shapes that the trace records (as ``ops._norm`` does)."""
    if not torch.compiler.is_compiling() and torch._C._is_tracing():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            check(*args)
    else:
        check(*args)


# ---------------------------------------------------------------------------------------
# casting modes


def cast_rms_norm(
    op: str,
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    eps: float,
    backend: str | None,
    offset: float,
    mode: str,
) -> tuple[Tensor, Tensor | None]:
    """RMSNorm in one of Liger's casting orders (``liger_kernel/ops/rms_norm.py``), with
    ``h`` the normalized input (``x``, or the rounded ``x + residual``), ``wide`` the
    promotion of float32 and ``x``'s dtype, ``RN_t`` one rounding to dtype ``t`` and the
    arithmetic between two roundings exact:

    - ``"gemma"`` (everything in float32, then one cast): the gain
      ``g = RN_wide(RN_wide(w) + RN_wide(offset))`` (Liger's float32 addition), then
      ``y = RN_x(h · rstd · g)``: this library's one rounding with that gain.
    - ``"llama"`` (only ``rstd`` in float32; the gain multiplies the cast core):
      ``u = RN_x(h · rstd)`` (correctly rounded, the norm without a weight), the gain
      ``g = RN_p(w + RN_wide(offset))`` in ``p``, the promotion of ``w``'s dtype and
      float32, then ``y = RN_x(RN_q(u · g))`` with ``q`` the promotion of ``x``'s and
      ``p``: two roundings of the product when ``q`` is wider than ``x``'s dtype (as
      Liger's kernel stores a float32 product into a half output).
    - ``"none"`` (everything in ``x``'s dtype): ``e = RN_x(RN_32(eps))`` (Liger's float32
      scalar argument, cast),
      ``r = RN_x(1/sqrt(mean(h²) + e))`` (the mean and root in float64, then converted
      as torch converts float64: through float32 for the half types, which can round
      twice), ``u = RN_x(h · r)``, ``g = RN_p(w + RN_x(offset))`` with ``p`` the
      promotion of ``w``'s dtype and ``x``'s, ``y = RN_x(RN_q(u · g))``.

    The product ``RN_x(RN_q(u · g))`` is one ``torch.mul`` into ``u`` where no gradient
    is recorded and no mechanism sees the call (``_no_gradient``): torch computes it in
    ``q`` and converts the result into ``u``'s dtype, the same two roundings without the
    two copies.

    No weight: ``y = u`` (``"gemma"`` and ``"llama"``: the plain norm). For float64 input
    every mode computes in float64 (nothing is narrowed to float32). The float64
    references of the three are ``tests/test_options.py::reference_cast_rms_norm``.
    """
    shape = ops._normalized_shape(normalized_shape, op)
    wide = torch.promote_types(x.dtype, torch.float32)
    kernel = "rms_norm" if residual is None else "add_rms_norm"
    h: Tensor | None
    if mode == "gemma":  # one fused call: the sum and the norm with the family's gain
        gain = None if weight is None else _gain(weight, offset, wide, wide)
        return ops._norm(kernel, x, residual, shape, gain, None, eps, True, backend)
    if mode == "llama":  # the core u (and the sum) in one fused call
        u, h = ops._norm(kernel, x, residual, shape, None, None, eps, True, backend)
        scale = wide
    else:  # "none"
        h = None if residual is None else residual_sum(op, x, residual)
        z = x if h is None else h
        _check(ops._check_input, "input", z, shape, op)
        dims = tuple(range(-len(shape), 0))
        e = _scalar(eps, x.dtype)
        ms = z.to(torch.float64).square().mean(dims, keepdim=True)
        r = torch.rsqrt(ms + e).to(x.dtype)
        u = z * r
        scale = x.dtype
    if weight is None:
        return u, h
    gain = _gain(weight, offset, torch.promote_types(weight.dtype, scale), scale)
    if _no_gradient(u, gain):  # into u, a fresh tensor: no copies, the same bits
        return torch.mul(u, gain, out=u), h
    q = torch.promote_types(x.dtype, gain.dtype)
    y = (u.to(q) * gain).to(x.dtype)
    return y, h


def _gain(weight: Tensor, offset: float, dtype: torch.dtype, offset_dtype: torch.dtype) -> Tensor:
    """``RN_dtype(w + RN_offset_dtype(offset))``: the gain of a casting mode."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"expected weight to be a torch.Tensor, got {type(weight).__name__}")
    w = weight if weight.dtype == dtype else weight.to(dtype)
    if not offset:
        return w
    return w + _scalar(offset, offset_dtype)


#: (significand bits, exponent of the smallest normal)
_FORMATS = {torch.float32: (24, -126), torch.bfloat16: (8, -126), torch.float16: (11, -14)}


def _scalar(v: float, dtype: torch.dtype) -> float:
    """A Python float as Liger's kernels see it in ``dtype``: rounded to float32 (a
    scalar kernel argument), then to ``dtype`` (each to nearest-even; as torch converts
    float64 to the half types); float64 keeps it. Plain Python, so that tracing and
    export record a constant."""
    if dtype == torch.float64 or (dtype == torch.float32 and _is_single(v)):
        return v  # (1.0, say: no rounding to do)
    for fmt in (torch.float32, dtype):
        p, emin = _FORMATS[fmt]
        if v != 0 and math.isfinite(v):
            ulp = math.ldexp(1.0, max(math.frexp(v)[1] - 1, emin) - (p - 1))
            v = round(v / ulp) * ulp  # exact scaling; round() ties to even
    return v


# ---------------------------------------------------------------------------------------
# out=


def _check_no_grad(op: str, *tensors: Tensor | None) -> None:
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{op}(): functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad."
        )


def check_out(op: str, name: str, out: Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """torch's checks of a preallocated output, before any work: a tensor (``TypeError``)
    of the result's dtype and device (``RuntimeError``, torch's messages)."""
    if not isinstance(out, Tensor):
        raise TypeError(f"{op}(): argument '{name}' must be Tensor, not {type(out).__name__}")
    if out.dtype != dtype:
        raise RuntimeError(
            f"Expected {name} tensor to have dtype {_short(dtype)}, but got "
            f"{_short(out.dtype)} instead"
        )
    if out.device != device:
        raise RuntimeError(
            f"Expected {name} tensor to have device {device}, but got {out.device} instead"
        )


#: Inputs of at least this many bytes have the kernels write into ``out=`` /
#: ``residual_out=`` (:func:`write_into`); smaller ones are computed by the plain call
#: and copied (:func:`store`), which costs less there than write_into's checks and Python
#: kernel call (float32, 1 thread: (4, 64) 18.8 -> 7.4 us, (64, 1024) 49.9 -> 42.6 us;
#: at (1024, 1024) writing saves 25 %: benchmarks/RESULTS.md, "out= below 1 MiB")
WRITE_INTO_BYTES = 1 << 20


def write_into(
    op: str,
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    backend: str | None,
    out_dtype: torch.dtype | None,
    out: Tensor | None,
    residual_out: Tensor | None,
) -> tuple[Tensor, Tensor | None] | None:
    """The plain call (``y`` in ``out_dtype`` when given, narrower than ``x``'s) with the
    numba kernels writing ``y`` into ``out`` and ``residual_out`` into ``residual_out``
    (either may be None: a fresh one), instead of a result copied in by :func:`store`:
    the same kernels, so the same bits. Returns ``(y, residual_out)``, or None where it
    declines (:func:`_writable`; the caller then computes and copies): another backend,
    a mechanism that would see the call, or an output that is not contiguous, of another
    shape than ``x`` (:func:`store` resizes it), requires grad, or shares memory with an
    argument or the other output. The arguments are checked as the plain call checks
    them (``ops._call``), with its errors; the outputs' version counters are bumped, as
    an in-place write does."""
    outputs = [t for t in (out, residual_out) if t is not None]
    if not _writable(outputs, (x, residual, weight, bias)):
        return None
    shape = ops._normalized_shape(normalized_shape, op)
    ops._check_input("input", x, shape, op)
    if residual is not None:
        ops._check_input("residual", residual, shape, op)
        _check_residual(op, x, residual)
    w = None if weight is None else ops._param("weight", weight, shape, x, op)
    b = None if bias is None else ops._param("bias", bias, shape, x, op)
    eps = ops._check_eps(eps)
    name = ops._check_backend(backend)
    n = math.prod(shape)
    rows = _op.kernel_rows(x, n)
    if rows.numel() == 0 or backends.choose(rows, name or None) != "numba":
        return None
    from .backends import numba_  # loaded: choose picked it

    residual_rows = None if residual is None else _op.kernel_rows(residual, n)
    y, h, _, _ = numba_.forward(
        rows, residual_rows, w, b, eps, rms, False, out_dtype,
        None if out is None else out.view(rows.shape),
        None if residual_out is None else residual_out.view(rows.shape),
    )  # fmt: skip
    for t in outputs:
        torch.autograd.graph.increment_version(t)
    y = y.view(x.shape) if out is None else out
    if h is not None:
        h = h.view(x.shape) if residual_out is None else residual_out
    return y, h


def _writable(outputs: list[Tensor], arguments: tuple[Tensor | None, ...]) -> bool:
    """Whether :func:`write_into` may have the kernels write into ``outputs``: the fast
    paths on, no mechanism that would see the call (compile, tracing, autocast, forward
    AD, ``torch.func``, a mode or subclass: as ``ops._enter`` decides its direct call),
    and each output contiguous, of the input's shape, not requiring grad, not an
    inference tensor outside inference mode, and sharing no memory with the
    ``arguments`` (the input first) or the other output."""
    x = arguments[0]
    if not (ops.FAST_PATHS and isinstance(x, Tensor) and _op.unseen(*arguments, *outputs)):
        return False
    inference = torch.is_inference_mode_enabled()
    for i, t in enumerate(outputs):
        if not t.is_contiguous() or t.shape != x.shape or t.requires_grad:
            return False
        if t.is_inference() and not inference:  # torch refuses that write: store raises
            return False
        others = (*arguments, *outputs[i + 1 :])
        if any(a is not None and torch._C._overlaps(t, a) for a in others):
            return False
    return True


def store(op: str, name: str, result: Tensor, out: Tensor) -> Tensor:
    """``result`` written into the preallocated ``out`` (checked by :func:`check_out`), by
    torch's rules for ``out=``: one of another shape is resized to the result's (a
    0-element ``out`` silently, any other with torch's deprecation warning, as torch's
    reference implementations do: ``torch._prims_common.wrappers._maybe_resize_out``).
    The result is computed first and then copied, so ``out`` may alias the input.
    Returns ``out``."""
    check_out(op, name, out, result.dtype, result.device)
    _maybe_resize_out(out, result.shape)
    return out.copy_(result)


def _short(dtype: torch.dtype) -> str:
    """torch's scalar type name (``float``, ``c10::BFloat16``, ...) as its out= errors
    print it."""
    return {
        torch.float32: "float",
        torch.float64: "double",
        torch.float16: "c10::Half",
        torch.bfloat16: "c10::BFloat16",
    }.get(dtype, str(dtype).removeprefix("torch."))
