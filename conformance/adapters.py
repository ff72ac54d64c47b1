"""Adapters (docs/checking.md): a kernel of another convention as the contract's scaled_dot_product_attention,
so that the suite can check it. A third-party kernel wrapped and checked in a few lines:

    # my_kernel_check.py: python -m conformance check my_kernel_check
    from conformance import adapters
    from my_kernels import flash  # flash(q, k, v, causal) on (B, L, H, E) tensors

    def kernel(q, k, v, *, is_causal=False):  # the contract's keyword names, the kernel's layout
        return flash(q, k, v, causal=is_causal)

    scaled_dot_product_attention = adapters.sdpa(kernel, layout="BLHE")
    asarray, to_numpy = adapters.arrays("torch")
    CONFORMANCE = scaled_dot_product_attention.declaration  # no weights, dropout, mask, bias, ...

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes; N = B * H (heads folded into the batch).

The kernel takes q, k, v in its layout and, by keyword, those of the contract's arguments it names in its
signature (mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap, enable_gqa; mask_mod and
score_mod, passed as they are, which it calls with its own index arrays (not in layout NLE); dropout_p and rng
for dropout; need_weights when it returns (out, weights)); the features it does not name are what the
declaration lacks (mods for mask_mod, score_mod for score_mod), and sinks and alibi_slopes always: the adapter passes
neither (yet). The adapter checks the arguments as the
contract does (the backends' own checks, so bad input raises SPEC 7's errors before the kernel sees it),
broadcasts the leading axes (...) and lays q, k, v, the masks and the per-sequence positions out for the
kernel: the last leading axis is the heads, the others the batch, and a mask arrives as a full (B, H, L, S) array
(N, L, S folded) in the kernel's polarity. The kernel's output comes back as (..., L, Ev), its weights as
(..., L, S). Works on NumPy, JAX (under jit too) and torch arrays; `vjp` adds scaled_dot_product_attention_vjp
by the framework's own autodiff.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from attention_np.common import keywords, validation

from .contract.features import Declaration

UNADAPTED = keywords.PER_HEAD  # sinks and alibi_slopes: not laid out for a kernel (yet), so always lacking
ARGUMENTS = tuple(name for name in keywords.KEYWORDS if name not in UNADAPTED)  # sdpa's keywords the adapter passes
# (attention_np.common.keywords, the keyword set's home)
DEFAULTS = keywords.defaults()
FEATURES = {name: keyword.feature for name, keyword in keywords.KEYWORDS.items()}  # the feature each one needs
MODS = keywords.MODS  # passed to the kernel as they are: it calls them with its own index arrays
LAYOUTS = ("BHLE", "BLHE", "NLE")  # (batch, heads, L, E); (batch, L, heads, E); (batch * heads, L, E)
MASKS = {"keep": "a boolean, True where a key is seen (torch's attn_mask, jax.nn's mask)",
         "hide": "a boolean, True where a key is hidden (nn.MultiheadAttention's, Keras' inverse)",
         "additive": "a float added to the scores, -inf where a key is hidden; the bias goes in it too"}


class _Ops(NamedTuple):
    """The few array operations the adapter needs, in one framework."""

    broadcast: Callable[[Any, tuple[int, ...]], Any]
    permute: Callable[[Any, tuple[int, ...]], Any]
    where: Callable[[Any, Any, Any], Any]
    dtype: Callable[[Any], tuple[str, bool]]  # (dtype name, is floating)
    values: Callable[[Any], np.ndarray | None]  # the values, where they can be read (not under jax.jit)
    scalar: Callable[[float, Any], Any]  # (value, like) -> a 0-d array of like's dtype (and device)
    cast: Callable[[Any, Any], Any]  # (x, like) -> x in like's dtype


def _numpy_ops() -> _Ops:
    return _Ops(broadcast=np.broadcast_to,
                permute=np.transpose,
                where=np.where,
                dtype=_numpy_dtype,
                values=np.asarray,
                scalar=lambda value, like: np.asarray(value, like.dtype),
                cast=lambda x, like: x.astype(like.dtype))


def _numpy_dtype(x: Any) -> tuple[str, bool]:
    return x.dtype.name, np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"  # ml_dtypes' bfloat16


def _jax_ops() -> _Ops:
    import jax
    import jax.numpy as jnp

    def values(x: Any) -> np.ndarray | None:
        return None if isinstance(x, jax.core.Tracer) else np.asarray(x)  # jax: no values inside jit

    return _Ops(broadcast=jnp.broadcast_to,
                permute=jnp.transpose,
                where=jnp.where,
                dtype=_numpy_dtype,
                values=values,
                scalar=lambda value, like: jnp.asarray(value, like.dtype),
                cast=lambda x, like: x.astype(like.dtype))


def _torch_ops() -> _Ops:
    import torch

    def dtype(x: Any) -> tuple[str, bool]:
        return str(x.dtype).removeprefix("torch."), x.dtype.is_floating_point

    def values(x: Any) -> np.ndarray:
        return x.detach().cpu().numpy() if x.dtype != torch.bfloat16 else x.detach().float().cpu().numpy()

    return _Ops(broadcast=torch.broadcast_to,
                permute=torch.permute,
                where=torch.where,
                dtype=dtype,
                values=values,
                scalar=lambda value, like: torch.tensor(value, dtype=like.dtype, device=like.device),
                cast=lambda x, like: x.to(like.dtype))


_OPS = {"numpy": _numpy_ops, "jax": _jax_ops, "jaxlib": _jax_ops, "torch": _torch_ops}


def _ops(x: Any) -> _Ops:
    return _OPS.get(type(x).__module__.split(".")[0], _numpy_ops)()


class Adapted:
    """A kernel as the contract's scaled_dot_product_attention (see the module docstring); `declaration` says
    what it lacks."""

    def __init__(self, kernel: Callable, *, layout: str = "BHLE", mask: str = "keep") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
        if mask not in MASKS:
            raise ValueError(f"mask must be one of {tuple(MASKS)}; got {mask!r}")
        parameters = inspect.signature(kernel).parameters
        self.kernel, self.layout, self.mask = kernel, layout, mask
        self.takes = {name for name in (*ARGUMENTS, "dropout_p", "rng", "need_weights") if name in parameters}
        if mask == "additive" and "mask" in self.takes:  # the bias travels in the additive mask
            self.takes.add("bias")
        if layout == "NLE" and "enable_gqa" in self.takes:
            raise ValueError("layout NLE folds the heads into the batch: a kernel in it cannot group query heads "
                             "(enable_gqa)")
        if layout == "NLE" and self.takes & set(MODS):
            raise ValueError("layout NLE folds the heads into the batch: a kernel in it cannot call mask_mod or "
                             "score_mod with the batch and head indices b and h")

    @property
    def declaration(self) -> Declaration:
        """The features the kernel's signature does not name."""
        lacks = [FEATURES[name] for name in ARGUMENTS if name not in self.takes]
        lacks += [] if "dropout_p" in self.takes else ["dropout"]
        lacks += [] if "need_weights" in self.takes else ["weights"]
        return Declaration(dict.fromkeys(lacks, "the kernel takes no such argument")
                           | dict.fromkeys((FEATURES[name] for name in UNADAPTED), "the adapter passes none"))

    def __call__(self, q: Any, k: Any, v: Any, mask: Any = None, *, bias: Any = None, is_causal: bool = False,
                 scale: float | None = None, q_offset: Any = 0, window: tuple | None = None, key_lengths: Any = None,
                 softcap: float | None = None, enable_gqa: bool = False, mask_mod: Callable | None = None,
                 score_mod: Callable | None = None, dropout_p: float = 0.0, need_weights: bool = True,
                 rng: Any = None) -> tuple[Any, Any]:
        ops = _ops(q)
        given = {"mask": mask, "bias": bias, "is_causal": is_causal, "scale": scale, "q_offset": q_offset,
                 "window": window, "key_lengths": key_lengths, "softcap": softcap, "enable_gqa": enable_gqa,
                 "mask_mod": mask_mod, "score_mod": score_mod}
        given = {name: value for name, value in given.items() if not _is_default(value, DEFAULTS[name])}
        refused = [name for name in given if name not in self.takes]
        refused += ["dropout_p"] if dropout_p and "dropout_p" not in self.takes else []
        if refused:
            raise ValueError(f"the kernel takes no {', '.join(refused)} (its declaration lacks them)")

        # 1) the contract's checks; the scores' leading axes (..., H with enable_gqa)
        batch, heads = _checked(ops, q, k, v, given, dropout_p)
        L, S = q.shape[-2], k.shape[-2]

        # 2) the kernel's layout: the last leading axis holds the heads, the others the batch
        frame = _Frame(self.layout, batch, heads)
        keywords = {name: value for name, value in given.items() if name not in ("mask", "bias")}
        keywords |= self._masks(ops, frame, given, q, (L, S))
        for name in ("q_offset", "key_lengths"):
            if name in keywords and not isinstance(keywords[name], int):
                keywords[name] = frame.per_sequence(ops, keywords[name])  # (...) -> (B, H) or (N,)
        if "dropout_p" in self.takes:
            keywords |= {"dropout_p": dropout_p} | ({"rng": rng} if "rng" in self.takes else {})
        if "need_weights" in self.takes:
            keywords["need_weights"] = need_weights
        result = self.kernel(frame.inputs(ops, q, "q"), frame.inputs(ops, k, "kv"), frame.inputs(ops, v, "kv"),
                             **keywords)

        # 3) back to the contract's shapes
        out, weights = result if "need_weights" in self.takes else (result, None)
        frame.expect("the kernel's output", out, frame.laid_out(frame.H, L, v.shape[-1]))
        out = frame.output(ops, out)  # (..., L, Ev)
        if weights is not None and need_weights:
            frame.expect("the kernel's weights", weights, (*frame.lead(frame.H), L, S))  # the masks' layout
        weights = None if weights is None or not need_weights else frame.scores(ops, weights)  # (..., L, S)
        return out, weights

    def _masks(self, ops: _Ops, frame: _Frame, given: dict, q: Any, sizes: tuple[int, int]) -> dict[str, Any]:
        """The mask and bias as the kernel takes them, each (B, H, L, S) or (N, L, S)."""
        mask, bias = given.get("mask"), given.get("bias")
        keep = None if mask is None or ops.dtype(mask)[0] == "bool" else mask != ops.scalar(0, mask)  # 0 hides
        keep = mask if keep is None else keep  # (a boolean mask as it is: JAX's strict promotion refuses != 0)
        bias = None if bias is None else ops.cast(bias, q)  # the scores' dtype (SPEC 2)
        if self.mask == "additive":  # one float array: the bias, and -inf where a key is hidden
            if keep is None and bias is None:
                return {}
            additive = ops.scalar(0.0, q) if bias is None else bias  # in q's dtype, as checked
            if keep is not None:
                additive = ops.where(keep, additive, ops.scalar(-math.inf, q))
            return {"mask": frame.scores_in(ops, additive, sizes)}
        found = {}
        if keep is not None:
            found["mask"] = frame.scores_in(ops, keep if self.mask == "keep" else ~keep, sizes)
        if bias is not None:
            found["bias"] = frame.scores_in(ops, bias, sizes)
        return found


