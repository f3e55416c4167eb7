"""Benchmarks: the measurements behind BENCHMARKS.md, kept out of the product's packages. ``python -m benchmarks``
lists them; each one says its own commands (``python -m benchmarks <name> --help`` or its module docstring)."""
