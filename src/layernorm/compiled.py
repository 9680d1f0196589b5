"""The C++ part: the op's CPU and autograd kernels, and a front door for the common call.

On small inputs a call's time is Python's, not the kernel's (each tensor attribute read
from Python costs a fraction of a microsecond, a call needs about twenty, and a Python
``autograd.Function`` or custom op costs tens of microseconds; ``benchmarks/RESULTS.md``
has the numbers). So ``_compiled.cpp``, a small torch C++ extension, registers kernels of
the op ``layernorm::forward`` / ``layernorm::backward`` (defined in :mod:`layernorm._op`)
in torch's dispatcher for CPU tensors (``docs/contract.md`` §6):

- a CPU kernel of each op, which calls the numba backend's compiled entries through their
  C addresses (:func:`layernorm.backends.numba_.entry_address`), and hands what they were
  not built for (another backend, zero-size work, strided rows, inputs of
  ``numba_.STREAM_BYTES`` or more) to the op's Python kernel; rows the kernel flags for
  the exact fallback are rewritten in Python, those rows only. A call that
  :func:`layernorm.backends._threads.lend` grants helpers to runs in spans of rows on
  the calling thread and torch's own OpenMP workers (C++ helper threads in a forked
  child, where libgomp's pool is gone), counted with the Python pool's threads, so the
  thread rules of :mod:`layernorm.backends._threads` hold;
- an AutogradCPU kernel of the forward: a C++ autograd node with the Python autograd's
  saved tensors and backward, which calls ``layernorm::backward`` through the dispatcher,
  or its CPU kernel directly when no PyTorch mechanism would see the call (the same
  rule as the front door's below).

Its ``norm`` is the front door of :mod:`layernorm.ops`: it takes the common call (plain
contiguous CPU tensors of the four kernel dtypes, an int or 1-tuple
``normalized_shape``, a float or None ``eps``, the automatic backend) when no PyTorch
mechanism would see it (functorch, dispatch and function modes, jit tracing, CPU
autocast, forward AD); with a gradient it calls the op through the dispatcher, without
one the CPU kernel's own function (without statistics). Any other call gets None and
goes through Python. The kernels are the ones the Python path calls, so the bits are the
same either way. Its ``fused`` is the front door of :func:`layernorm.fused_norm` in the
same way, for the call with dropout, ``x1`` or a rowscale: the seed drawn as Python
draws it (from the user's CPU generator, if given), the
dropout-add's numba entry (:func:`layernorm.backends.numba_.entry_address`; of the
(terms, stream) pair for a float32 stream of 16-bit ``x``) with a C++ autograd node in
``EagerDropoutAdd``'s place, the norm of ``h`` per weight set (into ``x``'s dtype). Everything C++ needs to know (the Python kernels, the exact fallback,
the eps default, the kernel signatures, ``LAYERNORM_BACKEND``) is handed to it by
:func:`_use` from its one home here in Python.

The extension is built once per machine and torch version by :func:`build` (``layernorm
build``; needs a C++ compiler and ninja, the ``build`` extra) into :func:`cache_dir`, and
loaded from there by every later process on its first call; a build whose kernel
signatures differ from the numba kernels' refuses to load. Until it is built (or where it
cannot be built, or with ``LAYERNORM_COMPILED=0``, read once per process) the op runs its
Python kernels and autograd: the same bits, slower on small inputs;
:func:`unavailable_reason` says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ._extras import progress, require

__all__ = [
    "DTYPES",
    "build",
    "cache_dir",
    "ensure",
    "library_path",
    "status",
    "unavailable_reason",
]

#: the input dtypes the extension runs, in the order of its kernel table
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SOURCE = Path(__file__).with_name("_compiled.cpp")
_FLAGS = ["-O2"]
_ENV = "LAYERNORM_COMPILED"

_extension: ModuleType | None = None
_reason: str | None = "not loaded yet: it is loaded on the first call"


def cache_dir() -> Path:
    """layernorm's cache directory (the extension, and the numba kernels' cache in its
    ``numba/`` folder): ``LAYERNORM_CACHE_DIR``, else ``$XDG_CACHE_HOME/layernorm``, else
    ``~/.cache/layernorm``; where that default cannot be created or written (a container
    running as a user without a writable home), ``layernorm-<uid>`` in the temporary
    directory. Never beside the package, which may be read-only."""
    configured = os.environ.get("LAYERNORM_CACHE_DIR")
    if configured:
        return Path(configured)
    try:
        default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layernorm"
        default.mkdir(parents=True, exist_ok=True)
        if os.access(default, os.W_OK | os.X_OK):
            return default
    except (OSError, RuntimeError):  # RuntimeError: no home directory at all
        pass
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"layernorm-{user}"


def _module_name() -> str:
    """The extension's name: a hash of everything its binary depends on (the source, the
    flags, torch's and Python's versions, the platform), so a stale build is never loaded."""
    key = hashlib.sha256(_SOURCE.read_bytes())
    for part in (*_FLAGS, torch.__version__, sys.version, platform.platform()):
        key.update(part.encode())
    return f"layernorm_compiled_{key.hexdigest()[:16]}"


def library_path() -> Path:
    """The built extension's file (it exists once :func:`build` has run here)."""
    return cache_dir() / f"{_module_name()}.so"