def sdpa(kernel: Callable, *, layout: str = "BHLE", mask: str = "keep") -> Adapted:
    """The contract's scaled_dot_product_attention from `kernel`, which takes q, k, v in `layout` (one of LAYOUTS)
    and a mask in the polarity `mask` (one of MASKS); see the module docstring."""
    return Adapted(kernel, layout=layout, mask=mask)


class _Frame:
    """The map between the contract's leading axes (..., heads) and the kernel's (B, H) or (N,)."""

    def __init__(self, layout: str, batch: tuple[int, ...], heads: tuple[int, int]) -> None:
        self.layout, self.batch, (self.H, self.Hkv) = layout, batch, heads  # batch: the scores' (...), maybe ()
        self.B = math.prod(batch[:-1])  # () and (H,): one sequence

    def lead(self, H: int) -> tuple[int, ...]:
        return (self.B * H,) if self.layout == "NLE" else (self.B, H)

    def inputs(self, ops: _Ops, x: Any, which: str) -> Any:
        """q (..., H, L, E) or k, v (..., Hkv, S, *) in the kernel's layout."""
        H = self.H if which == "q" else self.Hkv
        x = ops.broadcast(x, (*self.batch[:-1], H, *x.shape[-2:]) if self.batch else x.shape)
        x = x.reshape(*self.lead(H), *x.shape[-2:])  # (..., H, L, E) -> (B, H, L, E) or (N, L, E)
        return ops.permute(x, (0, 2, 1, 3)) if self.layout == "BLHE" else x  # (B, H, L, E) -> (B, L, H, E)

    def laid_out(self, H: int, L: int, width: int) -> tuple[int, ...]:
        """The kernel's shape of H heads of L rows of `width`: (B, H, L, width), (B, L, H, width) or (N, L, width)."""
        return (self.B, L, H, width) if self.layout == "BLHE" else (*self.lead(H), L, width)

    def expect(self, name: str, x: Any, shape: tuple[int, ...]) -> None:
        """A kernel's result must have `shape`: else a ValueError naming the layout and both shapes (a BLHE
        kernel's output in (B, H, L, E) is no reshape away from the right numbers)."""
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} in layout {self.layout}; got {tuple(x.shape)}")

    def output(self, ops: _Ops, out: Any) -> Any:
        """The kernel's output -> (..., L, Ev)."""
        out = ops.permute(out, (0, 2, 1, 3)) if self.layout == "BLHE" else out  # (B, L, H, Ev) -> (B, H, L, Ev)
        return out.reshape(*self.batch, *out.shape[-2:])

    def scores_in(self, ops: _Ops, x: Any, sizes: tuple[int, int]) -> Any:
        """A mask or bias broadcasting to (..., L, S) -> (B, H, L, S) or (N, L, S), every axis full."""
        return ops.broadcast(x, (*self.batch, *sizes)).reshape(*self.lead(self.H), *sizes)

    def scores(self, ops: _Ops, x: Any) -> Any:
        """The kernel's weights (B, H, L, S) or (N, L, S) -> (..., L, S)."""
        return x.reshape(*self.batch, *x.shape[-2:])

    def per_sequence(self, ops: _Ops, x: Any) -> Any:
        """q_offset or key_lengths broadcasting to (...) -> (B, H) or (N,)."""
        return ops.broadcast(x, self.batch).reshape(self.lead(self.H))


