"""polyrl.algos.losses: parity (numpy = torch = jax), gradients (torch = jax), hand-computed
cases, micro-batch invariance and error messages."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyrl.algos import losses as L

# float64 everywhere; the three frameworks differ only by operation order and libm
# last-bit rounding (~1e-16 relative per op, tens of ops): 1e-12 leaves ~1000x margin.
PARITY = dict(rtol=1e-12, atol=1e-12)
# Hand-computed numbers are written to >= 7 significant digits or computed with math.*
# in the test: 1e-9 is far below any formula mistake.
HAND = dict(rtol=1e-9, atol=1e-9)
APPROX = dict(rel=1e-9, abs=1e-9)  # the same, for pytest.approx
# Re-batching sums 8 contributions instead of one sum: pure float64 reassociation.
REBATCH = dict(rtol=1e-12, atol=1e-13)

MODES = list(L.AGG_MODES)


def policy_inputs(seed: int = 0, B: int = 8, T: int = 6):
    """Log-probs with log-ratios in [-2, 2] (every clip is hit), +- advantages, a ragged
    mask with one fully masked row. One shape ([8, 6], micro-batches of 1 and 2 rows) across
    the algos tests: jax compiles every op once per shape, and that dominates the runtime."""
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 3.0, size=(B, T))
    new = old + rng.uniform(-2.0, 2.0, size=(B, T))
    adv = rng.normal(size=(B, T))
    mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float64)
    mask[0, 0] = 1.0
    mask[-1] = 0.0
    return new, old, adv, mask


def as_np(bk, out):
    if isinstance(out, tuple):
        return tuple(as_np(bk, o) for o in out)
    if isinstance(out, dict):
        return {k: as_np(bk, v) for k, v in out.items()}
    assert bk.is_native(out), f"{bk} function returned {type(out)}"
    return bk.numpy(out)


def assert_tree_close(a, b, **tol):
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            assert_tree_close(x, y, **tol)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_tree_close(a[k], b[k], **tol)
    else:
        np.testing.assert_allclose(a, b, **tol)


# --------------------------------------------------------------------------- parity


def _loss_cases():
    new, old, adv, mask = policy_inputs()
    values = new * 0.7
    returns = adv + 0.1
    return {
        "ppo": (
            lambda a, b, c, m: L.ppo_policy_loss(a, b, c, m, 0.2, 0.28, 3.0),
            (new, old, adv, mask),
        ),
        "ppo_nodual_seqmean": (
            lambda a, b, c, m: L.ppo_policy_loss(
                a, b, c, m, dual_clip=None, agg="seq-mean-token-mean"
            ),
            (new, old, adv, mask),
        ),
        "gspo": (
            lambda a, b, c, m: L.gspo_policy_loss(a, b, c, m, 0.1, 0.1),
            (new, old, adv, mask),
        ),
        "cispo": (
            lambda a, b, c, m: L.cispo_policy_loss(a, b, c, m, 0.5, 0.2),
            (new, old, adv, mask),
        ),
        "value": (lambda v, o, r, m: L.value_loss(v, o, r, m, 0.2), (values, old, returns, mask)),
        "value_noclip": (
            lambda v, o, r, m: L.value_loss(v, o, r, m, None, "seq-mean-token-sum"),
            (values, old, returns, mask),
        ),
    }


@pytest.mark.parametrize("case", list(_loss_cases()))
def test_policy_and_value_losses_parity(bk, backends, case):
    fn, args = _loss_cases()[case]
    ref = as_np(backends["numpy"], fn(*(backends["numpy"].asarray(a) for a in args)))
    out = as_np(bk, bk.call(fn, *(bk.asarray(a) for a in args)))
    assert_tree_close(out, ref, **PARITY)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norms", [(None, None), (37.0, 9.0)])
def test_aggregate_parity(bk, backends, mode, norms):
    new, _, _, mask = policy_inputs(1)

    def agg(x, m):
        return L.aggregate(x, m, mode, *norms)

    def run(b):
        return as_np(b, b.call(agg, b.asarray(new), b.asarray(mask)))

    np.testing.assert_allclose(run(bk), run(backends["numpy"]), **PARITY)


@pytest.mark.parametrize("kind", list(L.KL_KINDS))
def test_kl_penalty_parity(bk, backends, kind):
    new, old, _, _ = policy_inputs(2)
    new = new.copy()
    new[0, 0] = old[0, 0] - 30.0  # hits k3's +-20 / +-10 clamps

    def kl(x, y):
        return L.kl_penalty(x, y, kind)

    def run(b):
        return as_np(b, b.call(kl, b.asarray(new), b.asarray(old)))

    np.testing.assert_allclose(run(bk), run(backends["numpy"]), **PARITY)


@pytest.mark.parametrize("kind", list(L.DPO_KINDS))
def test_dpo_parity(bk, backends, kind):
    rng = np.random.default_rng(3)
    args = [rng.normal(size=4) * 5 for _ in range(4)]
    ls = 0.1 if kind == "sigmoid" else 0.0

    def run(b):
        return as_np(
            b,
            b.call(
                lambda *a: L.dpo_loss(*a, beta=0.3, kind=kind, label_smoothing=ls),
                *(b.asarray(a) for a in args),
            ),
        )

    assert_tree_close(run(bk), run(backends["numpy"]), **PARITY)


def test_jax_eager_equals_jit(backends):
    """The suite runs jax under jit (as the backend does); eager jax must agree."""
    jx = backends["jax"]
    for case in ("ppo",):  # one is enough: eager jax compiles each primitive (slow)
        fn, args = _loss_cases()[case]
        arrays = [jx.asarray(a) for a in args]
        assert_tree_close(as_np(jx, fn(*arrays)), as_np(jx, jx.call(fn, *arrays)), **PARITY)


# --------------------------------------------------------------------------- gradients


def _scalar_cases():
    """Scalar functions of float arrays whose gradients torch and jax must agree on."""
    new, old, adv, mask = policy_inputs(4)

    def first(fn):
        return lambda *a: fn(*a)[0]

    cases = {
        "ppo": (
            first(lambda n, o, a: L.ppo_policy_loss(n, o, a, _m(n, mask), 0.2, 0.28, 3.0)),
            (new, old, adv),
        ),
        "ppo_seq_sum_norm": (
            first(
                lambda n, o, a: L.ppo_policy_loss(
                    n, o, a, _m(n, mask), agg="seq-mean-token-sum-norm", dual_clip=None
                )
            ),
            (new, old, adv),
        ),
        "gspo": (
            first(lambda n, o, a: L.gspo_policy_loss(n, o, a, _m(n, mask), 0.1, 0.1)),
            (new, old, adv),
        ),
        "cispo": (
            first(lambda n, o, a: L.cispo_policy_loss(n, o, a, _m(n, mask), 0.5, 0.2)),
            (new, old, adv),
        ),
        "value": (
            first(lambda v, o, r: L.value_loss(v, o, r, _m(v, mask), 0.3)),
            (new * 0.5, old * 0.5, adv),
        ),
        "entropy": (lambda x: _sum(L.entropy_from_logits(x)), (np.stack([new, old, adv], -1),)),
    }
    for kind in L.KL_KINDS:
        cases[f"kl_{kind}"] = (
            lambda n, r, kind=kind: L.aggregate(L.kl_penalty(n, r, kind), _m(n, mask)),
            (new, old),
        )
    rng = np.random.default_rng(5)
    pairs = tuple(rng.normal(size=4) * 3 for _ in range(4))
    for kind in L.DPO_KINDS:
        ls = 0.2 if kind == "sigmoid" else 0.0
        cases[f"dpo_{kind}"] = (
            lambda *a, kind=kind, ls=ls: _sum(L.dpo_loss(*a, 0.4, kind, ls)[0]),
            pairs,
        )
    return cases


def _m(like, mask):
    """The mask as an array of ``like``'s framework."""
    from polyrl.tensor import asarray_like

    return asarray_like(mask, like)


