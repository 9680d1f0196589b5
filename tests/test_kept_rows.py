"""The float32 output's cheap pass from the statistics pass's ``d = z - m1``
(``_numba_kernels._keeps``): software-pipelined rows of at most ``KEPT_N`` elements,
without streaming stores, store each ``d`` (RMSNorm: ``z`` widened) into a float64
scratch row while summing, and the cheap pass loads it instead of widening ``z`` and
subtracting ``m1`` again: the same IEEE operation on the same operands, so the same bits.

- The intrinsics: ``row_sums_centered_kept`` and ``row_sum_sq_kept`` give
  ``row_sums_centered``'s and ``row_sum_sq``'s sums bit for bit and store NumPy's
  ``z - m1`` (``z``); ``normalize_row_fast_centered`` on that row stores what
  ``normalize_row_fast`` stores from ``z`` and returns the same, for every output dtype.
- Through the public functions, every element the oracle's: pipelined rows around
  ``KEPT_N`` (kept and not; two scratch rows, alternating, an odd number of rows), the
  batched short rows next to them (which keep none), with the fused residual, with
  streaming stores (which keep none), and a NaN row and a constant row among them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import _oracle
import layernorm

pytest.importorskip("numba")

from numba import njit

from layernorm.backends import _numba_kernels as kernels
from layernorm.backends import _numba_vectors as vectors
from layernorm.backends import numba_


@njit(cache=False)
def _sums(z, m1, kept):
    plain = vectors.row_sums_centered(z, m1, 0.0)
    again = vectors.row_sums_centered_kept(z, m1, 0.0, kept)
    return plain, again


@njit(cache=False)
def _squares(z, kept):
    return vectors.row_sum_sq(z, 0.0), vectors.row_sum_sq_kept(z, 0.0, kept)


@njit(cache=False)
def _passes(z, d, y, y_kept, m1, delta, rstd, shift, w, b, bound_a, bound_b, tiny):
    plain = vectors.normalize_row_fast(z, y, m1, delta, rstd, shift, w, b, bound_a, bound_b, tiny)
    kept = vectors.normalize_row_fast_centered(
        d, y_kept, m1, delta, rstd, shift, w, b, bound_a, bound_b, tiny
    )  # fmt: skip
    return plain, kept


@pytest.mark.parametrize("n", [1, 15, 16, 100, 4096, 4097, 9000])
def test_the_kept_sums_are_the_sums_and_keep_d(n):
    rng = np.random.default_rng(n)
    z = (rng.standard_normal(n) * 3 + 1e3).astype(np.float32)
    m1 = np.float64(z[0])
    kept = np.full(n, np.nan)
    plain, again = _sums(z, m1, kept)
    assert np.array_equal(np.array(plain), np.array(again))
    assert np.array_equal(kept.view(np.int64), (z.astype(np.float64) - m1).view(np.int64))
    kept[:] = np.nan
    plain, again = _squares(z, kept)
    assert plain == again
    assert np.array_equal(kept.view(np.int64), z.astype(np.float64).view(np.int64))


_Y_DTYPES = [np.float32, np.int16, np.uint16, np.float64]


@pytest.mark.parametrize("y_dtype", _Y_DTYPES, ids=["float32", "float16", "bfloat16", "float64"])
def test_the_centered_pass_is_the_pass(y_dtype):
    """From ``d`` or from ``z``: the same stored bits and the same return, for constants
    that decide most elements and for ones that leave many open (a large bound)."""
    rng = np.random.default_rng(3)
    n = 203  # vectors and a scalar tail
    z = (rng.standard_normal(n) + 7.0).astype(np.float32)
    z[5] = np.nan
    w, b = rng.standard_normal(n), rng.standard_normal(n)
    m1 = np.float64(z[0])
    d = z.astype(np.float64) - m1
    delta, rstd = np.float64(d[np.isfinite(d)].mean()), 0.75
    shift = -(delta * rstd)
    for bound_a, bound_b, tiny in ((1e-30, 2.0**-40, 2.0**-126), (1e-3, 2.0**-30, 0.5)):
        y, y_kept = np.zeros(n, y_dtype), np.ones(n, y_dtype)
        results = _passes(z, d, y, y_kept, m1, delta, rstd, shift, w, b, bound_a, bound_b, tiny)
        assert results[0] == results[1]
        assert np.array_equal(y.view(np.uint8), y_kept.view(np.uint8))


def _check_rows(x, w, b, rms, residual=None):
    """The numba forward of the float32 rows ``x`` (plus ``residual``), every element the
    oracle's correct rounding (a NaN row NaN)."""
    n = x.shape[1]
    z = x
    if residual is not None and rms:
        y, z = layernorm.add_rms_norm(x, residual, (n,), w, eps=1e-5, backend="numba")
    elif residual is not None:
        y, z = layernorm.add_layer_norm(x, residual, (n,), w, b, eps=1e-5, backend="numba")
    elif rms:
        y = layernorm.rms_norm(x, (n,), w, eps=1e-5, backend="numba")
    else:
        y = layernorm.layer_norm(x, (n,), w, b, eps=1e-5, backend="numba")
    _oracle.assert_float32_rows_exact(y, z, w, None if rms else b, 1e-5, rms)