def _checked(ops: _Ops, q: Any, k: Any, v: Any, given: dict, dropout_p: float) -> tuple[tuple, tuple[int, int]]:
    """The contract's checks of the arguments (SPEC 7, the backends' own); returns the scores' leading axes
    (..., H), at least one axis, and (H, Hkv)."""
    validation.same_floating_dtype({name: ops.dtype(x) for name, x in (("q", q), ("k", k), ("v", v))})
    if given.get("enable_gqa"):
        H, Hkv = validation.grouped_heads(q.shape, k.shape, v.shape)
        kv_batch = validation.attention_batch((*q.shape[:-3], Hkv, *q.shape[-2:]), k.shape, v.shape)
        batch = (*kv_batch[:-1], H)
    else:
        batch = validation.attention_batch(q.shape, k.shape, v.shape)
    H = batch[-1] if batch else 1  # unbatched: one sequence of one head
    heads = (H, k.shape[-3] if given.get("enable_gqa") else H)
    target = (*batch, q.shape[-2], k.shape[-2])
    for name in ("mask", "bias"):
        if name in given:
            validation.broadcasts_to(name, given[name].shape, target, "..., L, S")
    if "mask" in given:
        dtype, floating = ops.dtype(given["mask"])
        values = ops.values(given["mask"]) if floating else None
        validation.binary_mask(floating, None if values is None else bool(np.all((values == 0) | (values == 1))))
    for name in ("q_offset", "key_lengths"):
        if name in given:
            x = given[name]
            dtype = (type(x).__name__, isinstance(x, int)) if isinstance(x, int | float) else ops.dtype(x)
            integer = dtype[1] if isinstance(x, int | float) else not dtype[1] and dtype[0] != "bool"
            validation.positions(name, np.shape(x) if isinstance(x, int | float) else x.shape, dtype[0], integer, batch)
    if given.keys() & set(MODS):  # the mods index the scores (B, H, L, S): four axes
        validation.mods_inputs("scaled_dot_product_attention", q.shape, k.shape, v.shape)
    validation.window(given.get("window"))
    validation.softcap(given.get("softcap"))
    validation.probability("dropout_p", dropout_p)
    validation.default_scale(given.get("scale"), q.shape, k.shape)
    return batch, heads


