"""Modules: drop-in LayerNorm / RMSNorm (and, in later modules, blocks and patch())."""

from .modules import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
