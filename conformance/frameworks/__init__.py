"""The frameworks: what differs between NumPy, JAX and torch, and the frameworks' built-ins measured.

- `registry`: one Framework record per framework (its rng forms, staging, precision settings, devices, timing),
  read off a module by `framework_of`; the suite and the benchmarks read it.
- `peers`: torch's devices for ring attention, peer processes in one gloo group.
- `disagreements`: the rules of the spec on which the frameworks' built-ins disagree, each with its probe.
- `matrix`: `python -m conformance frameworks`: the built-ins (conformance/builtins) measured by those rules
  and by the suite, one column each.
"""
