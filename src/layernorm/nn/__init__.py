"""Modules: drop-in LayerNorm / RMSNorm, Transformer and LSTM blocks built on them, and patch()."""

from .blocks import (
    FeedForward,
    SelfAttention,
    SequenceTransformer,
    TokenBatchNorm,
    TransformerBlock,
    TransformerStack,
    make_norm,
)
from .lstm import LayerNormLSTM, LayerNormLSTMCell
from .modules import LayerNorm, RMSNorm
from .patch import patch, unpatch

__all__ = [
    "FeedForward",
    "LayerNorm",
    "LayerNormLSTM",
    "LayerNormLSTMCell",
    "RMSNorm",
    "SelfAttention",
    "SequenceTransformer",
    "TokenBatchNorm",
    "TransformerBlock",
    "TransformerStack",
    "make_norm",
    "patch",
    "unpatch",
]
