"""CausalLM.token_scores (LM head fused with log-probs/entropy, in rematerialised chunks)
equals the full-logits computation, values and gradients, for any chunk size."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from polyrl.backends.jax_pjit.engine import JaxPjitEngine  # noqa: E402
from polyrl.config import ModelConfig, ParallelConfig  # noqa: E402

# fp32 on CPU; only the matmul shapes / summation order differ (~1e-7 observed).
ATOL = 1e-5
VOCAB = 58  # sampling_vocab_size of the tiny model (its embedding is padded to 64)


def _full(model, hidden, ids, temperature):
    """Textbook: all logits at once, log_softmax, gather, entropy."""
    logits = model.logits(hidden)[..., :VOCAB] / temperature
    logp = jax.nn.log_softmax(logits, -1)
    lp = jnp.take_along_axis(logp, ids[..., None], -1)[..., 0]
    return lp, -(jnp.exp(logp) * logp).sum(-1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = JaxPjitEngine(devices=jax.devices()[:1])
    eng.init(ModelConfig(str(tiny_model_dir), role="reference"), None, ParallelConfig())
    return eng


@pytest.mark.parametrize("chunk", [1, 10, 4096])
def test_token_scores_equal_full_logits_with_gradients(engine, chunk):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3, 7, engine.config.hidden_size)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, VOCAB, (3, 7)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)

    def objective(params, hidden, scores):
        lp, ent = scores(engine._module(engine.frozen, params), hidden)
        return ((lp - 0.3 * ent) * weights).sum(), (lp, ent)

    def chunked(model, h):
        return model.token_scores(h, ids, 0.7, entropy=True, vocab=VOCAB, chunk_tokens=chunk)

    grad = jax.grad(objective, argnums=(0, 1), has_aux=True)
    (gp, gh), (lp, ent) = grad(engine.params, hidden, chunked)
    (wp, wh), (wlp, went) = grad(engine.params, hidden, lambda m, h: _full(m, h, ids, 0.7))
    np.testing.assert_allclose(lp, wlp, atol=ATOL)
    np.testing.assert_allclose(ent, went, atol=ATOL)
    np.testing.assert_allclose(gh, wh, atol=ATOL)
    for name in wp:
        np.testing.assert_allclose(gp[name], wp[name], atol=ATOL, err_msg=name)
    # only the head (tied: the embedding) receives a gradient from this objective
    assert np.abs(np.asarray(gp["model.embed_tokens.weight"])).max() > 1e-3


def test_entropy_off_returns_none_and_same_log_probs(engine):
    hidden = jnp.ones((2, 5, engine.config.hidden_size), jnp.float32)
    ids = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    model = engine._module(engine.frozen, engine.params)
    lp, ent = model.token_scores(hidden, ids, 1.0, entropy=False, vocab=VOCAB, chunk_tokens=3)
    assert ent is None
    np.testing.assert_allclose(lp, _full(model, hidden, ids, 1.0)[0], atol=ATOL)


def _dots(jaxpr) -> list:
    """Every dot_general of ``jaxpr`` and of the jaxprs inside it (lax.map, remat)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for sub in jax.core.jaxprs_in_params(eqn.params):
            found += _dots(sub)
    return found


def test_bf16_head_gradients_run_bf16_gemms(tiny_model_dir):
    """In bf16 the chunked head's forward and backward GEMMs all take bf16 operands, as
    the torch backend's ``F.linear(...).float()``: an fp32 GEMM output would make the
    backward GEMMs fp32 (TF32 on GPU, the JAX train step's slowest GEMMs)."""
    eng = JaxPjitEngine(devices=jax.devices()[:1])
    eng.init(
        ModelConfig(str(tiny_model_dir), role="reference", dtype="bfloat16"), None, ParallelConfig()
    )
    hidden = jnp.ones((2, 5, eng.config.hidden_size), jnp.bfloat16)
    ids = jnp.zeros((2, 5), jnp.int32)

    def objective(params, hidden):
        model = eng._module(eng.frozen, params)
        lp, ent = model.token_scores(hidden, ids, 1.0, entropy=True, vocab=VOCAB, chunk_tokens=4)
        return (lp + ent).sum()

    jaxpr = jax.make_jaxpr(jax.grad(objective, argnums=(0, 1)))(eng.params, hidden).jaxpr
    dots = _dots(jaxpr)
    assert len(dots) >= 3  # the forward GEMM and its two transposes (input, weight)
    operands = [tuple(str(v.aval.dtype) for v in eqn.invars) for eqn in dots]
    assert all(o == ("bfloat16", "bfloat16") for o in operands), operands
