"""Importing triton for its interpreter, for the test files that run the triton backend
on CPU tensors."""

import importlib.util
import os
import sys

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def import_for_the_interpreter() -> None:
    """Imports triton with ``TRITON_INTERPRET=1`` set for that import alone, when there is
    no GPU and triton is not imported yet: triton's own @jit helpers (``tl.sum``, ...) run
    in its interpreter only when the variable is set as triton is first imported."""
    if not HAS_TRITON or "triton" in sys.modules or torch.cuda.is_available():
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
