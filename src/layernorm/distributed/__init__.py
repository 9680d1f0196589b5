"""Distributed layer normalization on ``torch.distributed``.

Two layouts of the activations:

- **Hidden dim sharded** (tensor parallelism over the normalized dim, or a DTensor
  sharded on its last dim): :func:`layer_norm` / :func:`rms_norm` and the modules
  :class:`LayerNorm` / :class:`RMSNorm` exchange per-row statistics (three floats per
  row forward, two backward) instead of gathering whole rows. The default split is
  DTensor's (:func:`shard_sizes`).
- **DTensor**: :func:`layer_norm` / :func:`rms_norm` take a DTensor; importing this
  package also registers DTensor rules for the library's custom ops, so
  ``layernorm.layer_norm`` and ``layernorm.LayerNorm`` accept DTensors (see
  :mod:`.dtensor`).
- **Rows sharded** (sequence or data parallelism): the norm is local; the gradients
  of the shared ``gamma``/``beta`` are summed with :func:`allreduce_param_grads` or
  :func:`register_grad_allreduce_hooks` (DDP and FSDP do it themselves).

Everything is a collective over a process group (``None``: the default group); results
are bitwise identical run to run for a fixed world size. Imported on demand:
``import layernorm`` does not import this package.
"""

import torch

from ._collectives import ShardMismatchError
from ._shards import shard_sizes
from .dtensor import register_op_rules
from .functional import layer_norm, rms_norm
from .modules import LayerNorm, RMSNorm, gather_state_dict, shard_state_dict
from .sequence_parallel import (
    allreduce_param_grads,
    norm_parameters,
    register_grad_allreduce_hooks,
)

if torch.distributed.is_available():
    register_op_rules()

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "ShardMismatchError",
    "allreduce_param_grads",
    "gather_state_dict",
    "layer_norm",
    "norm_parameters",
    "register_grad_allreduce_hooks",
    "rms_norm",
    "shard_sizes",
    "shard_state_dict",
]
