"""The exact oracle lives in the package (layernorm.report.oracle) so that the report can
use it; tests import it as ``_oracle``. A package rather than tests/_oracle.py, so that git
sees that file as renamed and carries edits of it over to the new path."""

import torch

from layernorm.report.oracle import *  # noqa: F403


def exact_outputs(z, w, b, eps, rms):
    """The exact real outputs of ``docs/contract.md`` §1 of one row (mpmath at the
    caller's precision, ``mpmath.mp.dps``), for the tests that bound a kernel's
    intermediate values rather than its rounded outputs."""
    import mpmath

    zs = [mpmath.mpf(float(v)) for v in z]
    n = len(zs)
    mean = mpmath.mpf(0) if rms else mpmath.fsum(zs) / n
    q = mpmath.fsum((v - mean) ** 2 for v in zs) / n
    rstd = 1 / mpmath.sqrt(q + mpmath.mpf(eps))
    return [(v - mean) * rstd * mpmath.mpf(float(wv)) + mpmath.mpf(float(bv))
            for v, wv, bv in zip(zs, w, b, strict=True)]  # fmt: skip


def assert_float32_rows_exact(y, z, w, b, eps, rms):
    """Each row of the float32 output ``y`` (M, N) is the oracle's correctly rounded
    output of the matching row of ``z`` (the normalized input, as a tensor), ``w`` and
    ``b`` (``None`` for RMSNorm), bit for bit (a zero's sign aside: the oracle leaves it
    open); a row holding a NaN is all NaN."""
    import numpy as np

    beta = np.zeros(y.shape[1]) if b is None else b.double().numpy()
    got = y.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    for i, row in enumerate(z.double().numpy()):
        if np.isnan(row).any():
            assert y[i].isnan().all(), i
            continue
        want, zero = forward(row, w.double().numpy(), beta, eps, rms, "float32")  # noqa: F405
        assert np.array_equal(got[i][~zero], want[~zero]), i
