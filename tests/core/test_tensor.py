"""polyrl.tensor: every helper on numpy, torch and jax (float64) with hand-computed cases,
torch = jax gradients, and the no-framework-at-import rule."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from polyrl import tensor as pt

# float64; numpy / torch / jax differ only by op order and libm last-bit rounding
# (~1e-16 relative per op, tens of ops): 1e-12 leaves ~1000x margin.
PARITY = dict(rtol=1e-12, atol=1e-12)
# hand-computed values (written with math.* in the test)
HAND = dict(rtol=1e-12, atol=1e-12)
BACKENDS = ("numpy", "torch", "jax")


@pytest.fixture(autouse=True)
def _jax_x64():
    """64-bit JAX for these tests only (a context, not the process-wide config update, so
    other tests in the same process keep JAX's float32 default)."""
    import jax

    with jax.enable_x64(True):
        yield


def arr(kind, a, dtype=np.float64):
    a = np.asarray(a, dtype=dtype)
    if kind == "numpy":
        return a
    if kind == "torch":
        import torch

        return torch.from_numpy(a.copy())
    import jax.numpy as jnp

    return jnp.asarray(a)


def native(kind, x) -> bool:
    if kind == "numpy":
        return isinstance(x, np.ndarray | np.generic)
    if kind == "torch":
        import torch

        return isinstance(x, torch.Tensor)
    import jax

    return isinstance(x, jax.Array)


def call(kind, fn, *arrays):
    """fn(*arrays); jax under jit (as the backend runs it, and one compile instead of one per
    primitive and shape). Eager jax is covered by test_hand_values."""
    if kind == "jax":
        import jax

        return jax.jit(fn)(*arrays)
    return fn(*arrays)


def grads(kind, fn, *args):
    """Gradients of the scalar fn(*arrays) w.r.t. every argument."""
    if kind == "torch":
        import torch

        ts = [
            torch.from_numpy(np.asarray(a, dtype=np.float64).copy()).requires_grad_(True)
            for a in args
        ]
        fn(*ts).backward()
        return [t.grad.numpy() for t in ts]
    import jax

    js = [arr("jax", a) for a in args]
    return [np.asarray(g) for g in jax.jit(jax.grad(fn, argnums=tuple(range(len(js)))))(*js)]


def total(x):
    return pt.namespace(x).sum(x)


RNG = np.random.default_rng(0)
X = RNG.normal(size=(3, 4, 5)) * 3
X2 = RNG.normal(size=(4, 6))
MASK = (RNG.uniform(size=(4, 6)) < 0.7).astype(np.float64)
MASK[0, 0] = 1.0
MASK[1, 1] = 0.0
IDS = RNG.integers(0, 5, size=(3, 4))

# name -> (fn(kind, *arrays), numpy inputs); each returns an array of the input's kind
CASES = {
    "logsumexp": (lambda k, x: pt.logsumexp(x, axis=-1), (X,)),
    "logsumexp_axis0_keepdims": (lambda k, x: pt.logsumexp(x, axis=0, keepdims=True), (X,)),
    "log_softmax": (lambda k, x: pt.log_softmax(x, axis=1), (X,)),
    "log_sigmoid": (lambda k, x: pt.log_sigmoid(x * 100), (X,)),
    "gather_log_probs": (lambda k, x: pt.gather_log_probs(x, arr(k, IDS, np.int64)), (X,)),
    "gather_log_probs_temp": (
        lambda k, x: pt.gather_log_probs(x, arr(k, IDS, np.int32), 0.7),
        (X,),
    ),
    "entropy_from_logits": (lambda k, x: pt.entropy_from_logits(x), (X,)),
    "masked_sum": (lambda k, x, m: pt.masked_sum(x, m), (X2, MASK)),
    "masked_sum_axis": (lambda k, x, m: pt.masked_sum(x, m, axis=-1), (X2, MASK)),
    "masked_mean": (lambda k, x, m: pt.masked_mean(x, m), (X2, MASK)),
    "masked_mean_axis": (lambda k, x, m: pt.masked_mean(x, m, axis=0), (X2, MASK)),
    "masked_var": (lambda k, x, m: pt.masked_var(x, m), (X2, MASK)),
    "masked_var_biased": (lambda k, x, m: pt.masked_var(x, m, unbiased=False), (X2, MASK)),
    "masked_whiten": (lambda k, x, m: pt.masked_whiten(x, m), (X2, MASK)),
    "masked_whiten_noshift": (lambda k, x, m: pt.masked_whiten(x, m, shift_mean=False), (X2, MASK)),
    "where": (lambda k, x, m: pt.where(m > 0, x, 0.5), (X2, MASK)),
    "clip_scalars": (lambda k, x: pt.clip(x, -0.5, 0.7), (X2,)),
    "clip_arrays": (lambda k, x, m: pt.clip(x, m - 1.0, m), (X2, MASK)),
    "clip_one_side": (lambda k, x: pt.clip(x, None, 0.1), (X2,)),
    "stop_gradient": (lambda k, x: pt.stop_gradient(x) * 2.0, (X2,)),
    "reverse_linear_scan": (lambda k, x: pt.reverse_linear_scan(x, 0.9), (X2,)),
    "reverse_linear_scan_array": (lambda k, x, m: pt.reverse_linear_scan(x, m * 0.5), (X2, MASK)),
    "shift_left": (lambda k, x: pt.shift_left(x, fill=-1.0), (X2,)),
    "asarray_like": (lambda k, x: pt.asarray_like(np.arange(3), x), (X2,)),
}


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_parity(kind, case):
    fn, inputs = CASES[case]
    ref = fn("numpy", *(arr("numpy", a) for a in inputs))
    out = call(kind, lambda *a: fn(kind, *a), *(arr(kind, a) for a in inputs))
    assert native(kind, out), f"{case} on {kind} returned {type(out)}"
    np.testing.assert_allclose(pt.to_numpy(out), ref, **PARITY)


GRAD_CASES = {
    "logsumexp": (
        lambda x: total(pt.logsumexp(x) * pt.asarray_like(np.arange(12.0).reshape(3, 4), x)),
        X,
    ),
    "log_softmax": (lambda x: total(pt.log_softmax(x) * pt.asarray_like(np.sin(X), x)), X),
    "log_sigmoid": (lambda x: total(pt.log_sigmoid(x)), X),
    "gather_log_probs": (
        lambda x: total(pt.gather_log_probs(x, pt.asarray_like(IDS, x, "int64"), 1.3)),
        X,
    ),
    "entropy": (lambda x: total(pt.entropy_from_logits(x)), X),
    "masked_mean": (lambda x: pt.masked_mean(x**2, pt.asarray_like(MASK, x)), X2),
    "masked_whiten": (lambda x: total(pt.masked_whiten(x, pt.asarray_like(MASK, x)) * x), X2),
    "reverse_linear_scan": (lambda x: total(pt.reverse_linear_scan(x, x * 0.1) ** 2), X2),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_torch_equal_jax(case):
    fn, x = GRAD_CASES[case]
    if case == "gather_log_probs":  # dtype names differ per framework
        fn = _gather_grad_fn
    (gt,) = grads("torch", fn, x)
    (gj,) = grads("jax", fn, x)
    np.testing.assert_allclose(gt, gj, **PARITY)
    assert np.abs(gt).sum() > 0


def _gather_grad_fn(x):
    xp = pt.namespace(x)
    return total(pt.gather_log_probs(x, pt.asarray_like(IDS, x, xp.int64), 1.3))


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # numpy: log(0) = -inf
@pytest.mark.parametrize("kind", BACKENDS)
def test_hand_values(kind):
    a = lambda v: arr(kind, v)  # noqa: E731
    f = lambda x: pt.to_numpy(x)  # noqa: E731
    ln = math.log
    # logsumexp: log(1 + 3) = ln 4; stable for large values; -inf entries and rows
    np.testing.assert_allclose(f(pt.logsumexp(a([0.0, ln(3.0)]))), ln(4.0), **HAND)
    np.testing.assert_allclose(f(pt.logsumexp(a([1000.0, 1000.0]))), 1000.0 + ln(2.0), **HAND)
    np.testing.assert_allclose(f(pt.logsumexp(a([-np.inf, 0.0]))), 0.0, **HAND)
    assert f(pt.logsumexp(a([-np.inf, -np.inf]))) == -np.inf
    # log_softmax([0, ln 3]) = (ln 1/4, ln 3/4)
    np.testing.assert_allclose(f(pt.log_softmax(a([0.0, ln(3.0)]))), [ln(0.25), ln(0.75)], **HAND)
    # log_sigmoid(0) = -ln 2; no overflow at +-1000
    np.testing.assert_allclose(
        f(pt.log_sigmoid(a([0.0, -1000.0, 1000.0]))), [-ln(2.0), -1000.0, 0.0], **HAND
    )
    # gather: p(id 1) = 3 / 4; at temperature 2 the logits are (0, ln 3 / 2): sqrt3 / (1 + sqrt3)
    logits, ids = a([[[0.0, ln(3.0)]]]), arr(kind, [[1]], np.int64)
    np.testing.assert_allclose(f(pt.gather_log_probs(logits, ids)), [[ln(0.75)]], **HAND)
    s3 = math.sqrt(3.0)
    np.testing.assert_allclose(
        f(pt.gather_log_probs(logits, ids, temperature=2.0)), [[ln(s3 / (1.0 + s3))]], **HAND
    )
    # entropy: uniform over 4 = ln 4; a -inf logit contributes 0; large logits are stable
    np.testing.assert_allclose(
        f(pt.entropy_from_logits(a([[1.0, 1.0, 1.0, 1.0], [1000.0, 1000.0, -np.inf, -np.inf]]))),
        [ln(4.0), ln(2.0)],
        **HAND,
    )
    # masked_sum ignores a NaN under the mask; float masks weight
    np.testing.assert_allclose(
        f(pt.masked_sum(a([1.0, 2.0, np.nan]), a([1.0, 1.0, 0.0]))), 3.0, **HAND
    )
    # masked_mean with weights (0.5, 1): (0.5 * 2 + 4) / 1.5 = 10 / 3; empty mask -> 0
    np.testing.assert_allclose(f(pt.masked_mean(a([2.0, 4.0]), a([0.5, 1.0]))), 10.0 / 3.0, **HAND)
    assert f(pt.masked_mean(a([2.0, 4.0]), a([0.0, 0.0]))) == 0.0
    np.testing.assert_allclose(
        f(pt.masked_mean(a([[1.0, 3.0], [5.0, 7.0]]), a([[1.0, 1.0], [0.0, 0.0]]), axis=-1)),
        [2.0, 0.0],
        **HAND,
    )
    # masked_var of (1, 2, 3) (10 masked out): mean 2, biased 2/3, unbiased 1; one entry -> 0
    x, m = a([1.0, 2.0, 3.0, 10.0]), a([1.0, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(f(pt.masked_var(x, m)), 1.0, **HAND)
    np.testing.assert_allclose(f(pt.masked_var(x, m, unbiased=False)), 2.0 / 3.0, **HAND)
    assert f(pt.masked_var(x, a([1.0, 0.0, 0.0, 0.0]))) == 0.0
    # masked_whiten of (1, 2, 3): (x - 2) / sqrt(1 + 1e-8); + 2 without the shift
    w = (np.array([1.0, 2.0, 3.0, 10.0]) - 2.0) / math.sqrt(1.0 + 1e-8)
    np.testing.assert_allclose(f(pt.masked_whiten(x, m)), w, **HAND)
    np.testing.assert_allclose(f(pt.masked_whiten(x, m, shift_mean=False)), w + 2.0, **HAND)
    np.testing.assert_array_equal(f(pt.masked_whiten(a([5.0, 5.0]), a([1.0, 1.0]))), [0.0, 0.0])
    # reverse scan: y2 = 3, y1 = 2 + 0.5 * 3 = 3.5, y0 = 1 + 0.5 * 3.5 = 2.75
    np.testing.assert_allclose(
        f(pt.reverse_linear_scan(a([[1.0, 2.0, 3.0]]), 0.5)), [[2.75, 3.5, 3.0]], **HAND
    )
    # decay (0, 1, 1): y2 = 3, y1 = 2 + 3 = 5, y0 = 1 + 0 * 5 = 1
    np.testing.assert_allclose(
        f(pt.reverse_linear_scan(a([[1.0, 2.0, 3.0]]), a([[0.0, 1.0, 1.0]]))),
        [[1.0, 5.0, 3.0]],
        **HAND,
    )
    np.testing.assert_allclose(f(pt.shift_left(a([[1.0, 2.0, 3.0]]))), [[2.0, 3.0, 0.0]], **HAND)
    np.testing.assert_allclose(f(pt.clip(a([-2.0, 0.0, 2.0]), -1.0, 1.0)), [-1.0, 0.0, 1.0], **HAND)
    np.testing.assert_allclose(
        f(pt.where(a([1.0, 0.0]) > 0, a([5.0, 6.0]), -1.0)), [5.0, -1.0], **HAND
    )
    like = pt.asarray_like([1, 2], a([0.0]))
    assert native(kind, like) and f(like).dtype == np.float64 and f(like).tolist() == [1.0, 2.0]
    assert str(pt.device_of(a([0.0]))).lower().startswith("cpu")
    assert isinstance(pt.to_numpy(a([0.0])), np.ndarray)


def test_to_numpy_bfloat16():
    import torch

    x = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    np.testing.assert_array_equal(pt.to_numpy(x), [1.5, -2.0])


def test_entropy_gradient_finite_with_neg_inf():
    x = np.array([[0.5, -np.inf, 1.0]])
    for kind in ("torch", "jax"):
        (g,) = grads(kind, lambda z: total(pt.entropy_from_logits(z)), x)
        assert np.isfinite(g).all(), kind
        assert g[0, 1] == 0.0


@pytest.mark.parametrize("kind", ("torch", "jax"))
def test_stop_gradient_blocks(kind):
    (g,) = grads(kind, lambda z: total(pt.stop_gradient(z) * z), np.array([2.0, 3.0]))
    np.testing.assert_allclose(g, [2.0, 3.0], **HAND)  # d(sg(z) z)/dz = sg(z)


def test_namespace():
    import jax.numpy as jnp

    assert pt.namespace(arr("numpy", [1.0])).__name__ == "array_api_compat.numpy"
    assert pt.namespace(arr("torch", [1.0]), None, 2.0).__name__ == "array_api_compat.torch"
    assert pt.namespace(arr("jax", [1.0])) is jnp
    with pytest.raises(TypeError):
        pt.namespace(arr("numpy", [1.0]), arr("torch", [1.0]))
    with pytest.raises(ValueError, match="needs at least one array"):
        pt.namespace(None, 1.0)


@pytest.mark.parametrize("kind", BACKENDS)
def test_errors(kind):
    a, b = arr(kind, np.ones((2, 3))), arr(kind, np.ones((2, 4)))
    with pytest.raises(
        ValueError, match=r"mask has shape \(2, 4\) but the values have shape \(2, 3\)"
    ):
        pt.masked_mean(a, b)
    with pytest.raises(
        ValueError, match=r"gather_log_probs: logits has shape \(2, 3\) and ids \(2, 4\)"
    ):
        pt.gather_log_probs(a, b)
    with pytest.raises(
        ValueError, match=r"reverse_linear_scan: decay has shape \(2, 4\) but x has \(2, 3\)"
    ):
        pt.reverse_linear_scan(a, b)


def test_no_framework_imported_at_module_level():
    code = (
        "import sys, polyrl.tensor, polyrl.algos, polyrl.algos.registry; "
        "bad = [m for m in ('torch', 'jax', 'flax', 'optax', 'ray', 'vllm', 'gin') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
