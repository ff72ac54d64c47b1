"""The frameworks' own attention, each one a module of the contract through conformance.adapters, with the
declaration of what it lacks: what `python -m conformance frameworks` measures, and examples of wrapping a
kernel or a layer of another convention. A module whose framework is not installed fails to import and is
skipped (Flax and Keras come with the `frameworks` extra)."""

BUILT_INS = ("torch_sdpa", "torch_mha", "torch_encoder_layer", "torch_encoder_layer_fast", "jax_sdpa", "flax_mha",
             "keras_mha")  # the matrix's columns, in order


def module_names() -> list[str]:
    """The importable names of the built-ins' modules."""
    return [f"{__name__}.{name}" for name in BUILT_INS]
