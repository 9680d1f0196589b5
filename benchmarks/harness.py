"""Benchmark harness: ``python benchmarks/harness.py [options]`` == ``layernorm bench [options]``.

See :mod:`layernorm.report.benchmark` for what is measured and how. Examples::

    python benchmarks/harness.py --quick
    python benchmarks/harness.py --threads 2 --json benchmarks/results.json --out benchmarks/
"""

from layernorm.report.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
