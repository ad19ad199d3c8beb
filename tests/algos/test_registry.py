"""polyrl.algos.registry / spec: names, roles, the backend loss contract (numpy = torch =
jax, micro-batch invariance, jax.jit), overrides and errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from polyrl.algos import advantages as A
from polyrl.algos import losses as L
from polyrl.algos.registry import ALGORITHMS, algorithm_names, get_algorithm
from polyrl.algos.spec import AlgorithmSpec

PARITY = dict(rtol=1e-12, atol=1e-12)  # float64, op-order differences only (test_losses)
REBATCH = dict(rtol=1e-12, atol=1e-13)  # float64 reassociation of 8 partial sums

NAMES = [
    "cispo",
    "dapo",
    "distillation",
    "dpo",
    "dr_grpo",
    "grpo",
    "gspo",
    "ppo",
    "reinforce_pp",
    "remax",
    "reward_model",
    "rloo",
    "sft",
]
RL_NAMES = [n for n in NAMES if n not in ("dpo", "sft", "reward_model")]
ACTOR_NAMES = [n for n in NAMES if n != "reward_model"]  # reward_model trains the critic


def test_names_and_unknown():
    assert algorithm_names() == NAMES
    assert all(get_algorithm(n).name == n for n in NAMES)
    with pytest.raises(
        ValueError, match=r"unknown algorithm 'grpoo'; valid names: \['cispo', .*'sft'\]"
    ):
        get_algorithm("grpoo")


@pytest.mark.parametrize(
    ("name", "needs", "groups", "greedy"),
    [
        ("ppo", ("critic", "reference", "reward"), False, False),
        ("grpo", ("reference", "reward"), True, False),
        ("dr_grpo", ("reward",), True, False),
        ("dapo", ("reward",), True, False),
        ("gspo", ("reward",), True, False),
        ("cispo", ("reward",), True, False),
        ("rloo", ("reference", "reward"), True, False),
        ("reinforce_pp", ("reference", "reward"), False, False),
        ("remax", ("reference", "reward"), False, True),
        ("dpo", ("reference",), False, False),
        ("sft", (), False, False),
        ("reward_model", ("critic",), False, False),
        ("distillation", ("reward", "teacher"), False, False),
    ],
)
def test_needs(name, needs, groups, greedy):
    spec = get_algorithm(name)
    roles = ("critic", "reference", "reward", "teacher")
    found = tuple(n for n in roles if getattr(spec, f"needs_{n}"))
    assert found == needs
    assert spec.needs_groups == groups and spec.needs_greedy_baseline == greedy


def test_paper_defaults():
    assert get_algorithm("dr_grpo").scale_by_std is False
    assert get_algorithm("dr_grpo").agg == "seq-mean-token-sum-norm"
    dapo = get_algorithm("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.dynamic_sampling) == (0.2, 0.28, True)
    assert get_algorithm("gspo").policy_loss == "gspo"
    assert get_algorithm("cispo").policy_loss == "cispo"
    assert get_algorithm("grpo").use_kl_loss and get_algorithm("ppo").kl_in_reward


# --------------------------------------------------------------------------- loss contract


def contract_batch(seed=0, B=8, T=6):
    rng = np.random.default_rng(seed)
    mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float64)
    mask[:, 0] = 1.0
    mask[3] = 0.0  # one padding-only sample
    old = -rng.uniform(0.1, 3.0, size=(B, T))
    outputs = {
        "log_probs": old + rng.uniform(-1.5, 1.5, size=(B, T)),
        "entropy": rng.uniform(0.0, 2.0, size=(B, T)),
        "values": rng.normal(size=(B, T)),
    }
    batch = {
        "old_log_probs": old,
        "advantages": rng.normal(size=(B, T)),
        "response_mask": mask,
        "ref_log_probs": old + rng.normal(size=(B, T)) * 0.3,
        "returns": rng.normal(size=(B, T)),
        "values": rng.normal(size=(B, T)),
    }
    n_tok, n_seq = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    return outputs, batch, n_tok, n_seq


def _call(bk, fn, outputs, batch, rows=slice(None)):
    """``fn(outputs, batch)`` on rows ``rows``; ``fn`` closes over the ctx (jax: jitted once)."""
    out = {k: bk.asarray(v[rows]) for k, v in outputs.items()}
    b = {k: bk.asarray(v[rows]) for k, v in batch.items()}
    loss, metrics = bk.call(fn, out, b)
    assert bk.is_native(loss)
    return float(bk.numpy(loss)), {k: float(bk.numpy(v)) for k, v in metrics.items()}


def _loss_fn(name, **overrides):
    return get_algorithm(name).make_actor_loss(entropy_coef=0.01, **overrides)


@pytest.mark.parametrize("name", ACTOR_NAMES)
def test_actor_loss_parity_and_micro_batching(bk, backends, make_ctx, name):
    outputs, batch, n_tok, n_seq = contract_batch()
    loss_fn, ctx = _loss_fn(name), make_ctx(n_tok, n_seq)

    def fn(out, b):
        return loss_fn(out, b, ctx)

    ref_loss, ref_metrics = _call(backends["numpy"], fn, outputs, batch)
    loss, metrics = _call(bk, fn, outputs, batch)
    assert np.isfinite(loss) and metrics.keys() == ref_metrics.keys()
    np.testing.assert_allclose(loss, ref_loss, **PARITY)
    for k in metrics:
        np.testing.assert_allclose(metrics[k], ref_metrics[k], **PARITY, err_msg=k)
    # 8 micro-batches of 2 rows (pairs stay whole for DPO) sum to the full batch
    parts = [_call(bk, fn, outputs, batch, slice(i, i + 2)) for i in range(0, 8, 2)]
    np.testing.assert_allclose(sum(p[0] for p in parts), loss, **REBATCH)
    for k in metrics:
        np.testing.assert_allclose(sum(p[1][k] for p in parts), metrics[k], **REBATCH, err_msg=k)


def test_rl_actor_loss_composition(make_ctx):
    outputs, batch, n_tok, n_seq = contract_batch(1)
    ctx = make_ctx(n_tok, n_seq)
    spec = get_algorithm("grpo").replace(entropy_coef=0.02, kl_loss_coef=0.3, agg="token-mean")
    loss, metrics = spec.make_actor_loss()(outputs, batch, ctx)
    m = batch["response_mask"]
    pg, _ = L.ppo_policy_loss(
        outputs["log_probs"],
        batch["old_log_probs"],
        batch["advantages"],
        m,
        0.2,
        0.2,
        3.0,
        "token-mean",
        n_tok,
        n_seq,
    )
    kl = L.aggregate(
        L.kl_penalty(outputs["log_probs"], batch["ref_log_probs"], "k3"),
        m,
        "token-mean",
        n_tok,
        n_seq,
    )
    ent = (outputs["entropy"] * m).sum() / n_tok
    np.testing.assert_allclose(loss, pg + 0.3 * kl - 0.02 * ent, **PARITY)
    np.testing.assert_allclose(metrics["kl_loss"], kl, **PARITY)
    np.testing.assert_allclose(metrics["entropy"], ent, **PARITY)
    assert set(metrics) == {
        "clipfrac",
        "clipfrac_lower",
        "approx_kl",
        "pg_loss",
        "kl_loss",
        "entropy",
    }


def test_actor_loss_gradients_torch_equal_jax(backends, make_ctx):
    outputs, batch, n_tok, n_seq = contract_batch(2)
    ctx = make_ctx(n_tok, n_seq)
    grads = {}
    for name in RL_NAMES + ["dpo"]:
        fn = _loss_fn(name)
        for bname in ("torch", "jax"):
            b = backends[bname]
            bat = {k: b.asarray(v) for k, v in batch.items()}

            def f(lp, ent, fn=fn, b=b, bat=bat):
                return fn({"log_probs": lp, "entropy": ent}, bat, ctx)[0]

            grads[name, bname] = b.grad(f, outputs["log_probs"], outputs["entropy"])
        for gt, gj in zip(grads[name, "torch"], grads[name, "jax"], strict=True):
            np.testing.assert_allclose(gt, gj, **PARITY, err_msg=name)
        assert np.abs(grads[name, "torch"][0]).sum() > 0, name


def test_actor_loss_under_jax_jit(backends, make_ctx):
    """The backend jits ``value_and_grad(loss_fn)``; the loss must trace (no host syncs).
    One algorithm per policy loss (each jit is a separate compile)."""
    import jax

    outputs, batch, n_tok, n_seq = contract_batch(3)
    b = backends["jax"]
    out = {k: b.asarray(v) for k, v in outputs.items()}
    bat = {k: b.asarray(v) for k, v in batch.items()}
    for name in ("grpo", "gspo", "cispo", "dpo"):
        fn = _loss_fn(name)

        def loss(out, bat, gt, gs, fn=fn):
            return fn(out, bat, _Ctx(gt, gs))

        eager, eager_m = loss(out, bat, n_tok, n_seq)
        (jitted, jit_m), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            out, bat, n_tok, n_seq
        )
        np.testing.assert_allclose(jitted, eager, **PARITY, err_msg=name)
        for k in eager_m:
            np.testing.assert_allclose(jit_m[k], eager_m[k], **PARITY, err_msg=f"{name} {k}")
        assert np.isfinite(np.asarray(grads["log_probs"])).all()


class _Ctx:
    def __init__(self, gt, gs):
        self.global_tokens, self.global_seqs, self.temperature = gt, gs, 1.0


def test_critic_loss(bk, make_ctx):
    outputs, batch, n_tok, n_seq = contract_batch(4)
    critic, ctx = get_algorithm("ppo").make_critic_loss(value_clip=0.2), make_ctx(n_tok, n_seq)
    loss, metrics = _call(bk, lambda out, b: critic(out, b, ctx), outputs, batch)
    ref, ref_m = L.value_loss(
        outputs["values"],
        batch["values"],
        batch["returns"],
        batch["response_mask"],
        0.2,
        "token-mean",
        n_tok,
        n_seq,
    )
    np.testing.assert_allclose(loss, ref, **PARITY)
    assert set(metrics) == {"vf_clipfrac", "vpred_mean"}
    with pytest.raises(ValueError, match=r"algorithm 'grpo' has no critic"):
        get_algorithm("grpo").make_critic_loss()


def test_reward_model_loss_by_hand(bk, make_ctx):
    """Bradley-Terry on interleaved rows (chosen 2i, rejected 2i+1) of ``scores``, by hand:
    pairs (2, 1), (0, 1.5), (3, 3) and a padding pair (no response tokens) that adds
    nothing; ctx.global_seqs = 8 rows = 4 pairs, of which the padding pair's rows are not
    counted by a backend, so 6 real rows = 3 pairs normalise the sums."""
    scores = np.array([2.0, 1.0, 0.0, 1.5, 3.0, 3.0, 9.0, -9.0])
    mask = np.ones((8, 3))
    mask[6:] = 0.0
    fn = get_algorithm("reward_model").make_critic_loss()
    loss, metrics = _call(
        bk,
        lambda out, b: fn(out, b, make_ctx(18.0, 6.0)),
        {"scores": scores},
        {"response_mask": mask},
    )
    # -log sigmoid(h) = log(1 + exp(-h)) for h = 1, -1.5, 0
    losses = [np.log1p(np.exp(-1.0)), np.log1p(np.exp(1.5)), np.log(2.0)]
    np.testing.assert_allclose(loss, sum(losses) / 3, rtol=1e-6)
    np.testing.assert_allclose(metrics["rewards/accuracies"], 1 / 3, rtol=1e-6)  # a tie is wrong
    np.testing.assert_allclose(metrics["rewards/margins"], (1.0 - 1.5 + 0.0) / 3, rtol=1e-6)
    np.testing.assert_allclose(metrics["rewards/chosen"], 5.0 / 3, rtol=1e-6)
    # margin 1 and centring 0.1: h - 1, plus 0.1 (r_c + r_r)^2 = 0.9, 0.225, 3.6
    fn = get_algorithm("reward_model").make_critic_loss(rm_margin=1.0, rm_center_coef=0.1)
    loss, _ = _call(
        bk,
        lambda out, b: fn(out, b, make_ctx(18.0, 6.0)),
        {"scores": scores},
        {"response_mask": mask},
    )
    losses = [np.log(2.0) + 0.9, np.log1p(np.exp(2.5)) + 0.225, np.log1p(np.exp(1.0)) + 3.6]
    np.testing.assert_allclose(loss, sum(losses) / 3, rtol=1e-6)
    with pytest.raises(ValueError, match=r"micro-batch of 3 rows \(odd\)"):
        fn({"scores": scores[:3]}, {"response_mask": mask[:3]}, make_ctx(9.0, 3.0))
    with pytest.raises(
        ValueError, match=r"algorithm 'reward_model' \(reward_model\) trains no actor"
    ):
        get_algorithm("reward_model").make_actor_loss()


def test_dpo_actor_loss_interleaved(make_ctx):
    outputs, batch, _, _ = contract_batch(5)
    batch["response_mask"][3] = 1.0
    fn = get_algorithm("dpo").make_actor_loss(beta=0.2)
    loss, metrics = fn(outputs, batch, make_ctx(100.0, 8.0))  # 8 rows = 4 pairs
    m = batch["response_mask"]
    seq = (outputs["log_probs"] * m).sum(-1)
    ref = (batch["ref_log_probs"] * m).sum(-1)
    losses, _ = L.dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=0.2)
    np.testing.assert_allclose(loss, losses.sum() / 4, **PARITY)
    assert set(metrics) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
    }
    odd = {k: v[:3] for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"micro-batch of 3 rows \(odd\)"):
        fn({k: v[:3] for k, v in outputs.items()}, odd, make_ctx(1.0, 3.0))


def test_dpo_actor_loss_ignores_padding_pairs(make_ctx):
    """A backend pads batches to shape buckets with rows whose response_mask is 0; a pair
    of such rows must change neither the loss nor the metrics."""
    outputs, batch, _, _ = contract_batch(5)
    fn = get_algorithm("dpo").make_actor_loss(beta=0.2)
    real_rows = int((batch["response_mask"].sum(-1) > 0).sum())
    ctx = make_ctx(float(batch["response_mask"].sum()), float(real_rows))
    base_loss, base_metrics = fn(outputs, batch, ctx)

    def pad(v):
        return np.concatenate([v, np.zeros_like(v[:2])])

    loss, metrics = fn(
        {k: pad(v) for k, v in outputs.items()}, {k: pad(v) for k, v in batch.items()}, ctx
    )
    np.testing.assert_allclose(loss, base_loss, **PARITY)
    for key in base_metrics:
        np.testing.assert_allclose(metrics[key], base_metrics[key], **PARITY)


def test_entropy_coef_needs_entropy(make_ctx):
    outputs, batch, n_tok, n_seq = contract_batch()
    del outputs["entropy"]
    fn = get_algorithm("grpo").make_actor_loss(entropy_coef=0.01)
    with pytest.raises(ValueError, match=r"entropy_coef=0.01 needs outputs\['entropy'\]"):
        fn(outputs, batch, make_ctx(n_tok, n_seq))
    loss, metrics = get_algorithm("grpo").make_actor_loss()(outputs, batch, make_ctx(n_tok, n_seq))
    assert "entropy" not in metrics and np.isfinite(loss)


def test_loss_functions_pickle_and_hash():
    fns = [get_algorithm(name).make_actor_loss() for name in ACTOR_NAMES]
    for fn in fns + [get_algorithm(n).make_critic_loss() for n in ("ppo", "reward_model")]:
        assert pickle.loads(pickle.dumps(fn)) == fn
        hash(fn)


@pytest.mark.parametrize("name", RL_NAMES)
def test_compute_advantages(name):
    rng = np.random.default_rng(0)
    r = np.zeros((6, 4))
    r[:, -1] = rng.integers(0, 2, size=6)
    cols = {
        "token_rewards": r,
        "response_mask": np.ones((6, 4)),
        "values": rng.normal(size=(6, 4)),
        "group_ids": np.repeat([0, 1], 3),
        "baseline_scores": np.full(6, 0.5),
        "old_log_probs": -rng.random((6, 4)),
        "teacher_log_probs": -rng.random((6, 4)),
    }
    adv, ret = get_algorithm(name).compute_advantages(cols)
    assert adv.shape == ret.shape == (6, 4) and np.isfinite(adv).all()
    spec = get_algorithm(name)
    est = A.ADVANTAGE_ESTIMATORS[spec.advantage]
    optional = {c: cols[c] for c in est.optional}
    hparams = {h: getattr(spec, h) for h in est.hparams}
    direct = est.fn(*(cols[c] for c in est.columns), **optional, **hparams)
    direct = direct[0] if est.metrics else direct
    np.testing.assert_allclose(adv, direct[0] if est.returns_pair else direct, **PARITY)


def test_distillation_needs_groups_only_with_a_task_reward():
    spec = get_algorithm("distillation")
    assert not spec.needs_groups and not spec.needs_reference
    assert spec.replace(task_reward_coef=0.5).needs_groups
    with pytest.raises(ValueError, match=r"task_reward_coef=-1.0 must be >= 0"):
        spec.replace(task_reward_coef=-1.0)
    with pytest.raises(ValueError, match=r"distill_discount=2.0 in \[0, 1\]"):
        spec.replace(distill_discount=2.0)


def test_distillation_advantages_through_the_spec():
    """The registry's distillation entry, by hand: A = -coef (student - teacher) on
    valid tokens, plus task_reward_coef x GRPO's (s - mean) / std of each group."""
    student = np.array([[-1.0, -2.0, -0.5], [-0.2, -0.3, -4.0]])
    teacher = np.array([[-1.5, -1.0, -9.0], [-0.2, -1.3, -1.0]])
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # scores 1 and 0
    cols = {
        "token_rewards": rewards,
        "response_mask": mask,
        "old_log_probs": student,
        "teacher_log_probs": teacher,
        "group_ids": np.array([7, 7]),
    }
    spec = get_algorithm("distillation")
    adv, ret, metrics = spec.compute_advantages(cols, with_metrics=True, distill_coef=2.0)
    # d = student - teacher on valid tokens: [0.5, -1.0, -], [0.0, 1.0, -3.0]
    want = np.array([[-1.0, 2.0, 0.0], [0.0, -2.0, 6.0]])
    np.testing.assert_allclose(adv, want, atol=1e-12)
    np.testing.assert_allclose(ret, want, atol=1e-12)
    assert metrics["distill/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0 + 1.0 - 3.0) / 5)
    assert metrics["distill/tokens"] == 5
    # a group of two with scores 1, 0: mean 0.5, unbiased std sqrt(0.5)
    task = np.array([0.5, -0.5]) / (np.sqrt(0.5) + 1e-6)
    mixed, _ = spec.compute_advantages(cols, task_reward_coef=0.25)
    np.testing.assert_allclose(mixed, want / 2 + 0.25 * task[:, None] * mask, atol=1e-12)
    # distill_baseline: d minus its mean (0.5 - 1 + 0 + 1 - 3) / 5 = -0.5, i.e. -(d + 0.5)
    centred, _ = spec.compute_advantages(cols, distill_baseline=True)
    np.testing.assert_allclose(centred, [[-1.0, 0.5, 0.0], [-0.5, -1.5, 2.5]], atol=1e-12)


def test_kl_controller_from_spec():
    ctrl = get_algorithm("ppo").make_kl_controller(kl_ctrl="adaptive", kl_coef=0.2)
    coef, _ = ctrl.update(1.0, 100, ctrl.init())  # e = clip(1 / 0.1 - 1) = 0.2
    assert coef == pytest.approx(0.2 * (1 + 0.2 * 100 / 10000), rel=1e-12)


def test_overrides_and_validation():
    spec = get_algorithm("ppo")
    fn = spec.make_actor_loss(clip_high=0.28, agg="seq-mean-token-mean")
    assert dict(fn.loss_kwargs)["clip_high"] == 0.28 and fn.agg == "seq-mean-token-mean"
    assert spec.clip_high == 0.2  # the registered spec is unchanged
    with pytest.raises(
        ValueError, match=r"unknown hyper-parameter\(s\) \['clip'\]; valid: .*'clip_high'"
    ):
        spec.make_actor_loss(clip=0.3)
    with pytest.raises(
        ValueError,
        match=r"AlgorithmSpec.agg: unknown value 'mean'; valid choices: "
        r"\['seq-mean-token-mean'",
    ):
        spec.replace(agg="mean")
    with pytest.raises(
        ValueError,
        match=r"AlgorithmSpec.advantage: unknown value 'vtrace'; valid "
        r"choices: \['distillation', 'gae', 'grpo'",
    ):
        AlgorithmSpec(name="x", advantage="vtrace")
    with pytest.raises(ValueError, match=r"AlgorithmSpec.kl_loss_kind: unknown value 'k5'"):
        AlgorithmSpec(name="x", kl_loss_kind="k5")
    with pytest.raises(ValueError, match=r"dual_clip must be > 1.0 or None, got 0.9"):
        AlgorithmSpec(name="x", dual_clip=0.9)
    assert set(ALGORITHMS) == set(NAMES)


def test_algos_imports_only_tensor_numpy_stdlib():
    """Stricter than the import-linter contract (tests/core/test_layering.py), which only
    forbids frameworks and backends: algos/ may import nothing else from polyrl either."""
    import ast
    import pathlib
    import sys

    allowed_roots = set(sys.stdlib_module_names) | {"numpy", "__future__"}
    root = pathlib.Path(__file__).resolve().parents[2] / "algos"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                ok = (
                    name.split(".")[0] in allowed_roots
                    or name == "polyrl.tensor"
                    or name.startswith("polyrl.algos")
                )
                assert ok, (
                    f"{path.name} imports {name}: algos/ may import only polyrl.tensor, numpy, stdlib"
                )
