"""train_step(): parity with a plain transformers + torch.optim.AdamW step, schedules,
CPU offload, and that training actually learns. (Micro-batch, padding, packing and
recompute invariance: the contract suite, tests/backends/test_contract.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_fsdp_helpers import PARITY_EPS, actor, full_weights, nll_loss, random_batch

from polyrl.backends import get_engine
from polyrl.batch import Batch, from_token_lists
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

# Same fp32 math, different summation order (micro-batch accumulation, sharded norm,
# batched vs per-sample): loss/grad norm differ ~1e-7 relative; 1e-5 leaves headroom.
RTOL = 1e-5
# Weights: one step moves each by ~lr (1e-3..1e-2, Adam); with PARITY_EPS the noise is
# <= ~3e-7 absolute (see torch_fsdp_helpers), so 1e-6 is <= 1e-3 of one update.
ATOL_W = 1e-6


def _assert_weights_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=ATOL_W)


def test_step_matches_plain_transformers_adamw(tiny_model_dir):
    """Loss, pre-clip grad norm and updated weights equal one hand-written step: HF model,
    token-mean NLL over the whole batch, clip_grad_norm_, torch AdamW."""
    from transformers import AutoModelForCausalLM

    batch = random_batch(8, seed=0)
    engine = actor(tiny_model_dir, micro_batch_size=3, lr=1e-2, grad_clip=1.0, weight_decay=0.1)
    metrics = engine.train_step(batch, nll_loss)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS)
    t = {k: torch.from_numpy(v).long() for k, v in batch.tensors.items() if k != "response_mask"}
    mask = torch.from_numpy(batch["response_mask"])
    R = t["responses"].shape[1]
    logits = model(
        t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
    ).logits[:, -R - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, t["responses"][..., None])[..., 0]
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()

    assert metrics["loss"] == pytest.approx(loss.item(), rel=RTOL)
    assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=RTOL)
    assert metrics["grad_norm"] > 1.0  # so clipping was exercised
    assert metrics["tokens"] == metrics["global_tokens"] == mask.sum().item()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    _assert_weights_close(full_weights(engine), expected)


def test_lr_follows_warmup_cosine_schedule(tiny_model_dir):
    """Hand-worked: lr 1e-3, warmup 1e-3 * (s+1)/2 for s < 2, then cosine over the
    remaining total_steps - warmup = 2 steps: 1e-3 * (1 + cos(pi * k/2)) / 2, k = 0, 1, 2."""
    engine = actor(tiny_model_dir, lr=1e-3, warmup_steps=2, total_steps=4, schedule="cosine")
    lrs = [engine.train_step(random_batch(4, seed=s), nll_loss)["lr"] for s in range(5)]
    np.testing.assert_allclose(lrs, [5e-4, 1e-3, 1e-3, 5e-4, 0.0], atol=1e-12)


def _copy_task(tokenizer, n: int, seed: int) -> Batch:
    """SFT pairs of the tiny copy task: chat prompt "copy 471" -> "471<|im_end|>"."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(n):
        digits = "".join(map(str, rng.integers(0, 10, 3)))
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"copy {digits}"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompts.append(tokenizer(text)["input_ids"])
        responses.append(tokenizer(digits)["input_ids"] + [tokenizer.eos_token_id])
    return from_token_lists(prompts, responses, pad_id=tokenizer.pad_token_id)


def test_sft_steps_lower_train_and_heldout_loss(tiny_model_dir):
    engine = actor(tiny_model_dir, micro_batch_size=8, lr=3e-3)
    train, heldout = _copy_task(engine.tokenizer, 16, 0), _copy_task(engine.tokenizer, 16, 1)

    def heldout_nll() -> float:
        lp = engine.forward(heldout)["log_probs"]
        return float(-lp.sum() / heldout["response_mask"].sum())

    before = heldout_nll()
    losses = [engine.train_step(train, nll_loss)["loss"] for _ in range(8)]
    # Random init: ~log(58) = 4.1 nats per token; 8 Adam steps at 3e-3 reach < 3.
    assert losses[0] > 3.5 and losses[-1] < 0.75 * losses[0], losses
    assert heldout_nll() < 0.8 * before


def test_critic_fits_a_toy_regression(tiny_model_dir):
    """Value head + backbone regress per-token targets (1 on even token ids, -1 on odd)."""
    engine = get_engine("torch_fsdp")()
    engine.init(
        ModelConfig(str(tiny_model_dir), role="critic"),
        OptimConfig(lr=3e-3),
        ParallelConfig(micro_batch_size=4),
    )
    batch = random_batch(8, seed=3)
    targets = np.where(batch["responses"] % 2 == 0, 1.0, -1.0).astype(np.float32)
    batch = batch.with_columns({"returns": targets})

    def mse(outputs, b, ctx):
        err = (outputs["values"] - b["returns"]) ** 2 * b["response_mask"]
        return err.sum() / ctx.global_tokens, {}

    losses = [engine.train_step(batch, mse)["loss"] for _ in range(20)]
    # Zero-initialised head: values start at 0, so the first MSE is exactly 1.
    assert losses[0] == pytest.approx(1.0, abs=1e-6)
    assert losses[-1] < 0.1, losses  # observed ~0.01 after 20 steps


def test_frozen_reference_cannot_train(tiny_model_dir):
    engine = get_engine("torch_fsdp")()
    engine.init(ModelConfig(str(tiny_model_dir), role="reference"), None, ParallelConfig())
    assert engine.optimizer is None
    assert not any(p.requires_grad for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="role 'reference' is frozen.*'actor' and 'critic'"):
        engine.train_step(random_batch(2), nll_loss)


def test_cpu_offload_does_not_change_the_update(tiny_model_dir):
    """FSDP CPU offload trades speed for memory and must leave loss, grad norm and weights
    as they were. (On a CPU world it moves nothing; this proves the CPUOffloadPolicy path
    runs and changes no result. Recompute's update is the contract suite's,
    tests/backends/test_contract.py; what each checkpoint policy keeps, test_recompute.)"""
    batch = random_batch(8, seed=4)
    runs = []
    for offload in (False, True):
        engine = actor(tiny_model_dir, micro_batch_size=4, parallel={"cpu_offload": offload})
        runs.append((engine.train_step(batch, nll_loss), full_weights(engine)))
    (m_off, w_off), (m_on, w_on) = runs
    for key in ("loss", "grad_norm"):
        assert m_on[key] == pytest.approx(m_off[key], rel=RTOL), key
    _assert_weights_close(w_on, w_off)


def test_gradient_checkpointing_reaches_the_model(tiny_model_dir):
    """The switch reaches transformers' layers (that it changes no update: the contract)."""
    for on in (False, True):
        engine = get_engine("torch_fsdp")()
        model = ModelConfig(str(tiny_model_dir), gradient_checkpointing=on)
        engine.init(model, OptimConfig(lr=1e-3), ParallelConfig())
        assert (
            any(getattr(m, "gradient_checkpointing", False) for m in engine.model.modules()) == on
        )
