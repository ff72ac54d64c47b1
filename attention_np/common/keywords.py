"""The keyword set of scaled_dot_product_attention, flash_attention, their vjps and the modules' calls (SPEC.md
sections 2 and 2a), in one table: each keyword's default, the feature of a partial contract that covers it, what
it asks, and the catalogue entry of `mods` it stands for. The backends' signatures spell these keywords out (a
reader sees them, an editor completes them); tests/test_api_parallel.py holds every signature to this table, and
the suite (its defaults, the keywords it passes only where a case differs from them, its adapters and its
features) reads it here.

The position keywords (is_causal, q_offset, window, key_lengths) and softcap are rules on the score of query i and
key j, as the catalogue's entries are: `mods.from_keywords` composes them into one mask function and one score
function, and every backend's masks and the float64 oracle's are those functions evaluated. A new rule of that
kind is a catalogue entry, taken through `mask_mod=` or `score_mod=` by every operation as it is; it needs no
keyword of its own.

Imports nothing but the standard library, so that conformance.contract.features can read it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, NamedTuple


class Keyword(NamedTuple):
    """One keyword of the set."""

    default: Any  # the value that changes nothing: the suite passes the keyword only where a case differs from it
    feature: str  # the feature of conformance.contract.features that a module lacking the keyword declares
    asks: str  # what the contract asks of it, in words (the feature's row in SPEC.md section 11)
    entry: str  # the catalogue entry it stands for ("" where it is not a rule on the scores)


KEYWORDS: MappingProxyType[str, Keyword] = MappingProxyType({
    "mask": Keyword(default=None, feature="mask", entry="",
                    asks="sdpa's mask (modules' too): an entry equal to 0 / False hides a key"),
    "bias": Keyword(default=None, feature="bias", entry="", asks="sdpa's bias: added to the scores, -inf hides a key"),
    "is_causal": Keyword(default=False, feature="is_causal", entry="causal(q_offset)",
                         asks="sdpa's is_causal: hide keys j > p_i"),
    "scale": Keyword(default=None, feature="scale", entry="", asks="sdpa's scale: multiplies q k^T"),
    "q_offset": Keyword(default=0, feature="q_offset", entry="the q_offset of causal and sliding_window",
                        asks="sdpa's q_offset: query i at position q_offset + i (SPEC 2a)"),
    "window": Keyword(default=None, feature="window", entry="sliding_window(left, right, q_offset)",
                      asks="sdpa's window: a sliding window (SPEC 2a)"),
    "key_lengths": Keyword(default=None, feature="key_lengths", entry="key_lengths(lengths)",
                           asks="sdpa's key_lengths: keys j >= key_lengths hidden (SPEC 2a)"),
    "softcap": Keyword(default=None, feature="softcap", entry="softcap(cap)",
                       asks="sdpa's softcap: raw scores capped by softcap * tanh (SPEC 2a)"),
    "enable_gqa": Keyword(default=False, feature="enable_gqa", entry="",
                          asks="sdpa's enable_gqa: grouped-query heads, k and v with fewer heads than q (SPEC 2a)"),
    "mask_mod": Keyword(default=None, feature="mods", entry="",
                        asks="mask_mod: a mask function of the query, key, batch and head indices"),
    "score_mod": Keyword(default=None, feature="score_mod", entry="",
                         asks="score_mod: a score function of each score, on flex_attention, sdpa and flash"),
    "sinks": Keyword(default=None, feature="sinks", entry="",
                     asks="sinks: one logit per head in every row's softmax, of no value, on sdpa, flash, ring and "
                          "flex (SPEC 2h)"),
    "alibi_slopes": Keyword(default=None, feature="alibi_slopes", entry="",
                            asks="alibi_slopes: -slope_h * abs(p_i - j) added to the scores, on sdpa, flash, ring "
                                 "and flex (SPEC 2i)"),
})

# The keywords of SPEC 2a: passed by the suite only where a case differs from their defaults, so that a module
# without them still runs every case that does not use them
POSITIONS = ("q_offset", "window", "key_lengths", "softcap", "enable_gqa")
MODS = ("mask_mod", "score_mod")  # passed only where given; a function the kernel calls with its own indices
PER_HEAD = ("sinks", "alibi_slopes")  # arrays of one value per head (SPEC 2h, 2i), passed only where given; each
# operation that takes one names it in its options (conformance/contract/operations.py)


def defaults(names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """{keyword: default} of `names` (every keyword by default), in the table's order."""
    return {name: keyword.default for name, keyword in KEYWORDS.items() if names is None or name in names}