def unavailable_reason() -> str | None:
    """Why calls do not go through the extension (None when they do)."""
    return _reason


def _off(*args: Any) -> None:
    return None


def _load_once() -> None:
    """Loads the extension (the first time only) and puts its function, or :func:`_off`,
    in :data:`norm`'s place."""
    global norm, fused, norm_linear
    if norm is _first_call:
        module = _load()
        if module is None:
            norm = fused = norm_linear = _off
        else:
            _use(module)


def _first_call(*args: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    _load_once()
    return norm(*args)


def _first_fused_call(*args: Any) -> tuple[Any, ...] | None:
    _load_once()
    return fused(*args)


def _first_norm_linear_call(*args: Any) -> torch.Tensor | None:
    _load_once()
    return norm_linear(*args)


#: ``norm(x, residual, normalized_shape, weight, bias, eps, rms, backend)``, the
#: arguments of ``ops._norm``, or with ``offset, mode, out, residual_out, y_dtype,
#: memory_efficient`` after them (``options.call``'s options; ``mode`` 0 for no
#: casting_mode, 1 "gemma", 2 "llama"; ``y_dtype`` a narrower ``out_dtype``, or None):
#: ``(y, residual_out)`` when the extension runs the call, else None (the extension's own
#: function once it is loaded)
norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None] | None] = _first_call

#: ``fused(...)``, the arguments of :func:`layernorm.fused_norm` in its order: ``(y, y1,
#: residual_out, dropout_mask, dropout_mask1)`` when the extension runs the call (with
#: dropout or ``x1`` and none of its other options: ``_compiled.cpp`` says which), else
#: None
fused: Callable[..., tuple[Any, ...] | None] = _first_fused_call

#: ``norm_linear(x, normalized_shape, weight, bias, linear_weight, linear_bias, eps, rms,
#: backend)``, :func:`layernorm.layer_norm_linear`'s arguments after its checks: the
#: output, recorded by the extension's autograd node, when it runs the call (with a
#: gradient, plain tensors: ``_compiled.cpp`` says which), else None
norm_linear: Callable[..., torch.Tensor | None] = _first_norm_linear_call


def status() -> str:
    """One line on the compiled dispatch in this process: in use (from where), or why not.
    Loads it first if it is built."""
    _load_once()
    return f"in use ({library_path()})" if _reason is None else f"not in use: {_reason}"


def ensure(progress: bool = False) -> str:
    """Builds the extension if it is not built here (unless switched off), then
    :func:`status`; a build that fails is reported in the line, not raised."""
    line = status()
    if _extension is None and os.environ.get(_ENV) != "0" and not library_path().exists():
        try:
            build(progress=progress)
        except (RuntimeError, ImportError) as error:
            return f"not in use: {error}"
        line = status()
    return line


def build(verbose: bool = False, progress: bool = False) -> Path:
    """Builds the extension into :func:`cache_dir` (replacing any build of this same
    source and torch) and starts using it in this process. Returns its path.

    Args:
        verbose: print the compiler's commands and output. Default: ``False``.
        progress: show a bar with the time spent (a build takes ~40 s). Default: ``False``.

    Raises:
        MissingExtra: (an ImportError) without ninja: ``pip install 'layernorm[build]'``.
        RuntimeError: when it cannot be built here (no C++ compiler or ninja, a
            read-only cache directory), with the compiler's words.
    """
    require("ninja", "build", "layernorm build")
    with _elapsed("building the compiled dispatch (~40 s)", progress):
        module = _compile(verbose)
    _use(module)
    return library_path()


