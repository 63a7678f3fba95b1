"""Benchmarks and the demo: timing harness, the ``bench`` command, its chart,
the demo and its synthetic data. They sit above the PyTorch layer (they time
``LMDBFolder``); only the CLI imports them.
"""