def _is_default(value: Any, default: Any) -> bool:
    """Whether a keyword is at its default; an array never is (a NumPy scalar is a number)."""
    return value is default or (isinstance(value, int | float | np.integer | np.floating | tuple) and value == default)


def arrays(framework: str) -> tuple[Callable[[Any], Any], Callable[[Any], np.ndarray]]:
    """(asarray, to_numpy) of "numpy", "jax" or "torch": the contract's array conversions, as our backends make
    them (JAX: float64 needs jax_enable_x64)."""
    backends = {"numpy": "attention_np", "jax": "attention_jax", "torch": "attention_torch"}
    if framework not in backends:
        raise ValueError(f"framework must be one of {tuple(backends)}; got {framework!r}")
    backend = __import__(backends[framework])
    return backend.asarray, backend.to_numpy


@contextlib.contextmanager
def torch_rng(rng: Any) -> Iterator[None]:
    """torch's global RNG drawn from `rng` for a kernel that knows no generator (F.scaled_dot_product_attention's
    dropout): a torch.Generator seeds it for the call (the global state restored afterwards), None leaves it as
    it is."""
    if rng is None:
        yield
        return
    import torch

    seed = int(torch.randint(0, 2**62, (), generator=rng))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def autodiff(function: Callable[..., tuple[Any, Any]], arrays: dict[str, Any],
             differentiable: tuple[str, ...]) -> tuple[Any, Any, Callable[[Any], dict[str, Any]]]:
    """(out, weights, pullback) of `function(**arrays) -> (out, weights)`, by the framework's own autodiff
    (torch: autograd, also where the caller is in inference mode; JAX: jax.vjp, under jit too; NumPy has
    none): pullback(d_out) -> {name: gradient} for the names in `differentiable` that hold an array (zeros
    where out does not depend on one), each in that array's dtype. The contract's vjps, for a built-in that
    has none of its own."""
    names = [name for name in differentiable if arrays.get(name) is not None]
    kind = type(next(iter(arrays[name] for name in names))).__module__.split(".")[0] if names else "numpy"
    if kind == "torch":
        return _torch_autodiff(function, arrays, names)
    if kind in ("jax", "jaxlib"):
        return _jax_autodiff(function, arrays, names)
    raise TypeError(f"autodiff needs torch or JAX arrays; got {kind}")


