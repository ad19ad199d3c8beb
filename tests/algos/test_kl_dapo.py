"""polyrl.algos.kl (controllers, KL in reward) and polyrl.algos.dapo."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from polyrl.algos import dapo, kl

PARITY = dict(rtol=1e-12, atol=1e-12)  # float64, op-order differences only (test_losses)
HAND = dict(rtol=1e-9, atol=1e-12)  # hand arithmetic written in the test
APPROX = dict(rel=1e-9, abs=1e-12)  # the same, for pytest.approx


# --------------------------------------------------------------------------- controllers


def test_fixed_controller():
    ctrl = kl.make_kl_controller("fixed", kl_coef=0.05)
    state = ctrl.init()
    assert state == kl.KLState(coef=0.05, steps=0)
    coef, new = ctrl.update(123.0, 64, state)
    assert coef == 0.05 and new == kl.KLState(coef=0.05, steps=64)


def test_adaptive_controller_hand():
    ctrl = kl.adaptive_kl_controller(kl_coef=0.1, target_kl=6.0, horizon=10000)
    s0 = ctrl.init()
    # KL 9: e = clip(9 / 6 - 1 = 0.5, -0.2, 0.2) = 0.2; beta = 0.1 (1 + 0.2 * 256 / 10000)
    c1, s1 = ctrl.update(9.0, 256, s0)
    assert c1 == pytest.approx(0.100512, **APPROX)
    # KL 3: e = clip(-0.5) = -0.2; beta = 0.100512 (1 - 0.00512) = 0.099997378...
    c2, s2 = ctrl.update(3.0, 256, s1)
    assert c2 == pytest.approx(0.100512 * 0.99488, **APPROX)
    # KL 6.6: e = 0.1 (inside the clip); beta *= 1 + 0.1 * 256 / 10000
    c3, s3 = ctrl.update(6.6, 256, s2)
    assert c3 == pytest.approx(0.100512 * 0.99488 * 1.00256, **APPROX)
    # pure: old states are untouched, the state round-trips through a dict (checkpoint)
    assert s0.coef == 0.1 and s1.coef == c1 and s3.steps == 768
    assert kl.KLState(**dataclasses.asdict(s3)) == s3
    with pytest.raises(dataclasses.FrozenInstanceError):
        s3.coef = 1.0  # type: ignore[misc]


def test_controller_errors():
    with pytest.raises(
        ValueError, match=r"unknown kind 'pid'; valid choices: \['adaptive', 'fixed'\]"
    ):
        kl.make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match=r"horizon must be > 0, got 0"):
        kl.adaptive_kl_controller(0.1, 6.0, 0)


def test_apply_kl_penalty_hand(bk):
    scores = [[0.0, 1.0], [0.0, 2.0]]
    lp = [[math.log(0.5), math.log(0.5)], [math.log(0.5), 0.0]]
    ref = [[math.log(0.25), math.log(0.5)], [math.log(0.5), 0.0]]
    mask = [[1.0, 1.0], [1.0, 0.0]]
    rewards, current = bk.call(
        lambda *a: kl.apply_kl_penalty(*a, kl_coef=0.1, kind="k1"),
        *(bk.asarray(a) for a in (scores, lp, ref, mask)),
    )
    # k1 = (ln 2, 0 | 0, masked): rewards = scores - 0.1 k1
    np.testing.assert_allclose(bk.numpy(rewards), [[-0.1 * math.log(2), 1.0], [0.0, 2.0]], **HAND)
    # per-sequence token means (ln 2 / 2, 0), batch mean ln 2 / 4
    assert float(bk.numpy(current)) == pytest.approx(math.log(2) / 4, **APPROX)


# --------------------------------------------------------------------------- DAPO


SCORES = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0])
GROUPS = np.array([0, 0, 1, 1, 2, 2, 3])


def test_dynamic_sampling_hand(bk):
    # group 0 (1, 1) all equal -> drop; group 1 (0, 1) keep; group 2 (0.5, 0.5) drop;
    # group 3 singleton -> kept by default (verl recipe), dropped on request
    keep = dapo.dynamic_sampling_mask(bk.asarray(SCORES), bk.asarray(GROUPS))
    assert bk.is_native(keep)
    np.testing.assert_array_equal(bk.numpy(keep), [0, 0, 1, 1, 0, 0, 1])
    assert bk.numpy(keep).dtype == np.bool_
    keep = dapo.dynamic_sampling_mask(bk.asarray(SCORES), bk.asarray(GROUPS), keep_singletons=False)
    np.testing.assert_array_equal(bk.numpy(keep), [0, 0, 1, 1, 0, 0, 0])


def test_dynamic_sampling_string_ids_and_errors():
    ids = np.array(["a", "a", "b", "b"])
    keep = dapo.dynamic_sampling_mask(np.array([0.0, 1.0, 2.0, 2.0]), ids)
    np.testing.assert_array_equal(keep, [True, True, False, False])
    with pytest.raises(ValueError, match=r"group_ids has shape \[3\] but scores has \[4\]"):
        dapo.dynamic_sampling_mask(np.zeros(4), np.zeros(3))
    with pytest.raises(ValueError, match=r"scores must be \[B\], got shape \[2, 2\]"):
        dapo.dynamic_sampling_mask(np.zeros((2, 2)), np.zeros(4))


def test_overlong_penalty_hand(bk, backends):
    lengths = np.array([10, 16, 17, 18, 20, 25])
    # max_len 20, buffer 4: free up to 16, then -(L - 16) / 4, capped at -1 beyond 20
    expect = np.array([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    got = dapo.overlong_penalty(bk.asarray(lengths), max_len=20, buffer_len=4)
    assert bk.is_native(got)
    np.testing.assert_allclose(bk.numpy(got), expect, **HAND)
    got = bk.call(
        lambda x: dapo.overlong_penalty(x, 20, 4, penalty_factor=0.5),
        bk.asarray(lengths.astype(np.float64)),
    )
    np.testing.assert_allclose(bk.numpy(got), 0.5 * expect, **HAND)
    ref = dapo.overlong_penalty(lengths.astype(np.float64), 20, 4, 0.5)
    np.testing.assert_allclose(bk.numpy(got), ref, **PARITY)


def test_overlong_penalty_errors():
    with pytest.raises(
        ValueError, match=r"need 0 < buffer_len <= max_len, got buffer_len=30, max_len=20"
    ):
        dapo.overlong_penalty(np.array([1]), max_len=20, buffer_len=30)