@contextlib.contextmanager
def _elapsed(description: str, show: bool) -> Iterator[None]:
    """A bar counting the seconds while the block runs (when ``show``)."""
    if not show:
        yield
        return
    done = threading.Event()
    with progress(desc=description, unit="s", bar_format="{desc}: {elapsed}") as bar:

        def tick() -> None:
            while not done.wait(0.5):
                bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()


def _compile(verbose: bool) -> ModuleType:
    """Compiles the extension into :func:`library_path` and imports it."""
    from torch.utils import cpp_extension

    target = library_path()
    name = target.stem
    # ninja installed by pip beside this Python is not on PATH when the environment
    # is not activated
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.environ["PATH"] = os.pathsep.join([scripts, path]) if scripts else path
        # built in a private folder, then moved into place in one step: processes that
        # build at once never see a half-written file and never wait on a lock
        with tempfile.TemporaryDirectory(dir=target.parent) as folder:
            module = cpp_extension.load(
                name,
                [str(_SOURCE)],
                extra_cflags=_FLAGS,
                build_directory=folder,
                verbose=verbose,
            )
            os.replace(Path(folder) / f"{name}.so", target)
    except (OSError, RuntimeError, ImportError) as error:
        raise RuntimeError(f"cannot build layernorm's compiled dispatch: {error}") from error
    finally:
        os.environ["PATH"] = path
    return module


