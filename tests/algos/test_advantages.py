"""polyrl.algos.advantages: parity, hand-computed cases, a loop reference for GAE,
edge cases (singleton groups, all-equal rewards, masked rows, T = 1) and errors."""

from __future__ import annotations

import numpy as np
import pytest

from polyrl.algos import advantages as A

# float64; frameworks differ only in op order / libm rounding over O(T) ops: see test_losses.
PARITY = dict(rtol=1e-12, atol=1e-12)
# hand-computed numbers: exact arithmetic written in the test, float64 evaluation
HAND = dict(rtol=1e-9, atol=1e-9)


def outcome_inputs(seed=0, B=8, T=6):
    """Outcome rewards on the last valid token, ragged masks, groups of 3, 3, 1 and 1."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    rewards = np.zeros((B, T))
    rewards[np.arange(B), lengths - 1] = rng.integers(0, 3, size=B).astype(np.float64)
    groups = np.array([0, 0, 0, 1, 1, 1, 2, 3])[:B]
    return rewards, mask, groups


def run(bk, fn, *arrays, ids=None, **kw):
    """``fn(*arrays, ids, **kw)`` on backend ``bk`` (jax: under jit, the ids a constant)."""
    extra = () if ids is None else (bk.asarray(ids),)
    out = bk.call(lambda *a: fn(*a, *extra, **kw), *(bk.asarray(a) for a in arrays))
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        assert bk.is_native(o), f"{bk}: {fn.__name__} returned {type(o)}"
    return tuple(bk.numpy(o) for o in outs)


# --------------------------------------------------------------------------- parity


def _cases():
    r, m, g = outcome_inputs()
    rng = np.random.default_rng(1)
    values = rng.normal(size=r.shape)
    dense = rng.normal(size=r.shape)  # dense (per-token) rewards exercise the scans
    mid = m.copy()
    mid[:, 1] = 0.0  # an observation token in the middle of every response
    return {
        "gae": (A.gae, (dense, values, mid), None, dict(gamma=0.9, lam=0.8)),
        "gae_nowhiten": (A.gae, (dense, values, m), None, dict(gamma=0.99, lam=0.95, whiten=False)),
        "grpo": (A.grpo, (r, m), g, {}),
        "dr_grpo": (A.grpo, (r, m), g, dict(scale_by_std=False)),
        "rloo": (A.rloo, (r, m), g, {}),
        "reinforce_pp": (A.reinforce_plus_plus, (dense, mid), None, dict(gamma=0.9)),
        "reinforce_pp_baseline": (A.reinforce_plus_plus_baseline, (r, m), g, {}),
        "remax": (A.remax, (dense, mid, values[:, 0]), None, {}),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_parity(bk, backends, case):
    fn, arrays, ids, kw = _cases()[case]
    ref = run(backends["numpy"], fn, *arrays, ids=ids, **kw)
    out = run(bk, fn, *arrays, ids=ids, **kw)
    for o, e in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, e, **PARITY)
        assert np.all(np.isfinite(o))


# --------------------------------------------------------------------------- GAE


def test_gae_hand(bk):
    r, v = [[0.0, 0.0, 1.0]], [[0.5, 0.4, 0.3]]
    # gamma 0.9, lam 0.8 (gamma lam = 0.72):
    #   delta_2 = 1 - 0.3 = 0.7;  delta_1 = 0.9 * 0.3 - 0.4 = -0.13;  delta_0 = 0.9 * 0.4 - 0.5 = -0.14
    #   A_2 = 0.7;  A_1 = -0.13 + 0.72 * 0.7 = 0.374;  A_0 = -0.14 + 0.72 * 0.374 = 0.12928
    adv, ret = run(bk, A.gae, r, v, [[1.0, 1.0, 1.0]], gamma=0.9, lam=0.8, whiten=False)
    np.testing.assert_allclose(adv, [[0.12928, 0.374, 0.7]], **HAND)
    np.testing.assert_allclose(ret, [[0.62928, 0.774, 1.0]], **HAND)  # A + V
    # an observation token at t = 1 is skipped: V'_0 = V_2 = 0.3, A'_0 = A_2 = 0.7
    #   delta_0 = 0.9 * 0.3 - 0.5 = -0.23;  A_0 = -0.23 + 0.72 * 0.7 = 0.274
    adv, ret = run(bk, A.gae, r, v, [[1.0, 0.0, 1.0]], gamma=0.9, lam=0.8, whiten=False)
    np.testing.assert_allclose(adv, [[0.274, 0.0, 0.7]], **HAND)
    np.testing.assert_allclose(ret, [[0.774, 0.0, 1.0]], **HAND)


def _gae_loop(r, v, m, gamma, lam):
    """verl's published loop, written out independently (numpy, one step at a time)."""
    B, T = r.shape
    nextvalues, lastgaelam, out = np.zeros(B), np.zeros(B), np.zeros((B, T))
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        new = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = new * m[:, t] + (1 - m[:, t]) * lastgaelam
        out[:, t] = lastgaelam
    return out


