"""torch_fsdp = jax_pjit: same checkpoint, same batch, same algos loss -> same numbers.

Two independent references for the JAX engine:

* a hand-written step with transformers + ``torch.optim.AdamW`` +
  ``clip_grad_norm_`` (no polyrl backend code at all), and
* the torch backend's ``TorchFSDPEngine`` (world of one, in process).

Compared: per-token log-probs, loss, pre-clip gradient global norm, and every weight
after one AdamW step (with weight decay, clipping active and a warmup learning rate).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from polyrl.algos.registry import get_algorithm  # noqa: E402
from polyrl.backends import get_engine  # noqa: E402
from polyrl.backends.base import LossContext  # noqa: E402
from polyrl.batch import from_token_lists  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

LOSS = get_algorithm("grpo").make_actor_loss(entropy_coef=0.01)
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5, warmup_steps=4, total_steps=10)
TEMPERATURE = 0.8
# fp32 in both frameworks; matmul/softmax/reduction order differs (XLA vs ATen), so
# O(1) log-probs and losses agree to a few ulps per layer.
TOL = 2e-5
# grad norm sums ~300k squared terms in different orders.
TOL_NORM = 1e-4
# Adam's per-element normalisation turns the relative rounding error of tiny gradient
# elements into update error of at most lr; 1% of lr bounds it.
TOL_WEIGHTS = 1e-2 * OPTIM.lr


def _batch():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 58, rng.integers(1, 9))) for _ in range(6)]
    resps = [list(rng.integers(3, 58, rng.integers(1, 11))) for _ in range(6)]
    b = from_token_lists(prompts, resps, pad_id=0)
    shape, mask = b["responses"].shape, b["response_mask"]
    old = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    ref = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (6, 1)), shape[1], axis=1).astype(np.float32) * mask
    return b.with_columns({"old_log_probs": old, "ref_log_probs": ref, "advantages": adv})


def _jax_engine(path, pack: bool = False):
    eng = get_engine("jax_pjit")(devices=jax.devices()[:1])
    eng.init(ModelConfig(str(path)), OPTIM, ParallelConfig(micro_batch_size=4, pack_sequences=pack))
    return eng


def _weights(engine):
    return {
        k: np.array(v.detach().float().cpu() if isinstance(v, torch.Tensor) else v)
        for bucket in engine.export_weights(1 << 22)
        for k, v in bucket
    }


def _run(engine, batch):
    fwd = engine.forward(batch, temperature=TEMPERATURE, entropy=True)
    metrics = engine.train_step(batch, LOSS, temperature=TEMPERATURE, entropy=True)
    return fwd, metrics, _weights(engine)


def _reference_step(path, batch):
    """transformers + torch.optim.AdamW, written out: the semantics both backends promise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=OPTIM.lr_at(0),
        betas=OPTIM.betas,
        eps=OPTIM.eps,
        weight_decay=OPTIM.weight_decay,
    )
    cols = {k: torch.as_tensor(v) for k, v in batch.tensors.items()}
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = (
        model(
            input_ids=cols["input_ids"].long(),
            attention_mask=cols["attention_mask"].long(),
            position_ids=cols["position_ids"].long(),
        ).logits[:, p - 1 : p - 1 + r]
        / TEMPERATURE
    )
    logp = torch.log_softmax(logits, -1)
    mask = cols["response_mask"]
    outputs = {
        "log_probs": logp.gather(-1, cols["responses"].long()[..., None])[..., 0] * mask,
        "entropy": -(logp.exp() * logp).sum(-1) * mask,
    }
    ctx = LossContext(float(mask.sum()), float((mask.sum(1) > 0).sum()), TEMPERATURE)
    loss, _ = LOSS(outputs, cols, ctx)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
    opt.step()
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return outputs["log_probs"].detach().numpy(), float(loss.detach()), float(norm), weights


def _compare(fwd, metrics, weights, log_probs, loss, norm, ref_weights):
    np.testing.assert_allclose(fwd["log_probs"], log_probs, atol=TOL)
    assert metrics["loss"] == pytest.approx(loss, abs=TOL)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=TOL_NORM)
    assert metrics["grad_norm"] > OPTIM.grad_clip  # the clip is exercised
    assert metrics["lr"] == OPTIM.lr_at(0)
    assert set(weights) == set(ref_weights)
    for name, w in ref_weights.items():
        np.testing.assert_allclose(weights[name], w, atol=TOL_WEIGHTS, err_msg=name)


def test_jax_engine_matches_transformers_and_torch_adamw(tiny_model_dir):
    batch = _batch()
    _compare(*_run(_jax_engine(tiny_model_dir), batch), *_reference_step(tiny_model_dir, batch))


def test_jax_engine_matches_torch_engine(tiny_model_dir):
    """Both packed (the torch engine with its varlen attention): each backend's packed =
    padded is tested on its own, and padded JAX = transformers above."""
    batch = _batch()
    torch_engine = get_engine("torch_fsdp")()
    torch_engine.init(
        ModelConfig(str(tiny_model_dir), attn_implementation="polyrl_varlen"),
        OPTIM,
        ParallelConfig(micro_batch_size=4, pack_sequences=True),
    )
    t_fwd, t_metrics, t_weights = _run(torch_engine, batch)
    j_fwd, j_metrics, j_weights = _run(_jax_engine(tiny_model_dir, pack=True), batch)
    np.testing.assert_allclose(j_fwd["entropy"], t_fwd["entropy"], atol=TOL)
    for key in ("pg_loss", "kl_loss", "entropy", "clipfrac", "global_tokens", "global_seqs"):
        assert j_metrics[key] == pytest.approx(t_metrics[key], abs=TOL), key
    _compare(
        j_fwd,
        j_metrics,
        j_weights,
        t_fwd["log_probs"],
        t_metrics["loss"],
        t_metrics["grad_norm"],
        t_weights,
    )
