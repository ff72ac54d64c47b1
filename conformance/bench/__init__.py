"""`python -m conformance compare`: our backends timed against the frameworks' own implementations.

- `timing`: what is timed and how: the problems, the candidates, the interleaving, the FLOPs, the rows
  and the performance targets.
- `report`: the command line and what it prints: the table, the targets, the machine, the plot, the JSON.
- `baselines`: what our backends are timed against, written plainly, and our state dicts in torch's
  built-in layers (also the tests' reference for nn.MultiheadAttention and nn.TransformerEncoderLayer).

What differs between NumPy, JAX and torch (devices, synchronisation, peak memory, ...) is declared once,
in conformance/frameworks/registry.py, which the suite reads too.
"""
