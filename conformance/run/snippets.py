"""Failure messages: a one-line description of a case and a Python snippet that reproduces the check."""

from __future__ import annotations

import re
import sys
from typing import Any

import numpy as np

from attention_np.common import mods
from attention_np.common.mods import MaskMod, ScoreMod


def describe(case: Any) -> str:
    """Shapes and dtypes of the arrays, values of the options: `q (2, 3, 4) float64, ..., is_causal=True`."""
    parts = []
    for name, value in case._asdict().items():
        if isinstance(value, dict):
            parts.append(f"{name} {{{len(value)} arrays}}")
        elif isinstance(value, np.ndarray):
            parts.append(f"{name} {value.shape} {value.dtype}")
        else:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


def reproduce(module: str, check: str, case: Any, dtype: str) -> str:
    """Code that rebuilds `case` exactly and runs the check on `module`, printing its measures."""
    fields = ",\n".join(f"    {name}={_literal(value)}" for name, value in case._asdict().items())
    devices = getattr(case, "devices", None)  # ring attention: the framework's devices held (torch: peers)
    held = "" if devices is None else f", framework_of({module}).ring_devices({devices})"
    return (f"import numpy as np\nfrom numpy import inf, nan\nimport {module}\n"
            f"from conformance.contract import cases\nfrom conformance.run import checks\n"
            f"from attention_np.common import mods\n"
            f"from conformance.frameworks.registry import framework_of\n"
            f"case = cases.{type(case).__name__}(\n{fields},\n)\n"
            f"with framework_of({module}).pinned(){held}:  # the suite's precision settings (JAX: float64 on)\n"
            f"    print(checks.{check}(checks.Runner({module}), case, {dtype!r}))")


def _literal(value: Any) -> str:
    if isinstance(value, ScoreMod) and value.parameters:  # its maker called with the parameters, in full
        maker = repr(value).partition("(")[0]
        return f"mods.{maker}({', '.join(_literal(np.asarray(x)) for x in value.parameters.values())})"
    if isinstance(value, MaskMod | ScoreMod):  # a catalogue entry's text is its maker's call, e.g. causal(q_offset=0)
        # (an array parameter of more than 8 entries shows as <shape array> there)
        return re.sub(r"(?<![\w.])([a-z_]+)\(", r"mods.\1(", repr(value))
    if callable(value) and getattr(value, "__name__", "") in vars(mods):  # noop_mask
        return f"mods.{value.__name__}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{name!r}: {_literal(x)}" for name, x in value.items()) + "}"
    if isinstance(value, np.ndarray):
        text = np.array2string(value, separator=", ", threshold=sys.maxsize, floatmode="unique",
                               max_line_width=sys.maxsize)
        return f"np.array({text}, dtype={value.dtype.name!r})"  # a name every NumPy knows (np.bool is 2.x)
    return repr(value)