def _sum(x):
    from polyrl.tensor import namespace

    return namespace(x).sum(x)


@pytest.mark.parametrize("case", list(_scalar_cases()))
def test_gradients_torch_equal_jax(backends, case):
    fn, args = _scalar_cases()[case]
    g_torch = backends["torch"].grad(fn, *args)
    g_jax = backends["jax"].grad(fn, *args)
    for gt, gj in zip(g_torch, g_jax, strict=True):
        np.testing.assert_allclose(gt, gj, **PARITY)
    assert any(np.abs(g).sum() > 0 for g in g_torch), "degenerate case: all gradients zero"


# --------------------------------------------------------------------------- hand-computed


AGG_LOSS = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
AGG_MASK = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 3 fully masked


@pytest.mark.parametrize(
    ("mode", "local", "global_"),
    [
        # valid entries: row 1 -> 1, 2; row 2 -> 4; row 3 none. 3 tokens, 2 sequences.
        ("token-mean", (1 + 2 + 4) / 3, (1 + 2 + 4) / 10),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2, ((1 + 2) + 4) / 4),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2, ((1 + 2) / 2 + 4 / 1) / 4),
        # token sums divided by T = 3, then by the sequence count
        ("seq-mean-token-sum-norm", ((1 + 2) / 3 + 4 / 3) / 2, ((1 + 2) / 3 + 4 / 3) / 4),
    ],
)
def test_aggregate_hand(bk, mode, local, global_):
    x, m = bk.asarray(AGG_LOSS), bk.asarray(AGG_MASK)
    both = bk.call(
        lambda x, m: (
            L.aggregate(x, m, mode),
            L.aggregate(x, m, mode, global_tokens=10.0, global_seqs=4.0),
        ),
        x,
        m,
    )
    assert float(bk.numpy(both[0])) == pytest.approx(local, abs=1e-12)
    assert float(bk.numpy(both[1])) == pytest.approx(global_, abs=1e-12)


