"""Conformance suite: a float64 oracle, written apart from every backend, and a report of how far each
backend's attention is from it. Run it with `python -m conformance`.

Importing this package imports NumPy only; a backend (and its framework) is imported when a run needs it.
"""
