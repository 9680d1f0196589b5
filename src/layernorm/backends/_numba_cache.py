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
- **Consistency** (:class:`_IndexDataCacheFile`, :func:`locked`): numba's cache keeps one
  index file per function that maps each compiled signature to a numbered data file, and
  two processes saving different signatures at once can both take number 1 (an index that
  points at another dtype's machine code: wrong results or a crash), or each write an
  index that lacks the other's entry. Here a data file is named by a digest of its index
  key (one name per signature, never shared), it is written before the index names it,
  and the index is re-read and rewritten under an exclusive ``fcntl.flock`` on
  ``.index.lock`` in the cache folder (a few milliseconds). Processes may then compile at
  once, callees included, and lose nothing.
- **No repeated work** (:func:`locked`): a compile or load of a kernel entry (``"float32
  forward_serial"``) holds an exclusive ``flock`` on that entry's own lock file, so
  processes starting together (``torchrun --nproc-per-node 8`` on a cold cache) take
  turns on it: the first compiles, the others then load what it wrote; different entries
  compile in parallel (``layernorm build`` in two processes skips to an entry nobody
  holds: :func:`locked` with ``wait=False``).
- **Saying so** (:func:`announce_compile`): the first compile in a process that finds the
  cache cold logs, once, what it is doing and how to avoid it (``layernorm build``), on
  the ``layernorm`` logger (stderr unless logging is configured).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from numba.core import caching, config

__all__ = [
    "announce_compile",
    "compiling",
    "directory",
    "enable",
    "expect_compiles",
    "location",
    "locked",
    "source_digest",
]

_log = logging.getLogger("layernorm")
_announced = False
_thread_lock = threading.Lock()
#: resolved once per process: the folder, or None when nothing is writable
_resolved: tuple[Path | None] | None = None


def source_digest(*objects: ModuleType | Callable[..., object]) -> str:
    """sha256 (16 hex digits) of the source of ``objects`` (functions, modules), for a
    kernel file to record the code it compiles in from elsewhere: numba keys a cached
    function on its own file alone, so a change there must change that file's recorded
    digest (each such file's test compares the two)."""
    return hashlib.sha256("\n".join(inspect.getsource(o) for o in objects).encode()).hexdigest()[
        :16
    ]


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


class _IndexDataCacheFile(caching.IndexDataCacheFile):
    """numba's index and data files, safe when processes save at once (module docstring,
    "Consistency")."""

    def save(self, key, data):
        data_name = "{}.{}.nbc".format(
            self._index_name.removesuffix(".nbi"),
            hashlib.sha256(repr(key).encode()).hexdigest()[:16],
        )
        self._save_data(data_name, data)  # written (atomically) before any index names it
        with _flock(Path(self._cache_path) / ".index.lock"):
            overloads = self._load_index()  # as other processes have left it
            if overloads.get(key) != data_name:
                overloads[key] = data_name
                self._save_index(overloads)


class _FunctionCache(caching.FunctionCache):
    _impl_class = _Impl

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = _IndexDataCacheFile(
            cache_path=self._cache_path,
            filename_base=self._impl.filename_base,
            source_stamp=self._impl.locator.get_source_stamp(),
        )

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
def _flock(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (created) while the block runs, released when
    it ends or the process dies. Yields True once held; with ``wait=False``, False at
    once (and nothing held) when another process holds it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def locked(what: str, wait: bool = True) -> Iterator[bool]:
    """Holds ``what`` (a kernel entry, e.g. ``"float32 forward_serial"``) for this thread
    and process: the process's thread lock, then an exclusive ``flock`` on the entry's
    lock file in the cache folder (module docstring, "No repeated work"). Yields True once
    held; with ``wait=False``, False at once when another process holds the entry. Without
    a cache folder, only the thread lock."""
    with _thread_lock:
        path = directory()
        if path is None:
            yield True
            return
        with _flock(path / f".lock.{re.sub(r'[^A-Za-z0-9_.-]+', '-', what)}", wait) as held:
            yield held


def announce_compile(what: str) -> None:
    """Logs, the first time in this process, that ``what`` is being compiled."""
    global _announced
    if _announced:
        return
    _announced = True
    _log.warning(
        "layernorm: compiling the numba kernels for %s (half a minute for a forward, once per "
        "machine; %s). `layernorm build` compiles every dtype's plain entries and the fused "
        "dropout's ahead of time (most out_dtype pairs' compile on first use).",
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