def test_aggregate_norm_len_and_empty(bk):
    x, m = bk.asarray(AGG_LOSS), bk.asarray(AGG_MASK)
    # (3 / 6 + 4 / 6) / 2 = 7 / 12
    got = L.aggregate(x, m, "seq-mean-token-sum-norm", norm_len=6)
    assert float(bk.numpy(got)) == pytest.approx(7 / 12, abs=1e-12)
    zero = bk.asarray(np.zeros((2, 3)))
    for mode in MODES:  # an empty mask gives 0, not NaN
        assert float(bk.numpy(L.aggregate(x[:2], zero, mode))) == 0.0


# Five tokens, one row, clip_low 0.2, clip_high 0.28, dual clip 3:
#   a: A=+1, r=1.1 -> l1=-1.1,  l2=-1.1 (inside)        -> -1.1   free
#   b: A=+1, r=1.5 -> l1=-1.5,  l2=-1.28                -> -1.28  clipped (high)
#   c: A=-2, r=0.5 -> l1=1.0,   l2=1.6 (dual: 6)        -> 1.6    clipped (low)
#   d: A=-1, r=4.0 -> l1=4.0,   l2=1.28 -> max 4; dual min(4, 3) -> 3  dual-clipped
#   e: A=+2, r=0.5 -> l1=-1.0,  l2=-1.6 -> max -1.0     -> -1.0   free
PPO_RATIO = np.array([[1.1, 1.5, 0.5, 4.0, 0.5]])
PPO_ADV = np.array([[1.0, 1.0, -2.0, -1.0, 2.0]])


def _ppo_hand_inputs(bk):
    old = np.full((1, 5), -1.0)
    return (
        bk.asarray(old + np.log(PPO_RATIO)),
        bk.asarray(old),
        bk.asarray(PPO_ADV),
        bk.asarray(np.ones((1, 5))),
    )


def test_ppo_hand(bk):
    loss, m = bk.call(lambda *a: L.ppo_policy_loss(*a, 0.2, 0.28, 3.0), *_ppo_hand_inputs(bk))
    # (-1.1 - 1.28 + 1.6 + 3 - 1) / 5 = 1.22 / 5 (swapping clip_low / clip_high gives 1.14 / 5)
    assert float(bk.numpy(loss)) == pytest.approx(0.244, **APPROX)
    assert float(bk.numpy(m["clipfrac"])) == pytest.approx(2 / 5, **APPROX)  # b, c
    assert float(bk.numpy(m["clipfrac_lower"])) == pytest.approx(1 / 5, **APPROX)  # d
    # approx_kl = mean(-log r) = -log(1.1 * 1.5 * 0.5 * 4 * 0.5) / 5 = -log(1.65) / 5
    assert float(bk.numpy(m["approx_kl"])) == pytest.approx(-math.log(1.65) / 5, **APPROX)
    loss, m = bk.call(lambda *a: L.ppo_policy_loss(*a, 0.2, 0.28, None), *_ppo_hand_inputs(bk))
    # d no longer dual-clipped: (1.22 - 3 + 4) / 5
    assert float(bk.numpy(loss)) == pytest.approx(2.22 / 5, **APPROX)
    assert float(bk.numpy(m["clipfrac_lower"])) == 0.0


def test_ppo_hand_gradient(gbk):
    lp, old, adv, mask = _ppo_hand_inputs(gbk)

    def f(lp):
        return L.ppo_policy_loss(
            lp, _m(lp, gbk.numpy(old)), _m(lp, PPO_ADV), _m(lp, np.ones((1, 5))), 0.2, 0.28, 3.0
        )[0]

    (g,) = gbk.grad(f, gbk.numpy(lp))
    # d(-A r)/d log p = -A r on free tokens, / 5 (token-mean); 0 where any clip is active:
    # a: -1 * 1.1 / 5 = -0.22; b, c, d: 0; e: -2 * 0.5 / 5 = -0.2
    np.testing.assert_allclose(g, [[-0.22, 0.0, 0.0, 0.0, -0.2]], **HAND)


