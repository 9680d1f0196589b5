"""Where the numba kernels are cached on disk, and how processes share that cache safely.

Imported with the kernels (never by ``import layernorm``). Three rules, each written once:

- **Location** (:func:`directory`): ``NUMBA_CACHE_DIR`` when numba reads one (the user's
  choice for all of numba), else ``numba/`` in layernorm's own cache directory
  (:func:`layernorm.compiled.cache_dir`: ``LAYERNORM_CACHE_DIR``, ``~/.cache/layernorm``,
  or a per-user folder in the temporary directory where the home is not writable). Never
  beside the package, which may be read-only (an image run as another user). Where no
  folder can be written at all, the kernels are compiled in memory in each process
  (:func:`location` says so). Nothing in the process's environment or in numba's
  settings is changed to do this: only the kernels' own functions get this locator.
- **Consistency** (:func:`locked`): numba's cache keeps one index file per function that
  maps each compiled signature to a numbered data file, and two processes compiling
  different signatures at once can both take number 1 (an index that points at another
  dtype's machine code: wrong results or a crash). Every compile or load of a kernel entry
  holds an exclusive ``fcntl.flock`` on ``.lock`` in the cache folder (and a thread lock
  in the process), so processes starting together (``torchrun --nproc-per-node 8`` on a
  cold cache) take turns: the first compiles, the others then load what it wrote.
- **Saying so** (:func:`announce_compile`): the first compile in a process that finds the
  cache cold logs, once, what it is doing and how to avoid it (``layernorm build``), on
  the ``layernorm`` logger (stderr unless logging is configured).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from numba.core import caching, config

__all__ = [
    "announce_compile",
    "compiling",
    "directory",
    "enable",
    "expect_compiles",
    "location",
    "locked",
]

_log = logging.getLogger("layernorm")
_announced = False
_thread_lock = threading.Lock()
#: resolved once per process: the folder, or None when nothing is writable
_resolved: tuple[Path | None] | None = None


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def directory() -> Path | None:
    """The folder the kernels are cached in (created), or None when none is writable."""
    global _resolved
    if _resolved is None:
        # absolute: benchmarks/kernel_ab.py imports a copy of this file outside the package
        from layernorm.compiled import cache_dir

        configured = config.CACHE_DIR  # type: ignore[attr-defined]  # NUMBA_CACHE_DIR, read at import
        path = Path(configured) if configured else cache_dir() / "numba"
        _resolved = (path if _writable(path) else None,)
    return _resolved[0]


def location() -> str:
    """Where the kernels are cached (``cached in <folder>``), or why they are not."""
    path = directory()
    if path is not None:
        return f"cached in {path}"
    from layernorm.compiled import cache_dir

    wanted = config.CACHE_DIR or cache_dir() / "numba"  # type: ignore[attr-defined]
    return f"not cached: {wanted} is not writable (each process compiles them in memory)"


class _Locator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """numba's user-provided-directory locator, on :func:`directory`."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        base = directory()
        assert base is not None
        self._cache_path = str(base / self.get_suitable_cache_subpath(py_file))

    def get_cache_path(self):
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        if directory() is None:
            return None
        return super().from_function(py_func, py_file)


class _Impl(caching.CompileResultCacheImpl):
    _locator_classes = [_Locator]  # noqa: RUF012 (numba reads this class attribute)


class _FunctionCache(caching.FunctionCache):
    _impl_class = _Impl

    def load_overload(self, sig, target_context):
        # numba's own load_overload first refreshes the target context: it imports and
        # registers every implementation numba has (and SciPy's BLAS, if installed),
        # about a second, which loading compiled code does not need. A compile after a
        # miss refreshes the context itself. The loaded code does need numba's runtime
        # (NRT: reference counts, allocation), which the refresh would have started.
        from numba.core.runtime import rtsys

        rtsys.initialize(target_context)
        result = self._load_overload(sig, target_context)
        if result is None and _compiling is not None:
            announce_compile(_compiling)
        return result


#: what :func:`compiling` is loading or compiling now (under :func:`locked`)
_compiling: str | None = None


@contextlib.contextmanager
def compiling(what: str) -> Iterator[None]:
    """Loads or compiles ``what`` (an entry, e.g. ``"float32 forward_serial"``) in the
    block: a cache miss (or no cache at all) then announces the compile
    (:func:`announce_compile`). Call it under :func:`locked`."""
    global _compiling
    if directory() is None:
        announce_compile(what)
    _compiling = what
    try:
        yield
    finally:
        _compiling = None


def enable(dispatcher) -> bool:
    """Gives ``dispatcher`` (compiled with ``cache=False``) the on-disk cache in
    :func:`directory`; False (it stays in memory) when there is no writable one."""
    try:
        dispatcher._cache = _FunctionCache(dispatcher.py_func)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return False
    return True


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Holds the cache for this thread and process: a thread lock, then an exclusive
    ``flock`` on the cache folder's ``.lock`` (released when the block ends, or when the
    process dies). Without a cache folder, only the thread lock."""
    with _thread_lock:
        path = directory()
        if path is None:
            yield
            return
        import fcntl

        fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


def announce_compile(what: str) -> None:
    """Logs, the first time in this process, that ``what`` is being compiled."""
    global _announced
    if _announced:
        return
    _announced = True
    _log.warning(
        "layernorm: compiling the numba kernels for %s (a few seconds each, once per "
        "machine; %s). `layernorm build` compiles them all ahead of time.",
        what,
        location(),
    )


def expect_compiles() -> None:
    """No announcement in this process: its compiles are asked for (``layernorm build``)."""
    global _announced
    _announced = True


def _after_fork_in_child() -> None:
    global _thread_lock
    _thread_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)
