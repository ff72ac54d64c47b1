"""SPEC 2e's update rules on every backend against ONNX's LinearAttention (opset 27), run by onnx's reference
evaluator: "gated", "delta" and "gated_delta" on the full sequence and step by step (from ONNX's past_state),
with decay per head and per key dimension, beta per head and shared, fewer key/value heads, ONNX's scale;
ONNX's "linear" rule (our "gated" at decay 0, our "linear" state); key lengths; a delta rule derived by hand;
the gradients against central differences; the errors; and the comparisons seen to fail on planted bugs.

Layouts: ONNX packs heads into the last axis, (B, T, H * d); ours are (..., L, E). A query head h of ONNX's
Hq = Hkv * G reads key/value head h // G: ours puts the G query heads of a group on an axis of their own,
q (B, Hkv, G, L, E) against k and v (B, Hkv, 1, L, E), which broadcasting shares. ONNX's decay (B, T, Hkv) is our
(B, Hkv, 1, L, 1), its (B, T, Hkv * E) our (B, Hkv, 1, L, E); its beta (B, T, Hkv) our (B, Hkv, 1, L, 1), its
(B, T, 1) our (B, 1, 1, L, 1). ONNX's output is scale * q_t^T S_t: ours takes the scale on q (the identity feature
map, so phi(scale q) = scale q).

onnx's reference casts every input to float32 (its `astype(np.float32)`), so its own run resolves 1e-7 at best.
`_onnx` runs the very code of its `_run` with `np.float32` read as float64 (`_Float64Numpy`): the same operations
in the same order, in float64, held to the tests' float64 tolerance; `test_the_float64_run_is_onnxs_run` checks
it against the evaluator as it ships (float32) and that the two differ only by float32 rounding.
"""

from __future__ import annotations

import importlib
import math
import types
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from attention_np.common import validation
from tests._compare import REORDERED, assert_close
from tests.conftest import import_backend

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402 (after the skip: onnx is a test extra)
from onnx.reference import ReferenceEvaluator  # noqa: E402
from onnx.reference.ops import op_linear_attention  # noqa: E402

OPSET = 27  # LinearAttention
RTOL = REORDERED  # float64 on both sides: the same recurrence, in another layout
RULES = ("gated", "delta", "gated_delta")
B, L, E, Ev = 2, 5, 3, 4


class _Float64Numpy:
    """NumPy with float32 read as float64: the module that the float64 run of onnx's reference code sees."""

    float32 = np.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


class _LinearAttention64(op_linear_attention.LinearAttention):
    """onnx's reference LinearAttention, its _run's code unchanged, computing in float64."""

    _run = types.FunctionType(op_linear_attention.LinearAttention._run.__code__,
                              {**vars(op_linear_attention), "np": _Float64Numpy()}, "_run",
                              op_linear_attention.LinearAttention._run.__defaults__)


_LinearAttention64.__name__ = "LinearAttention"  # the evaluator finds an operator by its class name


