"""layernorm: exact, fast and inspectable layer normalization and RMSNorm.

Public API (docs/contract.md §2)::

    layer_norm, rms_norm, add_layer_norm, add_rms_norm     functions on torch tensors
    layer_norm_linear                                       norm then F.linear, the norm's
                                                            output recomputed in the backward
    fused_norm, FusedNorm                                   dropout, rowscale, x1, residual
                                                            add and norm (flash-attn's block)
    LayerNorm, RMSNorm                                      drop-ins for torch's modules
    available_backends()                                    kernel backends usable here
    empty_cache()                                           release cached CPU output memory
    patch(model), unpatch(model)                            put our modules into a model
    reference                                               the NumPy float64 math
    NormalizedShapeError                                    shape mismatches (a RuntimeError
                                                            and a ValueError)
"""

from . import reference
from .backends import available_backends
from .backends._host_memory import empty_cache
from .fused import FusedNorm, fused_norm
from .nn import LayerNorm, RMSNorm, patch, unpatch
from .ops import NormalizedShapeError, add_layer_norm, add_rms_norm, layer_norm, rms_norm
from .recompute import layer_norm_linear

__all__ = [
    "FusedNorm",
    "LayerNorm",
    "NormalizedShapeError",
    "RMSNorm",
    "add_layer_norm",
    "add_rms_norm",
    "available_backends",
    "empty_cache",
    "fused_norm",
    "layer_norm",
    "layer_norm_linear",
    "patch",
    "reference",
    "rms_norm",
    "unpatch",
]
__version__ = "0.1.0"