def test_gae_matches_loop_reference_and_whitening(bk):
    rng = np.random.default_rng(7)
    r, v = rng.normal(size=(8, 6)), rng.normal(size=(8, 6))
    m = (rng.uniform(size=(8, 6)) < 0.7).astype(np.float64)
    m[0] = 0.0  # fully masked row
    loop = _gae_loop(r, v, m, 0.95, 0.9)
    adv, ret = run(bk, A.gae, r, v, m, gamma=0.95, lam=0.9, whiten=False)
    np.testing.assert_allclose(adv, loop * m, **PARITY)
    np.testing.assert_allclose(ret, (loop + v) * m, **PARITY)
    # whitened: (x - mean) / sqrt(var_unbiased + 1e-8) over the valid tokens
    sel = loop[m > 0]
    white = (loop - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
    adv, _ = run(bk, A.gae, r, v, m, gamma=0.95, lam=0.9)
    np.testing.assert_allclose(adv, white * m, **PARITY)


# --------------------------------------------------------------------------- group estimators

GROUPS = np.array([0, 0, 0, 1, 1, 2])
SCORES = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.7])  # group 1 all equal, group 2 singleton


def _outcome(scores, T=2):
    r = np.zeros((scores.size, T))
    r[:, -1] = scores
    return r, np.ones((scores.size, T))


def test_grpo_hand(bk):
    r, m = _outcome(SCORES)
    # group 0: mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std = sqrt(1/3)
    std = np.sqrt(1.0 / 3.0)
    expect = [
        (2 / 3) / (std + 1e-6),
        (-1 / 3) / (std + 1e-6),
        (-1 / 3) / (std + 1e-6),
        0.0,
        0.0,  # group 1: all equal -> 0
        0.7 / (1.0 + 1e-6),
    ]  # singleton: mean 0, std 1 (verl)
    (adv,) = run(bk, A.grpo, r, m, ids=GROUPS)
    np.testing.assert_allclose(adv, np.repeat(np.array(expect)[:, None], 2, 1), **HAND)
    (adv,) = run(bk, A.grpo, r, m, ids=GROUPS, scale_by_std=False)  # Dr. GRPO: no std
    np.testing.assert_allclose(adv[:, 0], [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.7], **HAND)


def test_rloo_hand(bk):
    r, m = _outcome(SCORES)
    # group 0: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice); group 1: 0; singleton: 0.7
    (adv,) = run(bk, A.rloo, r, m, ids=GROUPS)
    np.testing.assert_allclose(adv[:, 1], [1.0, -0.5, -0.5, 0.0, 0.0, 0.7], **HAND)


def test_reinforce_pp_baseline_hand(bk):
    r, m = _outcome(SCORES)
    centred = np.array([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.7])  # s - group mean (singleton: 0)
    tokens = np.repeat(centred, 2)  # 12 valid tokens
    # whitened over the batch's tokens, unbiased variance, eps inside the sqrt
    expect = (tokens - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-6)
    (adv,) = run(bk, A.reinforce_plus_plus_baseline, r, m, ids=GROUPS)
    np.testing.assert_allclose(adv.reshape(-1), expect, **HAND)


def test_reinforce_pp_hand(bk):
    r = [[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]]
    m = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    # gamma 0.5; row 1: (0.25, 0.5, 1); row 2: the masked t = 2 cuts the sum: (1, 2, -)
    adv, ret = run(bk, A.reinforce_plus_plus, r, m, gamma=0.5)
    np.testing.assert_allclose(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]], **HAND)
    valid = np.array([0.25, 0.5, 1.0, 1.0, 2.0])
    white = (valid - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv[np.array(m) > 0], white, **HAND)
    assert adv[1, 2] == 0.0


def test_reinforce_pp_skips_observation_tokens(bk):
    # An episode: turn (t=0), observation (t=1, masked), turn (t=2, 3) with the reward at
    # the end; gamma 0.5 over valid tokens: R = (0.25, -, 0.5, 1). The first turn keeps
    # its share of the final reward (a reset at t=1 would leave it 0).
    adv, ret = run(
        bk, A.reinforce_plus_plus, [[0.0, 7.0, 0.0, 1.0]], [[1.0, 0.0, 1.0, 1.0]], gamma=0.5
    )
    np.testing.assert_allclose(ret, [[0.25, 0.0, 0.5, 1.0]], **HAND)
    assert adv[0, 1] == 0.0


