"""export_weights / save_hf against fresh transformers models, DCP resume exactness,
offload/reload."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch_fsdp_helpers import actor, full_weights, nll_loss, random_batch

from polyrl.backends import get_engine
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """An actor after two updates (weights differ from the checkpoint on disk)."""
    engine = actor(tiny_model_dir, lr=1e-2)
    for seed in range(2):
        engine.train_step(random_batch(8, seed=seed), nll_loss)
    return engine


def _logits(model, batch) -> torch.Tensor:
    t = {
        k: torch.from_numpy(batch[k]).long()
        for k in ("input_ids", "attention_mask", "position_ids")
    }
    with torch.no_grad():
        return model(
            t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
        ).logits


def test_export_keys_are_save_pretrained_keys(tiny_model_dir, trained):
    """Exactly the keys transformers' save_pretrained wrote for the tiny model (tied
    lm_head left out), buckets within bucket_bytes unless a single tensor is larger."""
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        hf_keys = set(f.keys())
    bucket_bytes = 100_000
    buckets = list(trained.export_weights(bucket_bytes))
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(hf_keys) and len(names) == len(set(names))
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1
    assert len(buckets) > 1


def test_exported_weights_give_identical_logits(tiny_model_dir, trained):
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = random_batch(4, seed=9)
    before = _logits(fresh, batch)
    missing, unexpected = fresh.load_state_dict(full_weights(trained), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    after = _logits(fresh, batch)
    assert not torch.allclose(before, after)  # the export carries the trained weights
    # The same weights through the engine's forward: log-probs from these logits.
    lp = trained.forward(batch)["log_probs"]
    R = batch["responses"].shape[1]
    ref = torch.log_softmax(after[:, -R - 1 : -1], -1).gather(
        -1, torch.from_numpy(batch["responses"]).long()[..., None]
    )[..., 0]
    ref = ref * torch.from_numpy(batch["response_mask"])
    # fp32, same batch shapes, same ops: 1e-6 covers kernel-level nondeterminism.
    np.testing.assert_allclose(lp, ref.numpy(), atol=1e-6)


def test_save_hf_loads_in_transformers(tiny_model_dir, trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained.save_hf(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    weights = full_weights(trained)
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


def test_critic_save_hf_is_a_sequence_classifier(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    critic = get_engine("torch_fsdp")()
    critic.init(
        ModelConfig(str(tiny_model_dir), role="critic"), OptimConfig(lr=1e-2), ParallelConfig()
    )
    batch = random_batch(4, seed=4)
    target = batch.with_columns({"ret": np.ones_like(batch["response_mask"])})
    critic.train_step(
        target,
        lambda o, b, c: (
            ((o["values"] - b["ret"]) ** 2 * b["response_mask"]).sum() / c.global_tokens,
            {},
        ),
    )
    critic.save_hf(str(tmp_path))
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.score.weight.abs().sum() > 0  # the trained head, not a fresh zero/random one
    single = random_batch(1, seed=6)
    with torch.no_grad():
        expect = hf(torch.from_numpy(single["input_ids"]).long()).logits[0, 0].item()
    reward = get_engine("torch_fsdp")()
    reward.init(ModelConfig(str(tmp_path), role="reward_model"), None, ParallelConfig())
    assert reward.forward(single)["scores"][0] == pytest.approx(expect, abs=1e-5)


def test_resume_is_bit_exact(tiny_model_dir, tmp_path):
    """step 1, save, step 2 == load into a fresh engine, step 2 (loss, grad norm, weights,
    lr schedule position): bit-exact on CPU (same ops, same order, restored Adam state)."""
    batches = [random_batch(8, seed=s) for s in range(2)]
    optim = {"warmup_steps": 3, "total_steps": 10, "schedule": "cosine"}
    a = actor(tiny_model_dir, lr=1e-2, **optim)
    a.train_step(batches[0], nll_loss)
    a.save(str(tmp_path / "ckpt"))
    expected = a.train_step(batches[1], nll_loss)

    b = actor(tiny_model_dir, lr=1e-2, **optim)
    b.load(str(tmp_path / "ckpt"))
    assert b.step == 1
    got = b.train_step(batches[1], nll_loss)
    assert got == expected
    wa, wb = full_weights(a), full_weights(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_forward_after_offload_reload_is_unchanged(trained):
    batch = random_batch(4, seed=7)
    before = trained.forward(batch)["log_probs"]
    trained.offload()
    with pytest.raises(RuntimeError, match="offloaded; call reload"):
        trained.forward(batch)
    trained.reload()
    np.testing.assert_array_equal(trained.forward(batch)["log_probs"], before)
    trained.train_step(batch, nll_loss)  # the optimizer state came back too
