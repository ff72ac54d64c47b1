"""The run: the suite that checks a module against the contract (conformance/contract) and reports.

- `suite`: the groups and the fixed-case runs, the report and its formats; `check` is conformance.check.
- `checks`: the checks on drawn cases (values, fast path, weights, dropout, ...) and the Runner that calls a module.
- `fixed_checks`: the checks on the fixed cases, run without Hypothesis.
- `gradient_checks`: the checks on a module's vjp.
- `snippets`: the code a failure carries to reproduce it.
- `profiles`: the profiles (fast, thorough).
"""
