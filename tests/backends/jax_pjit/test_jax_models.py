"""Flax NNX models vs transformers: logits, RoPE variants, value heads, name table, errors.

Every reference value comes from transformers (torch, fp32) on the same checkpoint;
nothing is copied from the JAX code under test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from polyrl.backends.jax_pjit.engine import JaxPjitEngine  # noqa: E402
from polyrl.backends.jax_pjit.models import TransformerConfig, rope_inv_freq  # noqa: E402
from polyrl.batch import from_token_lists  # noqa: E402
from polyrl.config import ModelConfig, ParallelConfig  # noqa: E402

# fp32 end to end; XLA and torch sum in different orders (and XLA's CPU exp/log are
# polynomial approximations), so logits of O(1) differ by a few ulps per layer.
TOL_TINY = 2e-5
# hidden 896 / intermediate 4864: longer dot products, larger accumulated rounding.
TOL_WIDE = 1e-4


def _save_random(tmp_path, cls, config, seed=0):
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _batch(vocab, seed=0, prompt_lens=(3, 7, 5, 2), resp_lens=(4, 1, 6, 3)):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, vocab, n)) for n in prompt_lens]
    resps = [list(rng.integers(3, vocab, n)) for n in resp_lens]
    return from_token_lists(prompts, resps, pad_id=0)


def _hf_log_probs(model, batch, temperature):
    """log_softmax(logits / T) at the response tokens, from transformers."""
    with torch.no_grad():
        logits = model(
            input_ids=torch.as_tensor(batch["input_ids"]).long(),
            attention_mask=torch.as_tensor(batch["attention_mask"]).long(),
            position_ids=torch.as_tensor(batch["position_ids"]).long(),
        ).logits
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : p - 1 + r].double() / temperature, -1)
    ids = torch.as_tensor(batch["responses"]).long()[..., None]
    return logp.gather(-1, ids)[..., 0].numpy() * batch["response_mask"], logp


def _engine(path, role="reference", mesh=None, **model_kw):
    parallel = ParallelConfig(mesh=mesh or {"data": 1, "fsdp": 1, "tensor": 1}, micro_batch_size=4)
    eng = JaxPjitEngine(devices=jax.devices()[: parallel.world_size])
    eng.init(ModelConfig(str(path), role=role, **model_kw), None, parallel)
    return eng


def _check_parity(path, hf_model, vocab, tol, mesh=None, temperature=0.7):
    batch = _batch(vocab)
    want, logp = _hf_log_probs(hf_model, batch, temperature)
    out = _engine(path, mesh=mesh).forward(batch, temperature=temperature, entropy=True)
    np.testing.assert_allclose(out["log_probs"], want, atol=tol, rtol=0)
    ent = -(logp.exp() * logp).sum(-1).numpy() * batch["response_mask"]
    np.testing.assert_allclose(out["entropy"], ent, atol=tol, rtol=0)
    assert np.all(out["log_probs"][batch["response_mask"] == 0] == 0)


def test_tiny_qwen2_logprobs_match_transformers(tiny_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    _check_parity(tiny_model_dir, hf, hf.config.vocab_size, TOL_TINY)


def test_tiny_qwen2_sharded_tensor_parallel_matches(tiny_model_dir):
    """The same parity on a (1, 2, 2) mesh: sharding changes layout, never results."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    _check_parity(
        tiny_model_dir, hf, hf.config.vocab_size, TOL_TINY, mesh={"data": 1, "fsdp": 2, "tensor": 2}
    )


def test_qwen25_05b_shapes_truncated_match_transformers(tmp_path):
    """Real Qwen2.5-0.5B widths (hidden 896, 14 heads / 2 kv heads, head_dim 64,
    intermediate 4864, rope_theta 1e6, tied), 1 layer and vocab cut to 512 for CPU."""
    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=1,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )
    hf = _save_random(tmp_path, Qwen2ForCausalLM, cfg)
    _check_parity(tmp_path, hf, 512, TOL_WIDE)


