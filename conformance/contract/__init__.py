"""The contract's description: what the suite holds a module to, declared once and read by everything else.

- `operations`: the operations (sdpa, flash, ring, linear, mha, block, decode, ...), one registry record each.
- `cases`: the case types the operations take, and the builders of the fixed cases.
- `fixed_cases`: the fixed cases (pinned examples, edge cases with their requirements, the errors).
- `strategies`: the Hypothesis strategies that draw cases (imported only where a check runs).
- `oracle`: the float64 oracle, written apart from attention_np.
- `tolerances`: each check's tolerance per dtype (tolerances.json).
- `features`: the features a module may declare lacking (SPEC.md section 12).

Imports NumPy alone: neither Hypothesis (but `strategies`) nor a framework.
"""
