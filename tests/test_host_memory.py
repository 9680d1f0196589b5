"""The host cache behind large CPU outputs (layernorm.backends._host_memory)."""

from __future__ import annotations

import gc

import pytest
import torch

import layernorm
from layernorm.backends import _host_memory

MIB = 1 << 20


@pytest.fixture
def cache(monkeypatch):
    """A fresh, empty cache with a 64 MiB limit that takes requests from 1 MiB (outputs of
    earlier tests that a cycle still holds are collected first, so they cannot land in it
    mid-test)."""
    gc.collect()
    layernorm.empty_cache()
    monkeypatch.setattr(_host_memory, "_limit", 64 * MIB)
    monkeypatch.setattr(_host_memory, "MIN_BYTES", MIB)
    yield _host_memory
    layernorm.empty_cache()


def test_a_dead_output_block_is_reused(cache):
    a = cache.empty((1024, 1024), torch.float32)  # 4 MiB
    address = a.data_ptr()
    assert cache.cached_bytes() == 0
    del a
    gc.collect()
    assert cache.cached_bytes() == 4 * MIB
    b = cache.empty((1024, 1024), torch.float32)
    assert b.data_ptr() == address and cache.cached_bytes() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_blocks_start_on_a_cache_line(cache, dtype):
    tensors = [cache.empty((n, 1024), dtype) for n in (1024, 1536, 2048, 3000)]
    assert [t.data_ptr() % 64 for t in tensors] == [0, 0, 0, 0]