def test_llama_untied_llama3_rope_matches_transformers(tmp_path):
    """Llama (no qkv bias, untied lm_head) with Llama-3.1 rope scaling; head_dim 32."""
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    hf = _save_random(tmp_path, LlamaForCausalLM, cfg)
    assert "lm_head.weight" in _keys(tmp_path)
    _check_parity(tmp_path, hf, 96, TOL_TINY)


def test_qwen3_qk_norm_matches_transformers(tmp_path):
    cfg = Qwen3Config(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    hf = _save_random(tmp_path, Qwen3ForCausalLM, cfg)
    _check_parity(tmp_path, hf, 96, TOL_TINY)


def _keys(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as f:
        return set(f.keys())


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_scaling=dict(rope, rope_theta=500000.0),
    )
    ours, scale = rope_inv_freq(
        TransformerConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    )
    kind = rope["rope_type"]
    if kind == "default":
        want = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        want_scale = 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    # same fp32 formula; numpy and torch pow may round the last ulp differently
    np.testing.assert_allclose(ours, want.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale, rel=1e-12)


def _critic_batch():
    return _batch(64, seed=3)


def test_critic_values_match_token_classification(tiny_model_dir, tmp_path):
    """values[:, t] = head(hidden at P-1+t), checked against HF Qwen2ForTokenClassification
    whose ``score`` head is loaded through ModelConfig.value_head_path."""
    cfg = Qwen2Config.from_pretrained(tiny_model_dir)
    cfg.num_labels = 1
    torch.manual_seed(1)
    hf = Qwen2ForTokenClassification.from_pretrained(tiny_model_dir, config=cfg).eval()
    torch.nn.init.normal_(hf.score.weight, std=0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    batch = _critic_batch()
    eng = _engine(tiny_model_dir, role="reward_model", value_head_path=str(tmp_path))
    out = eng.forward(batch)
    with torch.no_grad():
        full = (
            hf(
                input_ids=torch.as_tensor(batch["input_ids"]).long(),
                attention_mask=torch.as_tensor(batch["attention_mask"]).long(),
                position_ids=torch.as_tensor(batch["position_ids"]).long(),
            )
            .logits[..., 0]
            .numpy()
        )
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    np.testing.assert_allclose(
        out["values"], full[:, p - 1 : p - 1 + r] * batch["response_mask"], atol=TOL_TINY
    )
    last = [np.nonzero(row)[0][-1] for row in batch["attention_mask"]]
    np.testing.assert_allclose(out["scores"], full[np.arange(len(last)), last], atol=TOL_TINY)


def test_reward_scores_match_sequence_classification(tiny_model_dir, tmp_path):
    """A reward model saved as Qwen2ForSequenceClassification: its own checkpoint carries
    the head; scores equal HF's pooled logits (last non-pad token)."""
    cfg = Qwen2Config.from_pretrained(tiny_model_dir)
    cfg.num_labels, cfg.architectures = 1, ["Qwen2ForSequenceClassification"]
    torch.manual_seed(2)
    hf = Qwen2ForSequenceClassification.from_pretrained(tiny_model_dir, config=cfg).eval()
    torch.nn.init.normal_(hf.score.weight, std=0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    batch = _critic_batch()
    out = _engine(tmp_path, role="reward_model").forward(batch)
    with torch.no_grad():
        want = (
            hf(
                input_ids=torch.as_tensor(batch["input_ids"]).long(),
                attention_mask=torch.as_tensor(batch["attention_mask"]).long(),
                position_ids=torch.as_tensor(batch["position_ids"]).long(),
            )
            .logits[:, 0]
            .numpy()
        )
    np.testing.assert_allclose(out["scores"], want, atol=TOL_TINY)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*Qwen2ForCausalLM"):
        _engine(tmp_path)


def test_unsupported_rope_type_names_the_choices():
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "longrope", "factor": 2.0},
    }
    with pytest.raises(
        ValueError, match=r"rope_type='longrope'.*\['default', 'linear', 'llama3', 'yarn'\]"
    ):
        TransformerConfig.from_hf(cfg)


def test_missing_weight_is_named(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"lacks 1 weight.*model\.layers\.1\.mlp\.up_proj\.weight"):
        _engine(tmp_path)