def test_gspo_hand(gbk):
    # one sequence, two tokens, log-ratios (ln 2, 0): s = exp(ln 2 / 2) = sqrt 2
    old = np.array([[-1.0, -2.0]])
    lp = old + np.array([[math.log(2.0), 0.0]])
    ones = np.ones((1, 2))
    b = gbk
    # A = +1: l1 = -sqrt2, l2 = -1.2 -> max -1.2 on both tokens (clipped): loss -1.2
    gspo = lambda *a: L.gspo_policy_loss(*a, 0.2, 0.2)  # noqa: E731
    loss, m = b.call(gspo, b.asarray(lp), b.asarray(old), b.asarray(ones), b.asarray(ones))
    assert float(b.numpy(loss)) == pytest.approx(-1.2, **APPROX)
    assert float(b.numpy(m["clipfrac"])) == pytest.approx(1.0, **APPROX)
    # A = -1: l1 = sqrt2, l2 = 1.2 -> sqrt2 (free); seq-mean-token-mean of two equal tokens
    loss, m = b.call(gspo, b.asarray(lp), b.asarray(old), b.asarray(-ones), b.asarray(ones))
    assert float(b.numpy(loss)) == pytest.approx(math.sqrt(2.0), **APPROX)
    assert float(b.numpy(m["clipfrac"])) == 0.0

    def f(x):
        return L.gspo_policy_loss(x, _m(x, old), _m(x, -ones), _m(x, ones), 0.2, 0.2)[0]

    # per token: d(-A sg[s] pi/sg[pi])/d log pi = -A s = sqrt2, weighted 1/2 (token mean)
    (g,) = b.grad(f, lp)
    np.testing.assert_allclose(g, [[math.sqrt(2.0) / 2, math.sqrt(2.0) / 2]], **HAND)


def test_cispo_hand(gbk):
    # ratios (1.5, 0.5), A = (1, -1), log p = (-1, -2); weights clip(r, 0, 1.2) = (1.2, 0.5)
    lp = np.array([[-1.0, -2.0]])
    old = lp - np.log([[1.5, 0.5]])
    adv = np.array([[1.0, -1.0]])
    ones = np.ones((1, 2))
    b = gbk
    loss, m = b.call(
        lambda *a: L.cispo_policy_loss(*a, clip_low=1.0, clip_high=0.2),
        *(b.asarray(a) for a in (lp, old, adv, ones)),
    )
    # l = -w A log p = (-1.2 * 1 * -1, -0.5 * -1 * -2) = (1.2, -1.0); mean 0.1
    assert float(b.numpy(loss)) == pytest.approx(0.1, **APPROX)
    assert float(b.numpy(m["clipfrac"])) == pytest.approx(0.5, **APPROX)
    assert float(b.numpy(m["clipfrac_lower"])) == 0.0

    def f(x):
        return L.cispo_policy_loss(x, _m(x, old), _m(x, adv), _m(x, ones), 1.0, 0.2)[0]

    # gradient -w A / 2 (the weight is stop-gradient): (-0.6, 0.25); the clipped token still
    # gets a gradient (unlike PPO)
    (g,) = b.grad(f, lp)
    np.testing.assert_allclose(g, [[-0.6, 0.25]], **HAND)


def test_value_loss_hand(gbk):
    b = gbk
    values = np.array([[1.0, 2.0]])
    old = np.array([[0.0, 2.0]])
    returns = np.array([[1.2, 3.0]])
    ones = np.ones((1, 2))
    # token 1: v_clip = clip(1, -0.5, 0.5) = 0.5; (1 - 1.2)^2 = 0.04 < (0.5 - 1.2)^2 = 0.49 -> 0.49
    # token 2: v_clip = 2; both terms (2 - 3)^2 = 1 -> 1.   loss = 0.5 * (0.49 + 1) / 2
    loss, m = b.call(
        lambda *a: L.value_loss(*a, clip=0.5), *(b.asarray(a) for a in (values, old, returns, ones))
    )
    assert float(b.numpy(loss)) == pytest.approx(0.3725, **APPROX)
    assert float(b.numpy(m["vf_clipfrac"])) == pytest.approx(0.5, **APPROX)
    assert float(b.numpy(m["vpred_mean"])) == pytest.approx(1.5, **APPROX)

    def f(v):
        return L.value_loss(v, _m(v, old), _m(v, returns), _m(v, ones), 0.5)[0]

    # token 1: the clipped branch is constant in v -> 0; token 2: 0.5 * 2 (2 - 3) / 2 = -0.5
    (g,) = b.grad(f, values)
    np.testing.assert_allclose(g, [[0.0, -0.5]], **HAND)


def test_kl_penalty_hand(bk):
    lp, ref = bk.asarray([[math.log(0.5), -30.0]]), bk.asarray([[math.log(0.25), 0.0]])
    d = math.log(2.0)  # log 0.5 - log 0.25
    expect = {
        "k1": [d, -30.0],
        "abs": [d, 30.0],
        "k2": [0.5 * d * d, 450.0],
        # exp(-d) + d - 1 = 0.5 + ln 2 - 1; second: exp(20) - 20 - 1 clamped to 10
        "k3": [0.5 + d - 1.0, 10.0],
    }
    names = [
        ("k1", "k1"),
        ("k1", "kl"),
        ("abs", "abs"),
        ("k2", "k2"),
        ("k2", "mse"),
        ("k3", "k3"),
        ("k3", "low_var_kl"),
        ("k3", "k3+"),
    ]  # k3+: the value of k3 (gradient of k2)
    got = bk.call(lambda x, y: [L.kl_penalty(x, y, name) for _, name in names], lp, ref)
    for (kind, name), value in zip(names, got, strict=True):
        np.testing.assert_allclose(bk.numpy(value)[0], expect[kind], **HAND, err_msg=name)


