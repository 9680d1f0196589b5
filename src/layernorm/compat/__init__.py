"""Other libraries' norm APIs on this library's kernels: replacing an import is the
whole migration (issue 23).

- :mod:`layernorm.compat.liger`: Liger-Kernel's ``LigerLayerNorm``, ``LigerRMSNorm``,
  ``LigerFusedAddRMSNorm`` and their functions (``liger_kernel.transformers``);
- :mod:`layernorm.compat.apex`: apex's ``FusedLayerNorm``, ``FusedRMSNorm``,
  ``MixedFusedLayerNorm``, ``MixedFusedRMSNorm`` and their functions
  (``apex.normalization``);
- :mod:`layernorm.compat.flash_attn`: flash-attention's ``layer_norm_fn``,
  ``rms_norm_fn``, ``RMSNorm``, ``layer_norm_linear_fn``
  (``flash_attn.ops.triton.layer_norm``), on :func:`layernorm.fused_norm`;
- :mod:`layernorm.compat.quack`: quack's ``rmsnorm`` and ``QuackRMSNorm``
  (``quack.rmsnorm``), on :func:`layernorm.fused_norm`.

Each keeps the original's constructor signature, defaults, attributes, parameters,
``state_dict`` keys, ``repr`` and return structure; the values are this library's
(``docs/contract.md`` §2 "Options"). ``import layernorm`` imports none of them.
"""
