"""The code the three backends share: `attention_np`, `attention_jax` and `attention_torch` import it, and it
imports no framework (NumPy only), so each backend can be installed and imported without the others.

- `validation`: the argument checks, on plain Python values, so every backend raises the same exception with
  the same message for the same mistake.
- `records`: the typed records (`Structure`, ...) the backends pass from their public functions to the loops.
- `module`: `Module`, the immutable module base class of the NumPy modules, which JAX's pytree modules extend.
- `npz`: the `.npz` state-dict file format, written once.
"""
