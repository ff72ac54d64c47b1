"""Third-party implementations of the contract, for testing the conformance suite itself.

`einsum_attention` is an independent, correct NumPy implementation (not one of ours) that the suite must
accept; `broken` holds variants of it with one realistic bug each, which the suite must reject.
"""