def test_kl_gradients_hand(gbk):
    lp, ref = np.array([[math.log(0.5)]]), np.array([[math.log(0.25)]])
    d = math.log(2.0)

    def grad(kind):
        return gbk.grad(lambda x: _sum(L.kl_penalty(x, _m(x, ref), kind)), lp)[0][0, 0]

    assert grad("k1") == pytest.approx(1.0, **APPROX)
    assert grad("k2") == pytest.approx(d, **APPROX)  # d (d^2 / 2) / dd = d
    assert grad("k3") == pytest.approx(1.0 - 0.5, **APPROX)  # 1 - exp(ref - lp) = 1 - 0.5
    assert grad("k3+") == pytest.approx(d, **APPROX)  # k2's gradient
    assert grad("k1+") == pytest.approx(d, **APPROX)


def test_dpo_hand(bk):
    # pair 1: h = (-1 + 3) - (-2 + 2) = 2, beta h = 1; pair 2: h = 0
    args = [bk.asarray(a) for a in ([-1.0, -2.0], [-3.0, -2.0], [-2.0, -1.0], [-2.0, -1.0])]
    sp1 = math.log1p(math.exp(-1.0))  # -log sigmoid(1) = 0.3132617
    (losses, m), (smooth, _), (ipo, _), (hinge, _), (_, m8) = bk.call(
        lambda *a: (
            L.dpo_loss(*a, beta=0.5, kind="sigmoid"),
            L.dpo_loss(*a, beta=0.5, kind="sigmoid", label_smoothing=0.1),
            L.dpo_loss(*a, beta=0.5, kind="ipo"),
            L.dpo_loss(*a, beta=0.5, kind="hinge"),
            L.dpo_loss(*a, beta=0.5, global_pairs=8.0),
        ),
        *args,
    )
    np.testing.assert_allclose(bk.numpy(losses), [sp1, math.log(2.0)], **HAND)
    # label smoothing 0.1: 0.9 * sp1 + 0.1 * (-log sigmoid(-1)) = 0.9 sp1 + 0.1 (1 + sp1)
    np.testing.assert_allclose(bk.numpy(smooth)[0], 0.9 * sp1 + 0.1 * (1.0 + sp1), **HAND)
    np.testing.assert_allclose(bk.numpy(ipo), [1.0, 1.0], **HAND)  # (h - 1 / (2 * 0.5))^2
    np.testing.assert_allclose(bk.numpy(hinge), [0.0, 1.0], **HAND)  # max(0, 1 - beta h)
    # rewards: chosen 0.5 * (-1 + 2) = 0.5, 0.5 * (-2 + 1) = -0.5 -> mean 0
    #          rejected 0.5 * (-3 + 2) = -0.5, 0.5 * (-2 + 1) = -0.5 -> mean -0.5
    #          accuracy: 0.5 > -0.5 yes, -0.5 > -0.5 no -> 0.5
    assert float(bk.numpy(m["rewards/chosen"])) == pytest.approx(0.0, abs=1e-12)
    assert float(bk.numpy(m["rewards/rejected"])) == pytest.approx(-0.5, **APPROX)
    assert float(bk.numpy(m["rewards/margins"])) == pytest.approx(0.5, **APPROX)
    assert float(bk.numpy(m["rewards/accuracies"])) == pytest.approx(0.5, **APPROX)
    assert float(bk.numpy(m8["rewards/rejected"])) == pytest.approx(-1.0 / 8, **APPROX)  # sum / 8


# --------------------------------------------------------------------------- edge cases


def test_extreme_ratios_are_finite(bk):
    # log-ratios of +-1000 would overflow exp; the +-20 clamp keeps every loss finite
    old = np.zeros((2, 3))
    lp = np.array([[1000.0, -1000.0, 0.0], [50.0, -50.0, 1.0]])
    adv = np.array([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]])
    ones = np.ones((2, 3))
    for fn in (L.ppo_policy_loss, L.gspo_policy_loss, L.cispo_policy_loss):
        loss, m = bk.call(fn, *(bk.asarray(a) for a in (lp, old, adv, ones)))
        assert np.isfinite(bk.numpy(loss)), fn.__name__
        assert all(np.isfinite(bk.numpy(v)) for v in m.values()), fn.__name__


def test_length_one_and_fully_masked_rows(bk):
    # T = 1 responses; the second row is padding only: it must not change the loss
    lp, old, adv = np.array([[-0.5], [-0.7]]), np.array([[-1.0], [-0.2]]), np.array([[2.0], [5.0]])
    mask = np.array([[1.0], [0.0]])
    for mode in MODES:
        ppo = lambda *a, mode=mode: L.ppo_policy_loss(*a, agg=mode)[0]  # noqa: E731
        full = bk.call(ppo, *(bk.asarray(a) for a in (lp, old, adv, mask)))
        one = bk.call(ppo, *(bk.asarray(a[:1]) for a in (lp, old, adv, mask)))
        np.testing.assert_allclose(bk.numpy(full), bk.numpy(one), **PARITY)
        # r = e^0.5 = 1.6487 > 1.2: clipped, -A * 1.2 = -2.4 (T = 1 so every mode agrees)
        assert float(bk.numpy(full)) == pytest.approx(-2.4, **APPROX)


