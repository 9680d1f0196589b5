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
    from layernorm.backends import numba_

    numba_.build()  # every kernel into the on-disk cache, as `layernorm build` does
    if os.environ.get("LAYERNORM_COMPILED") == "0" or shutil.which("c++") is None:
        return
    if not compiled.library_path().exists():
        compiled.build()
    layernorm.layer_norm(torch.ones(1, 2), 2)  # loads it
    assert compiled.unavailable_reason() is None