@pytest.fixture
def one_thread():
    """One thread: a call is one span of rows (with threads, ``numba_`` splits it into a
    few spans a thread, and spans of at most ``BATCHED_NUMEL`` elements take the batched
    rows, which keep no ``d``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g) * 2 + torch.randn(m, 1, generator=g) * 100
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return x, w, b


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize(
    ("m", "n"),
    [
        (19, 64),  # batched: two batches of 8 and one of 3
        (256, kernels.KEPT_N),  # batched: the span's limit, BATCHED_NUMEL elements
        (257, kernels.KEPT_N),  # pipelined, the widest kept row: scratch rows 0, 1, 0...
        (3, kernels.KEPT_N + 1),  # pipelined, the narrowest row without
        (1000, 263),  # pipelined, the narrowest kept row past the batches
    ],
)
def test_rows_are_correctly_rounded_around_the_kept_widths(m, n, rms, one_thread):
    assert kernels.BATCHED_NUMEL == 256 * kernels.KEPT_N  # (the cases' batched limit)
    x, w, b = _rows(m, n, m * n)
    x[1] = 3.0  # a constant row (RMSNorm: all equal)
    _check_rows(x, w, b, rms)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_kept_rows_with_a_residual_and_a_nan_row(rms, one_thread):
    """``d`` of ``z = x + residual`` (the row written first), a NaN row in between."""
    for m, n in ((10, 200), (300, 900)):  # batched; pipelined
        x, w, b = _rows(m, n, n)
        residual = torch.randn(m, n, generator=torch.Generator().manual_seed(1))
        x[2, 7] = float("nan")
        _check_rows(x, w, b, rms, residual)


def test_which_rows_keep_d():
    keeps = kernels._keeps
    assert keeps(True, kernels.KEPT_N, False) and keeps(True, 1, False)
    assert not keeps(True, kernels.KEPT_N + 1, False)
    assert not keeps(True, 8, True) and not keeps(False, 8, False)
    assert kernels.KEPT_N <= kernels.SEGMENT  # a kept row is one segment


def test_streamed_rows_of_kept_widths(monkeypatch, one_thread):
    """Every output streamed (which keeps no ``d``; the rows' unaligned heads plainly):
    the oracle's bits."""
    monkeypatch.setattr(numba_, "STREAM_BYTES", 0)
    x, w, b = _rows(300, kernels.KEPT_N + 1, 8)
    _check_rows(x[:, 1:], w[1:], b[1:], False)  # rows not aligned to 32 bytes
    _check_rows(x[:, 1:], w[1:], b[1:], True)