def _onnx(inputs: dict[str, np.ndarray], float64: bool = True, **attributes: Any) -> tuple[np.ndarray, np.ndarray]:
    """(output, present_state) of one LinearAttention node; `inputs` by the operator's names (query, key, value,
    past_state, decay, beta), an absent one left out."""
    order = ("query", "key", "value", "past_state", "decay", "beta")
    names = [name if name in inputs else "" for name in order]
    while names[-1] == "":
        names.pop()
    kind = TensorProto.DOUBLE if float64 else TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("LinearAttention", names, ["output", "present_state"], **attributes)], "linear",
        [helper.make_tensor_value_info(name, kind, x.shape) for name, x in inputs.items()],
        [helper.make_tensor_value_info(name, kind, None) for name in ("output", "present_state")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    evaluator = ReferenceEvaluator(model, new_ops=[_LinearAttention64] if float64 else None)
    return tuple(evaluator.run(None, inputs))


def _pack(x: np.ndarray) -> np.ndarray:
    """Ours (B, Hkv, G, L, d) -> ONNX's (B, L, Hkv * G * d): heads into the last axis, query head h = kv * G + g."""
    return np.moveaxis(x, -2, 1).reshape(x.shape[0], x.shape[-2], -1)


class Case:
    """One problem in our layout: q (B, Hkv, G, L, E), k (B, Hkv, 1, L, E), v (B, Hkv, 1, L, Ev), the gates of
    `rule`, a past state (B, Hkv, E, Ev), and the scale."""

    def __init__(self, rule: str, Hkv: int = 2, G: int = 1, decay: str = "head", beta: str = "head",
                 scale: float | None = None, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.rule, self.Hkv, self.G = rule, Hkv, G
        self.q = rng.standard_normal((B, Hkv, G, L, E))
        k = rng.standard_normal((B, Hkv, 1, L, E))
        self.k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # L2-normalised keys, as the delta rules expect
        self.v = rng.standard_normal((B, Hkv, 1, L, Ev))
        gated, delta = validation.UPDATE_RULES[rule]
        width = {"head": 1, "key": E}[decay]
        self.decay = -rng.uniform(0.05, 1.0, (B, Hkv, 1, L, width)) if gated else None  # log of (0.37, 0.95)
        rows = {"head": Hkv, "shared": 1}[beta]
        self.beta = rng.uniform(0.1, 0.9, (B, rows, 1, L, 1)) if delta else None
        self.past = rng.standard_normal((B, Hkv, E, Ev))
        self.scale = scale
        self.attributes = {"q_num_heads": Hkv * G, "kv_num_heads": Hkv, "update_rule": rule,
                           **({} if scale is None else {"scale": scale})}

    def onnx_inputs(self, past: bool = False) -> dict[str, np.ndarray]:
        inputs = {"query": _pack(self.q), "key": _pack(self.k), "value": _pack(self.v)}
        if past:
            inputs["past_state"] = self.past
        if self.decay is not None:  # (B, Hkv, 1, L, w) -> (B, L, Hkv * w)
            inputs["decay"] = _pack(self.decay)
        if self.beta is not None:  # (B, Hkv or 1, 1, L, 1) -> (B, L, Hkv or 1)
            inputs["beta"] = _pack(self.beta)
        return inputs

    def scaled_q(self) -> np.ndarray:
        return self.q * (1 / math.sqrt(E) if self.scale is None else self.scale)  # a Python float: q keeps its dtype

    def gates(self) -> dict[str, np.ndarray]:
        return {name: x for name, x in (("decay", self.decay), ("beta", self.beta)) if x is not None}


def _full(M: ModuleType, case: Case, **options: Any) -> np.ndarray:
    """M's causal linear_attention of the case, identity feature map: (B, Hkv, G, L, Ev)."""
    gates = {name: M.asarray(x) for name, x in case.gates().items()}
    return M.to_numpy(M.linear_attention(*(M.asarray(x) for x in (case.scaled_q(), case.k, case.v)),
                                         feature_map="identity", is_causal=True, update_rule=case.rule, **gates,
                                         **options))


def _stepped(M: ModuleType, case: Case, past: bool) -> tuple[np.ndarray, np.ndarray]:
    """M's linear_attention_step position by position, from zeros or from the case's past state: the outputs
    (B, Hkv, G, L, Ev) and the last state S (B, Hkv, G, E, Ev)."""
    S, z = M.linear_attention_state((B, case.Hkv, case.G), E, Ev, dtype=M.asarray(case.q).dtype,
                                    update_rule=case.rule)
    if past:  # ONNX's state is one per key/value head: ours, one per query head, repeats it over the group
        S = M.asarray(np.broadcast_to(case.past[:, :, None], (B, case.Hkv, case.G, E, Ev)).copy())
    outs = []
    for t in range(L):
        gates = {name: M.asarray(x[..., t, :]) for name, x in case.gates().items()}
        out, (S, z) = M.linear_attention_step(*(M.asarray(x[..., t, :]) for x in (case.scaled_q(), case.k, case.v)),
                                              (S, z), feature_map="identity", update_rule=case.rule, **gates)
        outs.append(M.to_numpy(out))
    return np.stack(outs, axis=-2), M.to_numpy(S)


# the layouts and options each rule is checked with, as ONNX allows them; scale is a float32 attribute, so the
# scales are exact in float32
CASES = {
    "heads_per_head_decay": dict(Hkv=2, G=1, decay="head", beta="head"),
    "gqa_per_key_decay_shared_beta": dict(Hkv=2, G=2, decay="key", beta="shared", scale=0.75),
    "mqa_per_key_decay": dict(Hkv=1, G=3, decay="key", beta="head", scale=1.25),
}


@pytest.mark.parametrize("chunk", [None, 2], ids=["recurrence", "chunks_of_2"])
@pytest.mark.parametrize("layout", CASES)
@pytest.mark.parametrize("rule", RULES)
def test_full_sequence_equals_onnx(backend: ModuleType, rule: str, layout: str, chunk: int | None):
    # the recurrence, and chunks of 2 of L = 5 (the last chunk shorter; the delta rules' triangular solve)
    case = Case(rule, **CASES[layout])
    out, _ = _onnx(case.onnx_inputs(), **case.attributes)
    assert_close(_pack(_full(backend, case, chunk=chunk)), out, RTOL, f"{rule} {layout} chunk {chunk}")


@pytest.mark.parametrize("layout", CASES)
@pytest.mark.parametrize("rule", RULES)
def test_steps_from_a_past_state_equal_onnx(backend: ModuleType, rule: str, layout: str):
    case = Case(rule, **CASES[layout], seed=1)
    out, present = _onnx(case.onnx_inputs(past=True), **case.attributes)
    outs, S = _stepped(backend, case, past=True)
    assert_close(_pack(outs), out, RTOL, f"{rule} {layout} outputs")
    for g in range(case.G):  # every query head of a group holds its key/value head's state
        assert_close(S[:, :, g], present, RTOL, f"{rule} {layout} present_state")


@pytest.mark.parametrize("rule", RULES)
def test_steps_from_zeros_equal_the_full_sequence(backend: ModuleType, rule: str):
    case = Case(rule, **CASES["gqa_per_key_decay_shared_beta"], seed=2)
    _, present = _onnx(case.onnx_inputs(), **case.attributes)
    outs, S = _stepped(backend, case, past=False)
    assert_close(outs, _full(backend, case), RTOL, rule)
    assert_close(S[:, :, 0], present, RTOL, f"{rule} present_state")


def test_onnxs_linear_rule_is_our_gated_rule_at_decay_zero_and_our_linear_state(backend: ModuleType):
    # ONNX's "linear" is S_t = S_{t-1} + k_t v_t^T read with no normaliser: our "gated" with g = 0 (exp(0) = 1);
    # our "linear" keeps Katharopoulos et al.'s normaliser, so its state S is ONNX's and its output ONNX's over
    # scale (q_t . z_t + eps), z_t = sum_{j <= t} k_j
    case = Case("gated", Hkv=2, G=2, scale=0.5, seed=3)
    case.decay = np.zeros_like(case.decay)
    attributes = case.attributes | {"update_rule": "linear"}
    inputs = case.onnx_inputs()
    del inputs["decay"]
    out, present = _onnx(inputs, **attributes)
    assert_close(_pack(_full(backend, case)), out, RTOL, "gated at decay 0")
    M = backend
    q, k, v = (np.abs(x) for x in (case.scaled_q(), case.k, case.v))  # positive features: no normaliser near 0
    out, present = _onnx({"query": _pack(q), "key": _pack(k), "value": _pack(v)}, **attributes | {"scale": 1.0})
    state = M.linear_attention_state((B, 2, 2), E, Ev, dtype=M.asarray(q).dtype)
    for t in range(L):
        _, state = M.linear_attention_step(*(M.asarray(x[..., t, :]) for x in (q, k, v)), state,
                                           feature_map="identity")
    assert_close(M.to_numpy(state[0])[:, :, 0], present, RTOL, "linear state")
    den = np.sum(q * np.cumsum(k, axis=-2), axis=-1, keepdims=True) + 1e-6  # q_t . z_t + eps: (B, Hkv, G, L, 1)
    ours = M.to_numpy(M.linear_attention(*(M.asarray(x) for x in (q, k, v)), feature_map="identity", is_causal=True))
    assert_close(_pack(ours * den), out, RTOL, "linear output times its normaliser")


@pytest.mark.parametrize("rule", RULES)
def test_hidden_keys_leave_the_state_as_it_was(backend: ModuleType, rule: str):
    # key_lengths 3 of L = 5: positions 0..2 are ONNX's run on the first three positions; queries 3, 4 read its
    # present_state, S_2, as it was: out_t = scale q_t^T S_2
    case = Case(rule, Hkv=2, G=1, decay="key", seed=4)
    short = Case(rule, Hkv=2, G=1, decay="key", seed=4)
    for name in ("q", "k", "v", "decay", "beta"):
        if getattr(case, name) is not None:
            setattr(short, name, getattr(case, name)[..., :3, :])
    out, present = _onnx(short.onnx_inputs(), **short.attributes)
    after = np.einsum("bhgte,bhev->bhgtv", case.scaled_q()[..., 3:, :], present)  # q_t^T S_2
    for chunk in (None, 2):
        ours = _full(backend, case, key_lengths=backend.asarray(np.array(3)), chunk=chunk)
        assert_close(_pack(ours[..., :3, :]), out, RTOL, f"{rule} before key_lengths, chunk {chunk}")
        assert_close(ours[..., 3:, :], after, RTOL, f"{rule} after key_lengths, chunk {chunk}")


def test_delta_rules_by_hand(backend: ModuleType):
    # identity map, E = 2, Ev = 1, beta = 1/2, q_t = (1, 1); k_1 = (1, 0), v_1 = 4; k_2 = (0.6, 0.8), v_2 = 6.
    # delta: u_1 = 1/2 (4 - 0) = 2, S_1 = (2, 0)^T, out_1 = 2; r_2 = S_1 . k_2 = 1.2, u_2 = 1/2 (6 - 1.2) = 2.4,
    #   S_2 = S_1 + 2.4 k_2 = (3.44, 1.92)^T, out_2 = 5.36.
    # gated_delta at g = log(1/2): S_1 as above (S_0 = 0); P_2 = S_1 / 2 = (1, 0)^T, r_2 = 0.6,
    #   u_2 = 1/2 (6 - 0.6) = 2.7, S_2 = (1 + 1.62, 2.16)^T, out_2 = 4.78.
    # gated at g = log(1/2): S_1 = 4 k_1 = (4, 0)^T, out_1 = 4; S_2 = (2, 0)^T + 6 k_2 = (5.6, 4.8)^T, out_2 = 10.4
    M = backend
    q, k, v = np.ones((2, 2)), np.array([[1.0, 0.0], [0.6, 0.8]]), np.array([[4.0], [6.0]])
    beta, g = np.full((2, 1), 0.5), np.full((2, 1), np.log(0.5))
    expected = {"delta": ([[2.0], [5.36]], {"beta": beta}), "gated_delta": ([[2.0], [4.78]], {"beta": beta,
                                                                                              "decay": g}),
                "gated": ([[4.0], [10.4]], {"decay": g})}
    for rule, (want, gates) in expected.items():
        for chunk in (None, 2):  # one position at a time, and one chunk of both
            out = M.linear_attention(*(M.asarray(x) for x in (q, k, v)), feature_map="identity", is_causal=True,
                                     chunk=chunk, update_rule=rule, **{name: M.asarray(x) for name, x in gates.items()})
            np.testing.assert_allclose(M.to_numpy(out), want, rtol=1e-14, err_msg=f"{rule} chunk {chunk}")


def test_the_float64_run_is_onnxs_run():
    # the evaluator as it ships computes in float32: it agrees with the float64 run of its code to float32
    # rounding, and no closer (so the float64 run is needed to hold the backends to 1e-12)
    case = Case("gated_delta", Hkv=2, G=2, decay="key", seed=5)
    inputs = case.onnx_inputs(past=True)
    out64, present64 = _onnx(inputs, **case.attributes)
    out32, present32 = _onnx({name: x.astype(np.float32) for name, x in inputs.items()}, float64=False,
                             **case.attributes)
    assert out32.dtype == np.float32 and out64.dtype == np.float64
    assert_close(out32, out64, 1e-5, "float32 output")
    assert_close(present32, present64, 1e-5, "float32 state")
    assert np.max(np.abs(out32 - out64)) > 1e-9


@pytest.mark.parametrize("rule", RULES)
def test_step_never_changes_the_state_it_is_given(backend: ModuleType, rule: str):
    M, case = backend, Case(rule, Hkv=2, G=1, seed=6)
    S = M.asarray(case.past[:, :, None].copy())
    kept = M.to_numpy(S).copy()
    gates = {name: M.asarray(x[..., 0, :]) for name, x in case.gates().items()}
    _, (new, z) = M.linear_attention_step(*(M.asarray(x[..., 0, :]) for x in (case.q, case.k, case.v)), (S, None),
                                          update_rule=rule, **gates)
    np.testing.assert_array_equal(M.to_numpy(S), kept)
    assert z is None and not np.array_equal(M.to_numpy(new), kept)


def _numeric(f, inputs: list[np.ndarray], d_out: np.ndarray, h: float = 1e-6) -> list[np.ndarray]:
    """d <f(*inputs), d_out> / d input, entry by entry, by central differences."""
    grads = []
    for index, x in enumerate(inputs):
        grad = np.zeros_like(x)
        for at in np.ndindex(*x.shape):
            moved = [[y.copy() for y in inputs] for _ in range(2)]
            moved[0][index][at] += h
            moved[1][index][at] -= h
            grad[at] = (np.sum(d_out * f(*moved[0])) - np.sum(d_out * f(*moved[1]))) / (2 * h)
        grads.append(grad)
    return grads


@pytest.mark.parametrize(("rule", "width", "chunk"), [("gated", 2, None), ("gated", 1, 3), ("delta", 1, None),
                                                      ("delta", 1, 3), ("gated_delta", 2, 3), ("gated_delta", 1, None)])
def test_vjp_against_central_differences(backend: ModuleType, rule: str, width: int, chunk: int | None):
    # NumPy's backward pass by hand (the recurrence's, also for the chunks), JAX's and torch's by autodiff of
    # their form; elu + 1 on inputs away from its kink at 0, key_lengths hiding the last key of sequence 1,
    # decay and beta broadcast over the batch
    M, rng = backend, np.random.default_rng(7)
    q, k = (np.sign(x) * (0.2 + np.abs(x)) for x in rng.standard_normal((2, 2, 4, 2)))
    v = rng.standard_normal((2, 4, 3))
    gated, delta = validation.UPDATE_RULES[rule]
    gates = {**({"decay": -rng.uniform(0.05, 1.0, (2, 4, width))} if gated else {}),
             **({"beta": rng.uniform(0.1, 0.9, (1, 4, 1))} if delta else {})}
    options = dict(is_causal=True, update_rule=rule, key_lengths=np.array([4, 3]), chunk=chunk)

    def forward(q, k, v, *given):  # NumPy's forward, which equals ONNX's (above)
        numpy = import_backend("attention_np")
        return numpy.linear_attention(q, k, v, **options, **dict(zip(gates, given, strict=True)))

    d_out = rng.standard_normal((2, 4, 3))
    inputs = [q, k, v, *gates.values()]
    _, pullback = M.linear_attention_vjp(*(M.asarray(x) for x in (q, k, v)), **options | {
        "key_lengths": M.asarray(options["key_lengths"])}, **{name: M.asarray(x) for name, x in gates.items()})
    grads = [M.to_numpy(g) for g in pullback(M.asarray(d_out))]
    assert len(grads) == len(inputs)
    for name, grad, numeric in zip(["dq", "dk", "dv", *(f"d_{name}" for name in gates)], grads,
                                   _numeric(forward, inputs, d_out), strict=True):
        assert_close(grad, numeric, 1e-7, f"{rule} {name}")
    assert not grads[1][1, 3].any() and not grads[2][1, 3].any()  # the hidden key's dk and dv
    if gated:
        assert not grads[3][1, 3].any()  # and its decay's


def _errors(M: ModuleType) -> dict[str, tuple[str, ...]]:
    """Each bad call of the rules, with the words its ValueError holds."""
    x, v = M.asarray(np.ones((2, 4, 3))), M.asarray(np.ones((2, 4, 5)))
    g, b = M.asarray(-np.ones((2, 4, 1))), M.asarray(np.ones((2, 4, 1)) / 2)
    t, gt = x[:, 0, :], g[:, 0, :]

    def full(**options):
        return lambda: M.linear_attention(x, x, v, is_causal=True, **options)

    def step(state, **options):
        return lambda: M.linear_attention_step(t, t, v[:, 0, :], state, **options)

    state = M.linear_attention_state((2,), 3, 5, dtype=x.dtype, update_rule="gated")
    return {
        "unknown rule": (full(update_rule="retention"), "update_rule", "retention", "gated_delta"),
        "unknown rule of the state": (lambda: M.linear_attention_state((2,), 3, 5, update_rule="mamba"),
                                      "update_rule", "mamba"),
        "gated without decay": (full(update_rule="gated"), "decay", "gated"),
        "delta without beta": (full(update_rule="delta"), "beta", "delta"),
        "gated_delta without beta": (full(update_rule="gated_delta", decay=g), "beta", "gated_delta"),
        "delta given decay": (full(update_rule="delta", beta=b, decay=g), "decay", "(2, 4, 1)"),
        "linear given beta": (full(beta=b), "beta", "'linear'", "(2, 4, 1)"),
        "decay width": (full(update_rule="gated", decay=M.asarray(-np.ones((2, 4, 2)))), "decay", "(2, 4, 2)",
                        "E = 3"),
        "decay positions": (full(update_rule="gated", decay=g[:, :3]), "decay", "(2, 3, 1)", "S = 4"),
        "decay batch": (full(update_rule="gated", decay=M.asarray(-np.ones((3, 4, 1)))), "decay", "(3, 4, 1)",
                        "(2,)"),
        "beta per key": (full(update_rule="delta", beta=M.asarray(np.ones((2, 4, 3)))), "beta", "(2, 4, 3)"),
        "not causal": (lambda: M.linear_attention(x, x, v, update_rule="gated", decay=g), "is_causal", "gated"),
        "step decay shape": (step(state, update_rule="gated", decay=g[:, :2, 0]), "decay", "(2, 2)"),
        "step without decay": (step(state, update_rule="gated"), "decay", "gated"),
        "step state of linear": (step(M.linear_attention_state((2,), 3, 5, dtype=x.dtype), update_rule="gated",
                                      decay=gt), "state", "(S, None)"),
        "step state of gated under linear": (step(state), "state", "(S, z)"),
    }


def test_errors_name_the_argument_and_shapes(backend: ModuleType):
    for case, (call, *words) in _errors(backend).items():
        with pytest.raises(ValueError) as raised:
            call()
        assert type(raised.value) is ValueError, case
        for word in words:
            assert word in str(raised.value), f"{case}: {word!r} not in {raised.value}"


def _decay_after_the_update(S, phi_q, phi_k, v, g, beta):
    """Planted bug: the decay applied after the update (S' = exp(g) (S + phi(k) u^T), u off the undecayed S)."""
    if beta is not None:
        v = beta * (v - (phi_k[..., None, :] @ S)[..., 0, :])
    S = S + phi_k[..., :, None] * v[..., None, :]
    S = S if g is None else np.exp(g)[..., :, None] * S
    return (phi_q[..., None, :] @ S)[..., 0, :], S


def _beta_on_the_key(S, phi_q, phi_k, v, g, beta):
    """Planted bug: beta scaling the key that reads the state, not the error (u = v - S^T (beta phi(k)))."""
    S = S if g is None else np.exp(g)[..., :, None] * S
    if beta is not None:
        v = v - ((beta * phi_k)[..., None, :] @ S)[..., 0, :]
    S = S + phi_k[..., :, None] * v[..., None, :]
    return (phi_q[..., None, :] @ S)[..., 0, :], S


_RULE_CHUNK = importlib.import_module("attention_np.linear")._rule_chunk


def _chunk_state_undecayed(S, phi_q, phi_k, v, b, beta):
    """Planted bug: the state handed to the next chunk without the chunk's decay (b read as 0 for it)."""
    return _RULE_CHUNK(S, phi_q, phi_k, v, b, beta)[0], _RULE_CHUNK(S, phi_q, phi_k, v, 0 * b, beta)[1]


@pytest.mark.parametrize(("bug", "chunk"), [(_decay_after_the_update, None), (_beta_on_the_key, None),
                                            (_chunk_state_undecayed, 2)])
def test_the_comparisons_catch_planted_bugs(monkeypatch: pytest.MonkeyPatch, bug, chunk: int | None):
    # NumPy's rule step (or chunk) replaced by a broken one: the ONNX comparisons of the full sequence and of the
    # steps, and the case by hand, each fail (the steps and the hand case of two positions never carry a chunk's
    # state, so the chunk's bug is the full sequence's alone)
    M = import_backend("attention_np")
    name = "_rule_step" if chunk is None else "_rule_chunk"
    monkeypatch.setattr(importlib.import_module("attention_np.linear"), name, bug)
    rule = "delta" if bug is _beta_on_the_key else "gated_delta"
    checks = [lambda: test_full_sequence_equals_onnx(M, rule, "gqa_per_key_decay_shared_beta", chunk)]
    if chunk is None:
        checks += [lambda: test_steps_from_a_past_state_equal_onnx(M, rule, "heads_per_head_decay"),
                   lambda: test_delta_rules_by_hand(M)]
    for check in checks:
        with pytest.raises(AssertionError):
            check()


def test_half_precision_returns_its_dtype(backend: ModuleType):
    # float16 inputs, decay and beta: computed in float32 and cast back, within float16's rounding of the inputs
    # and the output of the float64 result
    M, case = backend, Case("gated_delta", Hkv=2, G=1, decay="key", seed=8)
    expected = _full(M, case)
    case.q, case.k, case.v, case.decay, case.beta = (x.astype(np.float16) for x in (case.q, case.k, case.v,
                                                                                    case.decay, case.beta))
    for chunk in (None, 2):
        out = _full(M, case, chunk=chunk)
        assert out.dtype == np.float16
        assert_close(out.astype(np.float64), expected, 5e-3, f"float16, chunk {chunk}")
