"""The numba kernels' threads: one call's rows in spans, over a small pool of Python threads.

The kernel entries release the GIL, and a call's rows can be split anywhere on a
``ROW_BLOCK`` boundary without changing a bit (rows are independent in the forward, and
the backward's dweight/dbias partial sums belong to fixed blocks of rows that are added in
a fixed order afterwards). So :func:`run` hands consecutive spans of a call's blocks to the
calling thread and to helper threads, which take the next span as they finish (a few
spans per thread, so a core that other work slows down does not hold up the call).

- **How many threads**: ``torch.get_num_threads()`` at call time, the calling thread
  included, so ``torch.set_num_threads`` and ``OMP_NUM_THREADS`` tune these kernels too;
  and at least :data:`GRAIN` elements per thread.
- **Never oversubscribed**: all calls of the process together run at most one kernel
  thread per CPU the process may use (``os.sched_getaffinity``): a call borrows helpers
  only while CPUs are free of kernel threads, so Python threads calling at once run one
  kernel thread each (plus what is left), not ``threads × torch.get_num_threads()``.
- **Nothing global changes**: no OpenMP runtime or numba threading layer of our own is
  started, and torch's thread settings and the environment are left as they are.
- **torch's workers**: the compiled front door (``layernorm._compiled``) runs its threaded
  calls on torch's own OpenMP workers, the threads torch's kernels run on (in a forked
  child, on C++ helper threads of its own: libgomp's pool does not survive a fork; a
  Python thread costs tens of microseconds to hand work to), but asks this pool for them
  (:func:`lend`, :func:`give_back`), so the two count as one pool and the rules above
  hold for both.
- **Fork**: threads do not survive ``fork``. The child gets a fresh, empty pool
  (``os.register_at_fork``) and starts helpers on its first large call, so forked
  workers (``multiprocessing``, DataLoader workers, ``gunicorn --preload``) compute as the
  parent does. The compiled front door turns to C++ helpers there (``pthread_atfork``).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable

import torch

__all__ = ["GRAIN", "cpus", "give_back", "lend", "run"]

#: a helper thread is only worth waking for at least this many elements of work
GRAIN = 1 << 15
#: spans per thread taking part in a call
_SPANS_PER_THREAD = 4


def cpus() -> int:
    """How many CPUs this process may run on: the most kernel threads at once."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class _Pool:
    """Helper threads, and how many CPUs the process's kernel threads occupy now."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cpus = cpus()
        self.running = 0  # kernel threads of threaded calls now: callers and helpers
        self.lent = 0  # helpers lent to calls now
        self.started = 0  # helper threads alive
        self.tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def borrow(self, wanted: int, start: bool = True) -> int:
        """Counts the calling thread in and lends it up to ``wanted`` helpers (as many as
        free CPUs allow); returns how many. ``start``: start the Python helper threads
        they need (False: the caller runs its spans on threads of its own)."""
        with self.lock:
            lent = max(0, min(wanted, self.cpus - self.running - 1))
            self.running += 1 + lent
            self.lent += lent
            while start and self.started < self.lent:
                threading.Thread(target=self._serve, name="layernorm-kernel", daemon=True).start()
                self.started += 1
        return lent

    def give_back(self, lent: int) -> None:
        with self.lock:
            self.running -= 1 + lent
            self.lent -= lent

    def _serve(self) -> None:
        tasks = self.tasks
        while True:
            tasks.get()()


_pool = _Pool()


def _after_fork_in_child() -> None:
    global _pool
    _pool = _Pool()  # the parent's helpers (and any lock they held) are not here


os.register_at_fork(after_in_child=_after_fork_in_child)


def _wanted(blocks: int, block_numel: int) -> int:
    """Helpers a call of ``blocks`` blocks of ``block_numel`` elements wants: up to
    ``torch.get_num_threads() - 1``, one per :data:`GRAIN` of work beyond the first."""
    return min(torch.get_num_threads(), blocks, blocks * block_numel // GRAIN) - 1


def _ranges(blocks: int, lent: int) -> list[tuple[int, int]]:
    """The spans of a call that ``lent`` helpers and the caller share: consecutive ranges
    of blocks covering ``range(blocks)`` once, a few per thread."""
    spans = min(blocks, _SPANS_PER_THREAD * (lent + 1))
    return [(i * blocks // spans, (i + 1) * blocks // spans) for i in range(spans)]


def _lend(blocks: int, block_numel: int, start: bool) -> tuple[int, list[tuple[int, int]]]:
    """:func:`lend`'s answer; ``start``: start the Python helpers lent (for :func:`run`)."""
    wanted = _wanted(blocks, block_numel)
    pool = _pool
    lent = pool.borrow(wanted, start) if wanted > 0 else 0
    if lent == 0:
        if wanted > 0:
            pool.give_back(0)
        return 0, []
    return lent, _ranges(blocks, lent)


def lend(blocks: int, block_numel: int) -> tuple[int, list[tuple[int, int]]]:
    """For a compiled caller with threads of its own (``layernorm._compiled``): how many
    helpers may run a call of ``blocks`` blocks of ``block_numel`` elements with the
    calling thread, counted in this pool (so all kernel threads of the process together
    stay within its CPUs), and the spans to split it into, as :func:`run` would. With no
    helper lent, ``(0, [])``, and nothing is owed; else the caller calls
    :func:`give_back` with the count once its spans have all returned."""
    return _lend(blocks, block_numel, start=False)


def give_back(lent: int) -> None:
    """Ends a call that :func:`lend` lent ``lent`` helpers."""
    _pool.give_back(lent)


def run(span: Callable[[int, int], None], blocks: int, block_numel: int) -> None:
    """Calls ``span(start, stop)`` for consecutive ranges of blocks that together cover
    ``range(blocks)`` exactly once (each block of ``block_numel`` elements), from the
    calling thread and from up to ``torch.get_num_threads() - 1`` helper threads; returns
    when all have returned (an exception in any is raised here, after all have ended).
    ``span`` must give the same results for any split (see the module's notes)."""
    lent, ranges = _lend(blocks, block_numel, start=True)
    if lent == 0:
        span(0, blocks)
        return
    pool = _pool
    taken = itertools.count()  # next() is atomic: each span goes to one thread

    def work() -> None:
        while (i := next(taken)) < len(ranges):
            span(*ranges[i])

    done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

    def helper() -> None:
        try:
            work()
        except BaseException as error:
            done.put(error)
        else:
            done.put(None)

    errors: list[BaseException] = []
    try:
        for _ in range(lent):
            pool.tasks.put(helper)
        work()
    finally:
        for _ in range(lent):  # the outputs must outlive every helper's writes
            error = done.get()
            if error is not None:
                errors.append(error)
        pool.give_back(lent)
    if errors:
        raise errors[0]
