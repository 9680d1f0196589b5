import os
import random
import shutil

import numpy as np
import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _compiled_dispatch():
    """The suite runs as users run after ``layernorm build``: every numba kernel in the
    on-disk cache (so the test command leaves later processes warm), the compiled dispatch
    built and in use (tests/test_compiled.py compares it with the Python path). Without a
    C++ compiler, or with LAYERNORM_COMPILED=0, everything runs through Python."""
    import layernorm
    from layernorm import compiled
    from layernorm.backends import _numba_cache, numba_

    cxx = os.environ.get("LAYERNORM_COMPILED") != "0" and shutil.which("c++") is not None
    lock = compiled.cache_dir() / ".test-build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    # xdist's workers share the set-up: one builds the C++ part while the others start
    # on the numba kernels (numba_.build() spreads those over every worker)
    with _numba_cache._flock(lock, wait=False) as mine:
        if cxx and mine and not compiled.library_path().exists():
            compiled.build()
    numba_.build()  # every kernel into the on-disk cache, as `layernorm build` does
    if not cxx:
        return
    with _numba_cache._flock(lock):
        if not compiled.library_path().exists():
            compiled.build()
    layernorm.layer_norm(torch.ones(1, 2), 2)  # loads it
    assert compiled.unavailable_reason() is None