def _load() -> ModuleType | None:
    """The built extension, loaded (None, with :func:`unavailable_reason` set, when it
    is switched off, not built, or cannot be loaded)."""
    global _reason
    if os.environ.get(_ENV) == "0":
        _reason = f"switched off ({_ENV}=0)"
        return None
    path = library_path()
    if not path.exists():
        _reason = f"not built here (run `layernorm build`; it would be {path})"
        return None
    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_file_location(path.stem, path, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        loader.exec_module(module)
    except ImportError as error:
        _reason = f"cannot load {path}: {error}"
        return None
    return module


def _use(module: ModuleType) -> None:
    global _extension, _reason, norm, fused, norm_linear
    from . import _op, backends, options, recompute
    from .backends import _kernel_abi, _numba_recompute, _philox, _threads, numba_
    from .backends.torch_ import accumulation_dtype

    # Everything the C++ part needs to know is handed over here, from its one home.
    # Inputs of numba_.STREAM_BYTES or more go through Python: the numba backend streams
    # their outputs or takes them from its host cache, and Python's cost is lost in the
    # kernel's there.
    module.set_up(
        {
            "tensor_type": torch.Tensor,
            "parameter_type": torch.nn.Parameter,
            "resolve": _resolve,
            "python_forward": _op._forward_impl,
            "python_backward": _op._backward_impl,
            "fix_forward": _fix_forward_rows,
            "fix_backward": _fix_backward_rows,
            "composite_backward": _op.composite_backward,
            "kernel_rows": _op.kernel_rows,
            "backend_named": backends.named_by_environment,
            "constant": _constant,
            "lend": _threads.lend,
            "give_back": _threads.give_back,
            "grain": _threads.GRAIN,
            "row_block": numba_._kernels().ROW_BLOCK,
            "max_bytes": numba_.STREAM_BYTES,
            "dropout_constants": _dropout_constants,
            "dropout_gradients": _dropout_gradients,
            "norm_of_h": _norm_of_h,
            "layer_norm_eps": _op.LAYER_NORM_EPS,
            "memory_efficient_gradients": recompute.gradients,
            "norm_linear_gradients": recompute.norm_linear_gradients,
            "recompute_block": _numba_recompute.BLOCK,
            "signatures": {name: _kernel_abi.signature(name) for name in _kernel_abi.KERNELS},
            "seed_draw_high": _philox.SEED_DRAW_HIGH,
            "default_eps": [_op.default_eps(dtype) for dtype in DTYPES],
            "dtypes": list(DTYPES),
            "acc_dtypes": [accumulation_dtype(dtype) for dtype in DTYPES],
            "narrower": [[y in options._NARROWER[x] for y in DTYPES] for x in DTYPES],
        }
    )
    if _extension is None:
        backends.on_forget(_forget)
    _extension, _reason = module, None
    norm, fused, norm_linear = module.norm, module.fused, module.norm_linear


def _constant(n: int, index: int, value: float) -> torch.Tensor:
    """``numba_._constant`` for ``DTYPES[index]``."""
    from .backends import numba_

    return numba_._constant(n, DTYPES[index], value)


def _dropout_constants(p: float) -> tuple[float, float]:
    """``(s, p32)`` of a dropout probability: :mod:`layernorm.backends._philox`'s scale
    and keep threshold."""
    from .backends import _philox

    return _philox.dropout_scale(p), _philox.threshold(p)


def _dropout_gradients(
    dh: torch.Tensor,
    rowscale: torch.Tensor | None,
    seed: int,
    p: float,
    index: int,
    has_x1: bool,
    has_residual: bool,
    stream_index: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`layernorm.fused.gradients` for ``fused``'s autograd node where it hands a
    backward back to Python (a graph of it, a mechanism): x and x1 of ``DTYPES[index]``,
    the residual of the stream's ``DTYPES[stream_index]``, the rowscale as the forward
    took it (or None), the automatic backend; ``dh`` and the gradients in the input's
    shape (the formula's rows are its last dim)."""
    from . import fused

    dtype, stream = DTYPES[index], DTYPES[stream_index]
    grads = fused.gradients(
        dh.reshape(-1, dh.shape[-1]), None if rowscale is None else rowscale.reshape(-1),
        torch.tensor(seed, dtype=torch.int64), p, "", dtype, dtype if has_x1 else None,
        stream if has_residual else None,
    )  # fmt: skip
    dx, dx1, dresidual = (None if g is None else g.reshape(dh.shape) for g in grads)
    assert dx is not None
    return dx, dx1, dresidual


def _norm_of_h(
    h: torch.Tensor,
    n: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    offset: float,
    out_dtype: torch.dtype,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused``'s norm of ``h`` with an ``offset`` or another ``out_dtype`` than x's:
    :func:`layernorm.fused._norm` (fused_norm's own, with the public functions' options),
    over the last dim ``n``, the automatic backend; ``(y, h)``, ``h`` the add's
    ``residual_out`` with ``residual``."""
    from . import fused

    return fused._norm(h, (n,), weight, bias, eps, rms, offset, out_dtype, None, residual)


def _fix_forward_rows(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    rms: bool,
    flags: torch.Tensor,
) -> None:
    """The numba backend's exact fallback for the rows of ``y`` that ``flags`` (m + 1
    bytes, as the kernel wrote them) marks: those rows only."""
    from .backends import numba_

    numba_._fix_rows(y, z, weight, bias, eps, rms, flags.numpy()[:-1])


def _fix_backward_rows(
    dx: torch.Tensor,
    dweight: torch.Tensor,
    dy: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    eps: float,
    rms: bool,
    flags: torch.Tensor,
) -> None:
    """The numba backend's exact fallback for the rows of ``dx`` that ``flags`` marks,
    and for ``dweight`` (empty when not wanted) when a row's scalars need it."""
    from .backends import numba_

    numba_._fix_backward_rows(
        dx, dweight if dweight.numel() else None, dy, z, weight, None if rms else mean,
        dresidual_out, eps, rms, flags.numpy()[:-1],
    )  # fmt: skip


def _resolve(index: int, name: str, y_index: int | None = None) -> int | None:
    """The C address of numba kernel ``name`` for ``DTYPES[index]`` (a forward's ``y`` in
    ``DTYPES[y_index]`` when given: another dtype) when numba is the automatic backend
    for CPU tensors of that dtype, else None (the extension asks once per kernel, until
    :func:`layernorm.backends.forget`)."""
    from . import backends

    dtype = DTYPES[index]
    module = backends.pick(torch.empty(0, dtype=dtype))
    if module.__name__ != backends.BACKENDS["numba"]:
        return None
    if name == "memory_efficient_backward":
        from .backends import _numba_recompute

        if dtype not in _numba_recompute.ENTRY_DTYPES:
            return None
    y_dtype = None if y_index is None else DTYPES[y_index]
    return module.entry_address(dtype, name, y_dtype)  # type: ignore[no-any-return]


def _forget() -> None:
    if _extension is not None:
        _extension.forget()