def _torch_autodiff(function: Callable, arrays: dict[str, Any], names: list[str]) -> tuple[Any, Any, Callable]:
    import torch

    def fresh(x: Any) -> Any:  # torch: an inference-mode tensor cannot join autograd, its clone can
        return x.detach().clone().requires_grad_(True)

    with torch.inference_mode(False), torch.enable_grad():
        leaves = {name: fresh(arrays[name]) for name in names}
        others = {name: x.clone() if isinstance(x, torch.Tensor) else x  # a mask, say: no inference tensors
                  for name, x in arrays.items() if name not in leaves}
        out, weights = function(**others | leaves)

    def pullback(d_out: Any) -> dict[str, Any]:
        _check_cotangent(d_out, out)
        with torch.inference_mode(False), torch.enable_grad():
            grads = torch.autograd.grad(out, list(leaves.values()), d_out.detach().clone(), allow_unused=True,
                                        retain_graph=True)  # a pullback may be called again
        return {name: torch.zeros_like(leaf) if grad is None else grad.detach()
                for (name, leaf), grad in zip(leaves.items(), grads, strict=True)}

    return out.detach(), None if weights is None else weights.detach(), pullback


def _jax_autodiff(function: Callable, arrays: dict[str, Any], names: list[str]) -> tuple[Any, Any, Callable]:
    import jax

    def out_of(*values: Any) -> Any:
        return function(**arrays | dict(zip(names, values, strict=True)))[0]

    out, vjp = jax.vjp(out_of, *(arrays[name] for name in names))
    weights = function(**arrays)[1]

    def pullback(d_out: Any) -> dict[str, Any]:
        _check_cotangent(d_out, out)
        return dict(zip(names, vjp(d_out), strict=True))

    return out, weights, pullback


