"""The immutable module base class: NumPy's modules are built on it, and JAX's pytree modules extend it.

A module is its children (parameters and sub-modules, in state-dict order) and its settings (sizes, flags,
the training mode: plain Python values). It never changes: eval(), train() and from_state_dict() return
new modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np


class Module:
    """An immutable module: `_children` are arrays or modules, `_settings` are plain Python values."""

    _children: tuple[str, ...] = ()  # parameters and sub-modules, in state-dict order
    _settings: tuple[str, ...] = ()  # hyper-parameters and the training flag
    _state_names: ClassVar[Mapping[str, str]] = {}  # a child whose state-dict name differs from its attribute

    def _init(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, _owned(value) if isinstance(value, np.ndarray) else value)

    @classmethod
    def _build(cls, **fields: Any) -> Any:
        module = object.__new__(cls)
        module._init(**fields)
        return module

    def _replace(self, **changes: Any) -> Any:
        fields = {name: getattr(self, name) for name in self._children + self._settings}
        return self._build(**(fields | changes))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: eval(), train() and from_state_dict() "
                             "return new modules")

    def __repr__(self) -> str:
        settings = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._settings)
        return f"{type(self).__name__}({settings})"

    def state_dict(self) -> dict[str, Any]:
        """{name: array}, with the names and layouts of the PyTorch classes."""
        state = {}
        for name in self._children:
            child, prefix = getattr(self, name), self._state_names.get(name, name)
            if child is None:  # a parameter the module does without (Linear's bias with bias=False)
                continue
            if isinstance(child, Module):
                state |= {f"{prefix}.{key}": value for key, value in child.state_dict().items()}
            else:
                state[prefix] = child
        return state

    def train(self, mode: bool = True) -> Any:
        """This module in training mode (dropout active), or in inference mode with mode=False."""
        changes = {name: getattr(self, name).train(mode) for name in self._children
                   if isinstance(getattr(self, name), Module)}
        return self._replace(**changes, **({"training": mode} if "training" in self._settings else {}))

    def eval(self) -> Any:
        """This module in inference mode: no dropout."""
        return self.train(False)


def _owned(x: np.ndarray) -> np.ndarray:
    """A NumPy parameter the module owns: a read-only copy, unless x already is one (a module's own, passed on
    by eval(), train() or a sibling), so neither the caller's array nor the state_dict() it returns can change
    an immutable module. Other arrays (JAX's) are immutable already and are held as they are."""
    if x.flags.writeable or x.base is not None:
        x = np.array(x)
        x.flags.writeable = False
    return x
