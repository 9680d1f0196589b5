"""The numba kernels' on-disk cache shared by processes that save at once
(``layernorm.backends._numba_cache``: "Consistency", "No repeated work")."""

from __future__ import annotations

import inspect
import multiprocessing
import os
import threading

import pytest

pytest.importorskip("numba")

from numba.core import caching

from layernorm.backends import _numba_cache


def _interleaved(folder, cls) -> dict:
    """Two processes' saves of one function's signatures, the second run while the first
    is between reading the index and writing it back (a second at most: it may instead
    wait on a lock), as processes compiling at once interleave; what a later read of the
    index finds for each signature."""
    caches = [
        cls(cache_path=str(folder), filename_base="kernel-1.py311", source_stamp=(1.0, 2))
        for _ in range(2)
    ]
    first, second = caches
    write_index = first._save_index
    other = threading.Thread(target=second.save, args=("b", {"code": "b"}))

    def save_index(overloads):
        other.start()
        other.join(1.0)
        write_index(overloads)

    first._save_index = save_index
    first.save("a", {"code": "a"})
    other.join(60)
    reader = cls(cache_path=str(folder), filename_base="kernel-1.py311", source_stamp=(1.0, 2))
    return {key: reader.load(key) for key in ("a", "b")}


def test_processes_saving_signatures_at_once_lose_none_and_mix_none(tmp_path):
    """Every signature saved is in the index afterwards and names its own machine code:
    data files are named by their key, and the index is rewritten under a lock from what
    is on disk then."""
    found = _interleaved(tmp_path, _numba_cache._IndexDataCacheFile)
    assert found == {"a": {"code": "a"}, "b": {"code": "b"}}
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".nbc"]) == 2
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]


def test_numbas_own_numbering_does_lose_or_mix_them(tmp_path):
    """The failure the class above exists for, on numba's own class: the second save
    takes the same data file number and its index entry is lost. (If a numba release
    fixes this, this test says so and the override can go.)"""
    found = _interleaved(tmp_path, caching.IndexDataCacheFile)
    assert found != {"a": {"code": "a"}, "b": {"code": "b"}}


def test_an_entry_held_by_another_process_is_skipped_without_waiting(tmp_path, monkeypatch):
    """``locked(what, wait=False)`` yields False at once while another process holds
    ``what`` (``layernorm build`` then moves on to another entry), and True for any other
    entry; a process that holds it dies and the entry is free again."""
    monkeypatch.setattr(_numba_cache, "_resolved", (tmp_path,))
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with _numba_cache.locked("float32 forward_serial", wait=False) as held:
            assert held is False
        with _numba_cache.locked("float32 backward_serial", wait=False) as held:
            assert held is True
    finally:
        release.set()
        holder.join(60)
    with _numba_cache.locked("float32 forward_serial", wait=False) as held:
        assert held is True


def _hold(folder, ready, release) -> None:
    from pathlib import Path

    _numba_cache._resolved = (Path(folder),)
    with _numba_cache.locked("float32 forward_serial") as held:
        assert held
        ready.set()
        release.wait(60)
    os._exit(0)


def test_build_in_several_processes_starts_helpers_that_build_beside_it(monkeypatch):
    """``numba_.build(3)`` starts two helper processes running ``numba_.build()`` on the
    same package and cache (here the session's, already complete: they load every entry
    and exit cleanly) and returns after them; at most one process per dtype in all."""
    import subprocess

    from layernorm.backends import numba_

    started = []
    popen = subprocess.Popen

    def recording(args, **kwargs):
        started.append(popen(args, **kwargs))
        started[-1].kwargs_env = kwargs["env"]
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recording)
    monkeypatch.setenv("LAYERNORM_CACHE_DIR", "/nonexistent/file/cache")  # (resolved already)
    lines = numba_.build(3)
    assert [line.split()[0] for line in lines] == ["float16", "bfloat16", "float32", "float64"]
    assert len(started) == 2
    assert all(helper.returncode == 0 for helper in started)  # waited for, and succeeded
    assert "numba_.build()" in started[0].args[-1]
    # the helpers fill this process's folder, even where the environment now says
    # otherwise (tests/test_compiled.py::test_cli_build points it at a file)
    assert started[0].kwargs_env["NUMBA_CACHE_DIR"] == str(_numba_cache.directory())
    started.clear()
    numba_.build(9)
    assert len(started) == 3  # four dtypes: four processes in all
    assert 1 <= numba_.build_processes() <= 4


def test_each_entry_names_the_kernel_it_compiles():
    """The entry locks are per compiled kernel (``_numba_kernels.COMPILES``): every entry
    has one, and each entry's function calls the kernel named for it."""
    from layernorm.backends import _numba_kernels, numba_

    assert set(_numba_kernels.COMPILES) == {*numba_.ENTRIES, "column_sums"}
    for name, kernel in _numba_kernels.COMPILES.items():
        body = inspect.getsource(getattr(_numba_kernels, name).py_func)
        assert f"{kernel}(" in body, (name, kernel)