def test_nan_outside_mask_does_not_leak(bk):
    lp = np.array([[-1.0, np.nan]])
    old = np.array([[-1.0, 0.0]])
    loss, m = bk.call(
        L.ppo_policy_loss, *(bk.asarray(a) for a in (lp, old, np.ones((1, 2)), [[1.0, 0.0]]))
    )
    assert float(bk.numpy(loss)) == pytest.approx(-1.0, **APPROX)
    assert all(np.isfinite(bk.numpy(v)) for v in m.values())


# --------------------------------------------------------------------------- re-batching


def _split_sum(bk, fn, arrays, sizes):
    """Sum of fn over micro-batches (row slices of the given sizes)."""
    total, start = None, 0
    for size in sizes:
        part = bk.call(fn, *(bk.asarray(a[start : start + size]) for a in arrays))
        part = as_np(bk, part)
        total = part if total is None else _tree_add(total, part)
        start += size
    return total


def _tree_add(a, b):
    if isinstance(a, tuple):
        return tuple(_tree_add(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return {k: a[k] + b[k] for k in a}
    return a + b


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_and_ppo_invariant_to_micro_batching(bk, mode):
    new, old, adv, mask = policy_inputs(6)
    n_tok = float(mask.sum())
    n_seq = float((mask.sum(-1) > 0).sum())

    def agg(x, m):
        return L.aggregate(x, m, mode, n_tok, n_seq)

    def ppo(n, o, a, m):
        return L.ppo_policy_loss(n, o, a, m, 0.2, 0.28, 3.0, mode, n_tok, n_seq)

    for fn, arrays in ((agg, (adv, mask)), (ppo, (new, old, adv, mask))):
        whole = _split_sum(bk, fn, arrays, [8])  # 1 x 8
        for sizes in ([1] * 8, [2, 2, 2, 2]):  # 8 x 1, 4 x 2
            assert_tree_close(_split_sum(bk, fn, arrays, sizes), whole, **REBATCH)
    # and the global-normalised full batch equals the plain local mean
    local = bk.call(lambda x, m: L.aggregate(x, m, mode), bk.asarray(adv), bk.asarray(mask))
    np.testing.assert_allclose(bk.numpy(local), _split_sum(bk, agg, (adv, mask), [8]), **REBATCH)


# --------------------------------------------------------------------------- errors


def test_unknown_mode_and_kind_errors(bk):
    x, m = bk.asarray(np.ones((2, 3))), bk.asarray(np.ones((2, 3)))
    with pytest.raises(
        ValueError, match=r"aggregate: unknown mode 'mean'.*token-mean.*seq-mean-token-sum"
    ):
        L.aggregate(x, m, "mean")
    with pytest.raises(ValueError, match=r"kl_penalty: unknown kind 'k4'.*'k1'.*'low_var_kl'"):
        L.kl_penalty(x, m, "k4")
    v = bk.asarray(np.ones(2))
    with pytest.raises(ValueError, match=r"dpo_loss: unknown kind 'orpo'.*hinge.*ipo.*sigmoid"):
        L.dpo_loss(v, v, v, v, kind="orpo")
    with pytest.raises(ValueError, match=r"label_smoothing=0.1 is only defined for kind='sigmoid'"):
        L.dpo_loss(v, v, v, v, kind="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"ppo_policy_loss: dual_clip must be > 1.0"):
        L.ppo_policy_loss(x, x, x, m, dual_clip=0.5)
    with pytest.raises(
        ValueError, match=r"ppo_policy_loss: unknown agg 'bogus'; valid choices: \['seq-mean"
    ):
        L.ppo_policy_loss(x, x, x, m, agg="bogus")
    with pytest.raises(ValueError, match=r"value_loss: unknown agg 'bogus'"):
        L.value_loss(x, x, x, m, agg="bogus")


def test_shape_mismatch_errors(bk):
    a, b = bk.asarray(np.ones((2, 3))), bk.asarray(np.ones((2, 4)))
    with pytest.raises(
        ValueError,
        match=r"ppo_policy_loss: shape mismatch: log_probs\[2, 3\], "
        r"old_log_probs\[2, 4\].*must all have the same shape",
    ):
        L.ppo_policy_loss(a, b, a, a)
    with pytest.raises(
        ValueError, match=r"aggregate: shape mismatch: loss_mat\[2, 3\], mask\[2, 4\]"
    ):
        L.aggregate(a, b)
    with pytest.raises(ValueError, match=r"value_loss: shape mismatch.*returns\[2, 4\]"):
        L.value_loss(a, a, b, a)
    with pytest.raises(ValueError, match=r"kl_penalty: shape mismatch"):
        L.kl_penalty(a, b, "k1")
    with pytest.raises(ValueError, match=r"aggregate: loss_mat must be \[B, T\], got shape \(6,\)"):
        L.aggregate(bk.asarray(np.ones(6)), bk.asarray(np.ones(6)))
    with pytest.raises(ValueError, match=r"dpo_loss: inputs must be \[B\]"):
        L.dpo_loss(a, a, a, a)


def test_sft_loss_hand(bk):
    # Row 0 learns tokens 0 and 2 (a user token between them is masked), row 1 token 1;
    # three target tokens in the micro-batch, ten in the whole optimizer step.
    lp = np.log(np.array([[0.5, 0.9, 0.25], [0.9, 0.125, 0.9]]))
    mask = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    nll = math.log(2) + math.log(4) + math.log(8)  # = 6 log 2
    loss, m = bk.call(lambda lp, m: L.sft_loss(lp, m), bk.asarray(lp), bk.asarray(mask))
    assert float(bk.numpy(loss)) == pytest.approx(nll / 3, abs=1e-12)
    assert float(bk.numpy(m["nll"])) == pytest.approx(nll / 3, abs=1e-12)
    glob = bk.call(lambda lp, m: L.sft_loss(lp, m, 10.0)[0], bk.asarray(lp), bk.asarray(mask))
    assert float(bk.numpy(glob)) == pytest.approx(nll / 10, abs=1e-12)


def test_sft_actor_loss_splits_like_the_whole_batch():
    """Two micro-batches' contributions (global count given) sum to the one-batch loss."""
    from types import SimpleNamespace

    from polyrl.algos.registry import get_algorithm

    loss_fn = get_algorithm("sft").make_actor_loss()
    rng = np.random.default_rng(0)
    lp = -rng.random((4, 5))
    mask = (rng.random((4, 5)) > 0.4).astype(np.float64)
    ctx = SimpleNamespace(global_tokens=mask.sum(), global_seqs=4.0)
    whole = loss_fn({"log_probs": lp}, {"response_mask": mask}, ctx)[0]
    parts = sum(
        loss_fn({"log_probs": lp[s]}, {"response_mask": mask[s]}, ctx)[0]
        for s in (slice(0, 1), slice(1, 4))
    )
    assert whole == pytest.approx(-(lp * mask).sum() / mask.sum(), abs=1e-12)
    assert parts == pytest.approx(whole, abs=1e-12)


# --------------------------------------------------------------------------- reward model

# Three pairs: h = r_chosen - r_rejected = [1, 0, -2] (right, tie, wrong).
RM_CHOSEN, RM_REJECTED = [2.0, 0.0, -1.0], [1.0, 0.0, 1.0]


def _softplus(x: float) -> float:  # -log sigmoid(-x) = log(1 + e^x)
    return math.log1p(math.exp(x))


def test_bradley_terry_hand(bk):
    cases = {
        "plain": dict(),
        "margin": dict(margin=0.5),
        "pair_margin": dict(margin=np.array([0.5, 0.0, 1.0])),
        "center": dict(center_coef=0.1),
        "global": dict(global_pairs=6.0),
        "masked": dict(pair_mask=np.array([1.0, 1.0, 0.0])),
    }

    def run(kw):
        arrays = {k: bk.asarray(v) for k, v in kw.items() if isinstance(v, np.ndarray)}
        plain = {k: v for k, v in kw.items() if k not in arrays}

        def fn(c, r, *xs):
            return L.bradley_terry_loss(c, r, **plain, **dict(zip(arrays, xs)))

        loss, m = bk.call(fn, bk.asarray(RM_CHOSEN), bk.asarray(RM_REJECTED), *arrays.values())
        assert bk.is_native(loss)
        return float(bk.numpy(loss)), {k: float(bk.numpy(v)) for k, v in m.items()}

    out = {name: run(kw) for name, kw in cases.items()}
    # -log sigmoid(h - margin) = softplus(margin - h)
    per_pair = [_softplus(-1.0), math.log(2.0), _softplus(2.0)]
    assert out["plain"][0] == pytest.approx(sum(per_pair) / 3, **APPROX)
    margin = [_softplus(-0.5), _softplus(0.5), _softplus(2.5)]
    assert out["margin"][0] == pytest.approx(sum(margin) / 3, **APPROX)
    pair_margin = [_softplus(-0.5), math.log(2.0), _softplus(3.0)]
    assert out["pair_margin"][0] == pytest.approx(sum(pair_margin) / 3, **APPROX)
    # centring: + 0.1 (r_c + r_r)^2 = + 0.1 * [9, 0, 0]
    assert out["center"][0] == pytest.approx((sum(per_pair) + 0.9) / 3, **APPROX)
    assert out["global"][0] == pytest.approx(sum(per_pair) / 6, **APPROX)
    assert out["masked"][0] == pytest.approx(sum(per_pair[:2]) / 2, **APPROX)
    # metrics: accuracy 1/3 (the tie is wrong), margins (1 + 0 - 2) / 3, chosen 1/3,
    # rejected 2/3; over the two real pairs: accuracy 1/2, margins 1/2
    m = out["plain"][1]
    assert m["rewards/accuracies"] == pytest.approx(1.0 / 3, **APPROX)
    assert m["rewards/margins"] == pytest.approx(-1.0 / 3, **APPROX)
    assert m["rewards/chosen"] == pytest.approx(1.0 / 3, **APPROX)
    assert m["rewards/rejected"] == pytest.approx(2.0 / 3, **APPROX)
    assert out["global"][1]["rewards/accuracies"] == pytest.approx(1.0 / 6, **APPROX)
    assert out["masked"][1]["rewards/accuracies"] == pytest.approx(0.5, **APPROX)
    assert out["masked"][1]["rewards/margins"] == pytest.approx(0.5, **APPROX)


def test_bradley_terry_gradient_raises_chosen_lowers_rejected(gbk):
    """d loss / d r_chosen = -sigmoid(margin - h) / N < 0 and d / d r_rejected = +the same:
    a gradient step widens every pair's gap, most where the model is most wrong."""
    (g_c, g_r) = gbk.grad(
        lambda c, r: L.bradley_terry_loss(c, r, margin=0.5)[0],
        np.array(RM_CHOSEN),
        np.array(RM_REJECTED),
    )

    def sigmoid(x):
        return 1.0 / (1.0 + math.exp(-x))

    expected = [-sigmoid(0.5 - h) / 3 for h in (1.0, 0.0, -2.0)]
    np.testing.assert_allclose(g_c, expected, **HAND)
    np.testing.assert_allclose(g_r, [-g for g in expected], **HAND)
    assert all(g < 0 for g in g_c)


def test_bradley_terry_micro_batches_sum_to_the_whole(bk):
    rng = np.random.default_rng(7)
    chosen, rejected = rng.normal(size=8), rng.normal(size=8)

    def run(c, r, n):
        return bk.call(
            lambda c, r: L.bradley_terry_loss(c, r, center_coef=0.05, global_pairs=n),
            bk.asarray(c),
            bk.asarray(r),
        )

    whole = as_np(
        bk,
        bk.call(
            lambda c, r: L.bradley_terry_loss(c, r, center_coef=0.05),
            bk.asarray(chosen),
            bk.asarray(rejected),
        ),
    )
    parts = [as_np(bk, run(chosen[s], rejected[s], 8.0)) for s in (slice(0, 3), slice(3, 8))]
    summed = (parts[0][0] + parts[1][0], {k: parts[0][1][k] + parts[1][1][k] for k in whole[1]})
    assert_tree_close(summed, whole, **REBATCH)


def test_pair_accuracy_counts_with_denominator(bk):
    correct, pairs = bk.call(
        lambda c, r, p: L.pair_accuracy(c, r, p),
        bk.asarray([3.0, 1.0, 2.0, 0.5]),
        bk.asarray([1.0, 1.0, 5.0, 0.0]),
        bk.asarray([1.0, 1.0, 1.0, 0.0]),  # the last pair is padding
    )
    assert (float(bk.numpy(correct)), float(bk.numpy(pairs))) == (1.0, 3.0)
    # held out in two batches: (1 + 2) / (3 + 2), not the mean of 1/3 and 2/2
    correct2, pairs2 = L.pair_accuracy(bk.asarray([1.0, 2.0]), bk.asarray([0.0, 1.0]))
    total = (float(bk.numpy(correct)) + float(bk.numpy(correct2))) / (3.0 + float(pairs2))
    assert total == pytest.approx(3.0 / 5.0, **APPROX)


def test_bradley_terry_errors(bk):
    v, w = bk.asarray(np.zeros(3)), bk.asarray(np.zeros(4))
    with pytest.raises(
        ValueError,
        match=r"bradley_terry_loss: shape mismatch: chosen_rewards\[3\], "
        r"rejected_rewards\[4\]",
    ):
        L.bradley_terry_loss(v, w)
    with pytest.raises(ValueError, match=r"margin\[4\]"):
        L.bradley_terry_loss(v, v, margin=w)
    with pytest.raises(ValueError, match=r"inputs must be \[B\].*got shape \(3, 1\)"):
        L.bradley_terry_loss(bk.asarray(np.zeros((3, 1))), bk.asarray(np.zeros((3, 1))))
    with pytest.raises(ValueError, match=r"center_coef=-0.1 must be >= 0"):
        L.bradley_terry_loss(v, v, center_coef=-0.1)
    with pytest.raises(ValueError, match=r"pair_accuracy: shape mismatch.*pair_mask\[4\]"):
        L.pair_accuracy(v, v, w)
