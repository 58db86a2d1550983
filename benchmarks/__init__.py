"""Benchmarks of h5store against the patterns users write today (see ``RESULTS.md``).

A package so that DataLoader and joblib worker processes can import the schema classes
and datasets of :mod:`benchmarks._common` under any start method.
"""