def test_requests_below_min_bytes_bypass_the_cache(cache):
    a = cache.empty((MIB // 4 - 1,), torch.float32)  # just under 1 MiB
    del a
    gc.collect()
    assert cache.cached_bytes() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_live_tensors_and_their_views_never_share_a_block(cache, dtype):
    # (bfloat16, which NumPy lacks, is built another way than the others: both must hold
    # their block)
    a = cache.empty((1024, 1024), dtype)
    assert a.dtype == dtype and a.shape == (1024, 1024) and a.is_contiguous()
    view = a[10:20]  # keeps the block alive after ``a`` goes
    address = a.data_ptr()
    del a
    gc.collect()
    b = cache.empty((1024, 1024), dtype)
    assert b.data_ptr() != address and view.data_ptr() == address + 10 * 1024 * dtype.itemsize
    del view
    gc.collect()
    assert cache.cached_bytes() == -(-1024 * 1024 * dtype.itemsize // (2 * MIB)) * 2 * MIB


def test_sizes_round_up_to_huge_pages_and_dtypes_share_blocks(cache):
    a = cache.empty((3 * MIB // 2,), torch.bfloat16)  # 3 MiB -> a 4 MiB block
    assert a.dtype == torch.bfloat16 and a.shape == (3 * MIB // 2,)
    address = a.data_ptr()
    del a
    gc.collect()
    assert cache.cached_bytes() == 4 * MIB
    b = cache.empty((MIB,), torch.float32)  # 4 MiB: same size class
    assert b.data_ptr() == address and b.dtype == torch.float32


def test_a_slightly_smaller_request_takes_a_larger_idle_block(cache):
    a = cache.empty((2 * MIB,), torch.float32)  # 8 MiB
    address = a.data_ptr()
    del a
    gc.collect()
    b = cache.empty((3 * MIB // 2,), torch.float32)  # 6 MiB: the 8 MiB block fits
    assert b.data_ptr() == address and b.shape == (3 * MIB // 2,)
    assert cache.cached_bytes() == 0
    del b
    gc.collect()
    assert cache.cached_bytes() == 8 * MIB  # the whole block comes back
    c = cache.empty((MIB,), torch.float32)  # 4 MiB: 8 MiB would waste too much
    assert c.data_ptr() != address and cache.cached_bytes() == 8 * MIB


def test_idle_bytes_never_exceed_the_limit(cache, monkeypatch):
    monkeypatch.setattr(_host_memory, "_limit", 6 * MIB)
    blocks = [cache.empty((MIB,), torch.float32) for _ in range(3)]  # 4 MiB each
    del blocks
    gc.collect()
    assert cache.cached_bytes() == 4 * MIB  # one kept, two released


def test_the_least_recently_freed_blocks_make_room(cache, monkeypatch):
    monkeypatch.setattr(_host_memory, "_limit", 10 * MIB)
    small = [cache.empty((MIB // 2,), torch.float32) for _ in range(4)]  # 2 MiB each
    small_addresses = {t.data_ptr() for t in small}
    del small
    gc.collect()
    assert cache.cached_bytes() == 8 * MIB
    big = cache.empty((2 * MIB,), torch.float32)  # 8 MiB, a new block
    address = big.data_ptr()
    del big  # three of the small blocks (the least recently freed) go to make room
    gc.collect()
    assert cache.cached_bytes() == 8 * MIB + 2 * MIB
    assert cache.empty((2 * MIB,), torch.float32).data_ptr() == address
    assert cache.empty((MIB // 2,), torch.float32).data_ptr() in small_addresses


def test_a_block_over_the_limit_is_not_kept(cache, monkeypatch):
    monkeypatch.setattr(_host_memory, "_limit", 2 * MIB)
    a = cache.empty((MIB,), torch.float32)  # 4 MiB
    del a
    gc.collect()
    assert cache.cached_bytes() == 0


def test_small_requests_bypass_the_cache(cache):
    a = cache.empty((16, 16), torch.float64)
    assert a.shape == (16, 16) and a.dtype == torch.float64
    del a
    gc.collect()
    assert cache.cached_bytes() == 0


def test_empty_cache_releases_everything_idle(cache):
    a = cache.empty((MIB,), torch.float32)
    del a
    gc.collect()
    assert cache.cached_bytes() > 0
    layernorm.empty_cache()
    assert cache.cached_bytes() == 0


@pytest.mark.parametrize(
    ("setting", "expected"), [("0", 0), ("1.5", 3 * MIB // 2), ("2048", 2048 * MIB)]
)
def test_limit_comes_from_the_environment(monkeypatch, setting, expected):
    monkeypatch.setattr(_host_memory, "_limit", None)
    monkeypatch.setenv("LAYERNORM_HOST_CACHE_MB", setting)
    assert _host_memory.limit() == expected


def test_zero_turns_caching_off(cache, monkeypatch):
    monkeypatch.setattr(_host_memory, "_limit", 0)
    a = cache.empty((MIB,), torch.float32)
    del a
    gc.collect()
    assert cache.cached_bytes() == 0


def test_default_limit_is_at_most_a_gibibyte(monkeypatch):
    monkeypatch.setattr(_host_memory, "_limit", None)
    monkeypatch.delenv("LAYERNORM_HOST_CACHE_MB", raising=False)
    assert 0 < _host_memory.limit() <= 1 << 30


@pytest.mark.parametrize(
    ("setting", "match"),
    [("lots", "must be a number of megabytes, got 'lots'"), ("-1", "must be >= 0, got '-1'")],
)
def test_bad_limit_settings_raise(monkeypatch, setting, match):
    monkeypatch.setattr(_host_memory, "_limit", None)
    monkeypatch.setenv("LAYERNORM_HOST_CACHE_MB", setting)
    with pytest.raises(ValueError, match=match):
        _host_memory.limit()


def test_large_layer_norm_outputs_come_from_the_cache_and_stay_correct(cache):
    pytest.importorskip("numba")
    x = torch.randn(512, 1024)  # 2 MiB outputs
    w, b = torch.randn(1024), torch.randn(1024)
    first = layernorm.layer_norm(x, 1024, w, b, backend="numba")
    expected = first.clone()
    address = first.data_ptr()
    del first
    gc.collect()
    second = layernorm.layer_norm(x * 1, 1024, w, b, backend="numba")
    assert second.data_ptr() == address  # the dead output's memory, reused
    assert torch.equal(second, expected)
    torch.testing.assert_close(
        second, torch.nn.functional.layer_norm(x, (1024,), w, b), rtol=1e-5, atol=1e-5
    )


def test_threads_never_get_the_same_live_block(cache):
    import threading

    failures = []

    def work(tag: float) -> None:
        for _ in range(50):
            t = cache.empty((MIB // 2,), torch.float32)  # 2 MiB blocks, shared cache
            t.fill_(tag)
            if not bool((t == tag).all()):
                failures.append(tag)
            del t

    threads = [threading.Thread(target=work, args=(float(k),)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert cache.cached_bytes() <= 4 * 2 * MIB
