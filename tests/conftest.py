import random

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
