"""The tooling around the library: the HTML report, the benchmarks and the experiments.

Installed with the library but loaded only by the ``layernorm`` command's ``report``,
``bench``, ``model-bench`` and ``experiment`` subcommands (and by the tests):
``import layernorm`` and the four functions never import this subpackage. What it draws
or tabulates needs the ``report`` extra (matplotlib, tqdm, scikit-learn, mpmath); a feature that
finds it missing says so (:class:`layernorm._extras.MissingExtra`).

- :mod:`.page`: ``layernorm report``, one self-contained HTML page;
- :mod:`.benchmark`: ``layernorm bench``, kernels against torch, side by side;
- :mod:`.model_bench`: a small model patched against unpatched, paired;
- :mod:`.experiments`: the four experiments that reproduce the papers' claims;
- :mod:`.same_bits` and :mod:`.oracle`: the section "the same bits everywhere", judged by
  an exact oracle that shares no code with the kernels.
"""

from __future__ import annotations

from .page import write_report

__all__ = ["write_report"]