def test_remax_hand(bk):
    # r * m = (0, 1, 0): reward-to-go (1, 1, 0); minus the greedy baseline 0.4 on valid tokens
    adv, ret = run(bk, A.remax, [[0.0, 1.0, 0.5]], [[1.0, 1.0, 0.0]], [0.4])
    np.testing.assert_allclose(ret, [[1.0, 1.0, 0.0]], **HAND)
    np.testing.assert_allclose(adv, [[0.6, 0.6, 0.0]], **HAND)


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("fn", [A.grpo, A.rloo, A.reinforce_plus_plus_baseline])
def test_all_equal_rewards_give_zero(bk, fn):
    r, m = _outcome(np.full(6, 0.5))
    (adv,) = run(bk, fn, r, m, ids=GROUPS[:5].tolist() + [0])  # no singleton
    np.testing.assert_array_equal(adv, 0.0)


@pytest.mark.parametrize("fn", [A.grpo, A.rloo, A.reinforce_plus_plus_baseline])
def test_all_singletons(bk, fn):
    r, m = _outcome(np.array([1.0, 0.0, 2.0]))
    (adv,) = run(bk, fn, r, m, ids=[0, 1, 2])
    assert np.all(np.isfinite(adv))
    if fn is not A.reinforce_plus_plus_baseline:  # raw scores (verl's singleton rule)
        np.testing.assert_allclose(
            adv[:, 0], np.array([1.0, 0.0, 2.0]) / (1 + 1e-6 * (fn is A.grpo)), **HAND
        )


def test_fully_masked_rows_and_length_one(bk):
    r, m, g = outcome_inputs(3, B=6, T=1)  # T = 1 responses
    m[2] = 0.0
    r[2] = 0.0
    values = np.linspace(0.1, 0.6, 6)[:, None]
    for fn, arrays, ids, kw in [
        (A.gae, (r, values, m), None, {}),
        (A.grpo, (r, m), g[:6], {}),
        (A.rloo, (r, m), g[:6], {}),
        (A.reinforce_plus_plus, (r, m), None, {}),
        (A.reinforce_plus_plus_baseline, (r, m), g[:6], {}),
        (A.remax, (r, m, values[:, 0]), None, {}),
    ]:
        for out in run(bk, fn, *arrays, ids=ids, **kw):
            assert np.all(np.isfinite(out)), fn.__name__
            assert np.all(out[2] == 0.0), fn.__name__
    # an all-padding batch: zeros, not NaN
    zero = np.zeros((2, 3))
    for out in run(bk, A.gae, zero, zero, zero) + run(bk, A.reinforce_plus_plus, zero, zero):
        np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("ids_kind", ["numpy", "torch", "jax", "str", "list"])
def test_group_id_kinds(backends, ids_kind):
    r, m = _outcome(SCORES)
    expect = run(backends["numpy"], A.grpo, r, m, ids=GROUPS)[0]
    if ids_kind in ("numpy", "torch", "jax"):
        ids = backends[ids_kind].asarray(GROUPS.astype(np.int32))
    elif ids_kind == "str":
        ids = np.array([f"prompt-{i}" for i in GROUPS])
    else:
        ids = GROUPS.tolist()
    got = A.grpo(backends["numpy"].asarray(r), backends["numpy"].asarray(m), ids)
    np.testing.assert_allclose(got, expect, **PARITY)


def test_registry_columns(backends):
    r, m = _outcome(SCORES)
    cols = {
        "token_rewards": r,
        "response_mask": m,
        "group_ids": GROUPS,
        "values": np.zeros_like(r),
        "baseline_scores": np.zeros(6),
        "old_log_probs": np.zeros_like(r),
        "teacher_log_probs": np.zeros_like(r),
    }
    for name, est in A.ADVANTAGE_ESTIMATORS.items():
        adv, ret = est(cols, **{h: 1.0 for h in est.hparams})
        assert adv.shape == ret.shape == r.shape, name
    with pytest.raises(
        ValueError,
        match=r"needs columns \['token_rewards', 'values', "
        r"'response_mask'\]; missing \['values'\]",
    ):
        A.ADVANTAGE_ESTIMATORS["gae"]({"token_rewards": r, "response_mask": m})


# --------------------------------------------------------------------------- errors


def test_errors(bk):
    a, b = bk.asarray(np.ones((2, 3))), bk.asarray(np.ones((2, 4)))
    with pytest.raises(
        ValueError,
        match=r"gae: token_rewards\[2, 3\], values\[2, 4\], "
        r"mask\[2, 3\]; .* must all be \[B, T\]",
    ):
        A.gae(a, b, a)
    with pytest.raises(
        ValueError, match=r"grpo: group_ids has shape \[3\]; it must be \[B\] = \[2\]"
    ):
        A.grpo(a, a, bk.asarray(np.array([0, 0, 1])))
    with pytest.raises(ValueError, match=r"remax: baseline_scores has shape \[2, 3\]"):
        A.remax(a, a, a)
    with pytest.raises(ValueError, match=r"rloo: token_rewards\[6\].*must all be \[B, T\]"):
        A.rloo(bk.asarray(np.ones(6)), bk.asarray(np.ones(6)), np.zeros(6))