def _check_cotangent(d_out: Any, out: Any) -> None:
    """d_out has out's shape and dtype (SPEC 4a), as the contract's pullbacks check."""
    ops = _ops(out)
    dtypes = {"d_out": ops.dtype(d_out), "out": ops.dtype(out)}
    validation.cotangent("d_out", tuple(d_out.shape), tuple(out.shape), dtypes)


def vjp(sdpa_: Callable) -> Callable:
    """The contract's scaled_dot_product_attention_vjp of an adapted sdpa, by autodiff (see `autodiff`):
    (q, k, v, mask, **keywords) -> (out, weights, pullback), pullback(d_out) -> (dq, dk, dv, dbias), and with a
    score_mod (dq, dk, dv, dbias, d_score_mod): its parameters' gradients by name (ScoreMod.parameters, each made
    an array of q's framework and dtype and differentiated as an input; {} for a plain function)."""
    def scaled_dot_product_attention_vjp(q: Any, k: Any, v: Any, mask: Any = None, *, bias: Any = None,
                                         **keywords: Any) -> tuple[Any, Any, Callable]:
        score_mod = keywords.pop("score_mod", None)
        parameters = {f"score_mod.{name}": _like(value, q)
                      for name, value in getattr(score_mod, "parameters", {}).items()}

        def call(q: Any, k: Any, v: Any, mask: Any, **keywords: Any) -> tuple[Any, Any]:
            values = {name.removeprefix("score_mod."): keywords.pop(name) for name in parameters}
            modded = {} if score_mod is None else {"score_mod": score_mod.replace(**values) if values else score_mod}
            return sdpa_(q, k, v, mask, **keywords, **modded)

        arrays = {"q": q, "k": k, "v": v, "mask": mask, "bias": bias} | keywords | parameters  # all through autodiff
        out, weights, pullback = autodiff(call, arrays, ("q", "k", "v", "bias", *parameters))

        def pulled(d_out: Any) -> tuple:
            grads = pullback(d_out)
            plain = tuple(grads.get(name) for name in ("q", "k", "v", "bias"))
            return plain if score_mod is None else (*plain, {name.removeprefix("score_mod."): grads[name]
                                                             for name in parameters})

        return out, weights, pulled

    return scaled_dot_product_attention_vjp


def _like(value: Any, q: Any) -> Any:
    """A score function's parameter (a NumPy array, say) as an array of q's framework, dtype and device."""
    kind = type(q).__module__.split(".")[0]
    if kind == "torch":
        import torch
        return torch.as_tensor(np.asarray(value), dtype=q.dtype, device=q.device)
    if kind in ("jax", "jaxlib"):
        import jax.numpy as jnp
        return jnp.asarray(np.asarray(value), q.dtype)
    return np.asarray(value, q.dtype)
