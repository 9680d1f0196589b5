"""The backward entry's per-call helpers (layernorm.backends._numba_kernels): the test for
"no residual gradient" and the dweight/dbias column sums, whose one-block case skips the
buffer: the same values as the general rule, element by element."""

import numpy as np
import pytest
import torch

from layernorm.backends import _numba_kernels as kernels

# the kernels' storage of each dtype (16-bit floats as their bit patterns)
STORAGE = {torch.float32: np.float32, torch.bfloat16: np.uint16, torch.float16: np.int16}


def _row(values, dtype):
    """``values`` as the kernels read a row of ``dtype``."""
    t = torch.tensor(values, dtype=torch.float32).to(dtype)
    if dtype != torch.float32:
        t = t.view(torch.int16)
    return t.numpy().view(STORAGE[dtype])


@pytest.mark.parametrize("dtype", list(STORAGE), ids=str)
@pytest.mark.parametrize("n", [1, 7, 64, 768])
def test_no_residual_is_a_row_of_negative_zeros_with_stride_0(dtype, n):
    negative = [-0.0] * n
    assert kernels._no_residual(_row(negative, dtype), 0, n)
    assert not kernels._no_residual(_row(negative, dtype), n, n)  # rows of their own
    for k in sorted({0, n // 2, n - 1}):  # one element off, anywhere
        for value in (0.0, float("nan"), 1e-30, -1.0):
            row = list(negative)
            row[k] = value
            assert not kernels._no_residual(_row(row, dtype), 0, n), (k, value)


@pytest.mark.parametrize("blocks", [1, 2, 5])
@pytest.mark.parametrize("out_dtype", [np.float32, np.float64])
def test_column_sums_add_the_blocks_by_halving(blocks, out_dtype):
    """``out`` = the blocks' partial sums added by halving (``_weight_terms``: block
    ``j < k - h`` takes ``block_j + block_{j+h}``, ``h = ceil(k/2)``, until one is left)
    in float64, rounded once into the output; one block is itself."""
    n = 9
    rng = np.random.default_rng(blocks)
    partial = rng.standard_normal((blocks, n)) * 10.0 ** rng.integers(-30, 30, (blocks, n))
    partial[0, :3] = [-0.0, 0.0, np.nan]
    out = np.empty(n, out_dtype)
    rows = list(partial.copy())
    kernels.column_sum_kernel(partial.reshape(-1), blocks, n, out)  # (rewrites partial)
    while len(rows) > 1:
        k, h = len(rows), (len(rows) + 1) // 2
        rows = [rows[j] + rows[j + h] if j < k - h else rows[j] for j in range(h)]
    expected = rows[0]
    np.testing.assert_array_equal(out.view(np.uint8), expected.astype(out_dtype).view(np.uint8))
