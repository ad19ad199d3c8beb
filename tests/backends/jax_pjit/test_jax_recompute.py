"""ModelConfig.checkpoint_policy on the JAX backend: what each policy saves for the
backward pass (none > selective > full), read from JAX's own residual list. (That every
policy gives the same update: the contract suite, tests/backends/test_contract.py.)"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import print_saved_residuals  # noqa: E402

from polyrl.backends.jax_pjit import recompute  # noqa: E402
from polyrl.backends.jax_pjit.engine import JaxPjitEngine  # noqa: E402
from polyrl.config import ModelConfig, ParallelConfig  # noqa: E402

POLICIES = {"none": {}, "full": {"checkpoint_policy": "full"}}
POLICIES["selective"] = {"checkpoint_policy": "selective"}
# the tiny model's 2 layers: the first recomputed whole, the second keeps everything
POLICIES["budget"] = {"checkpoint_policy": "budget", "activation_memory_budget": 0.5}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    out = {}
    for name, kw in POLICIES.items():
        eng = JaxPjitEngine(devices=jax.devices()[:1])
        # a frozen role: the engine's model and fp32 params, without an optimizer
        model = ModelConfig(
            str(tiny_model_dir), role="reference", gradient_checkpointing=name != "none", **kw
        )
        eng.init(model, None, ParallelConfig())
        out[name] = eng
    return out


def _objective(engine):
    """params -> a weighted sum of the decoder's hidden states (4 rows x 32 tokens)."""
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(4, 58, (4, 32)), jnp.int32)
    segments, positions = jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(32), ids.shape)
    weights = jnp.asarray(rng.normal(size=(4, 32, engine.config.hidden_size)), jnp.float32)

    def f(params):
        return (engine._module(engine.frozen, params)(ids, segments, positions) * weights).sum()

    return f


def test_selective_saves_less_than_none_more_than_full(engines):
    """Bytes of the residuals ``jax.vjp`` keeps for the backward pass (the leaves of its
    pullback; the parameters, kept by every policy, included), and which: "selective"
    keeps the projections' outputs and the named attention output of every layer, "full"
    neither (JAX's own residual report)."""
    saved, report = {}, {}
    for name, e in engines.items():
        _, pullback = jax.vjp(_objective(e), e.params)
        leaves = {id(x): x for x in jax.tree.leaves(pullback) if isinstance(x, jax.Array)}
        saved[name] = sum(x.nbytes for x in leaves.values())
        with contextlib.redirect_stdout(io.StringIO()) as out:
            print_saved_residuals(_objective(e), e.params)
        report[name] = out.getvalue()
    print("jax saved bytes", saved)
    assert saved["none"] > saved["selective"] > saved["full"], saved
    layers = engines["selective"].config.num_layers
    assert report["selective"].count(f"named '{recompute.ATTENTION_OUT}'") == layers, report
    # the projections are dots without batch dimensions: saved (at least q, k, v, gate and
    # up per layer; JAX keeps only what the backward pass reads)
    assert report["selective"].count("output of dot_general") >= 5 * layers, report
    for kept in (recompute.ATTENTION_OUT, "output of dot_general"):
        assert kept not in report["full"], report["full"]


def test_a_budget_saves_between_full_and_none(engines):
    """ "budget" 0.5 on the 2 layers: one layer keeps what "none" keeps, the other what
    "full" keeps, so the residuals lie between theirs."""
    saved = {}
    for name in ("none", "budget", "full"):
        _, pullback = jax.vjp(_objective(engines[name]), engines[name].params)
        leaves = {id(x): x for x in jax.tree.leaves(pullback) if isinstance(x, jax.Array)}
        saved[name] = sum(x.nbytes for x in leaves.values())
    assert saved["none"] > saved["budget"] > saved["full"], saved


@pytest.mark.parametrize(
    ("policy", "budget", "layers", "recomputed"),
    [("budget", 0.6, 28, 11), ("budget", 1.0, 28, 0), ("budget", 0.01, 4, 4),
     ("full", 0.6, 28, 28), (None, 0.6, 28, 0)],
)  # fmt: skip
def test_which_layers_a_policy_checkpoints(policy, budget, layers, recomputed):
    """round((1 - 0.6) * 28) = 11 of Qwen2.5-1.5B's layers under "budget" 0.6."""
    flags = [recompute.layer_remat(policy, budget, i, layers)[0] for i in range(layers)]
    assert sum(flags) == recomputed and flags == sorted(flags, reverse=True)
