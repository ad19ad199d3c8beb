"""forward(): log-probs of other model families, values and reward scores against
independent transformers computations, and padding invariance. (The tiny model's
log-probs and entropy at a temperature: the contract suite, tests/backends/test_contract.py.)"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from torch_fsdp_helpers import random_batch

from polyrl.backends import get_engine
from polyrl.batch import from_token_lists
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

# fp32 on CPU; the engine and the reference differ only in padding/batching (different
# matmul shapes and summation order): ~1e-6 observed, 1e-5 leaves headroom.
ATOL = 1e-5


def _engine(path, role="reference", mbs=3, **model_kw):
    engine = get_engine("torch_fsdp")()
    cfg = ModelConfig(str(path), role=role, **model_kw)
    engine.init(cfg, OptimConfig() if cfg.trainable else None, ParallelConfig(micro_batch_size=mbs))
    return engine


def _unpadded(batch, i):
    """Sample ``i``'s prompt + response tokens, without padding: [1, n], P_i, R_i."""
    prompt = batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]] > 0]
    resp = batch["responses"][i][batch["response_mask"][i] > 0]
    ids = torch.tensor(np.concatenate([prompt, resp]), dtype=torch.long)[None]
    return ids, len(prompt), len(resp)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_padding_does_not_change_log_probs(tiny_model_dir):
    """Left-padded prompts + right-padded responses at widths far above the real
    lengths, with neighbours of other lengths, give each sample's unpadded log-probs."""
    engine = _engine(tiny_model_dir)
    wide = random_batch(6, seed=2, prompt_len=20, response_len=12)
    got = engine.forward(wide)["log_probs"]
    for i in range(len(wide)):
        ids, P, R = _unpadded(wide, i)
        alone = from_token_lists([ids[0, :P].tolist()], [ids[0, P:].tolist()], pad_id=0)
        assert alone["attention_mask"].all()  # no padding at all
        np.testing.assert_allclose(got[i, :R], engine.forward(alone)["log_probs"][0], atol=ATOL)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_other_families_match_transformers(tiny_model_dir, tmp_path, family):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    config = config_cls(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    batch = random_batch(4, seed=3)
    got = _engine(tmp_path).forward(batch)["log_probs"]
    for i in range(len(batch)):
        ids, P, R = _unpadded(batch, i)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, P - 1 : P - 1 + R], -1)
        np.testing.assert_allclose(got[i, :R], logp.gather(-1, ids[0, P:, None])[:, 0], atol=ATOL)


@pytest.fixture(scope="module")
def reward_dir(tiny_model_dir, tmp_path_factory):
    """A reward-model checkpoint: HF sequence classifier (num_labels=1) with a random head."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(1)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, path / name)
    return path, model.eval()


def test_reward_scores_match_hf_sequence_classifier(reward_dir):
    path, hf = reward_dir
    batch = random_batch(5, seed=4)
    out = _engine(path, role="reward_model").forward(batch)
    for i in range(len(batch)):
        ids, _, _ = _unpadded(batch, i)
        with torch.no_grad():
            expect = hf(ids).logits[0, 0].item()  # unpadded: HF pools the last token
        assert out["scores"][i] == pytest.approx(expect, abs=ATOL)


def test_critic_values_align_with_the_token_they_precede(tiny_model_dir, reward_dir):
    """values[:, t] = head(hidden state at position P-1+t); head from value_head_path."""
    from transformers import AutoModel

    path, hf = reward_dir
    batch = random_batch(4, seed=5)
    values = _engine(tiny_model_dir, role="critic", value_head_path=str(path)).forward(batch)[
        "values"
    ]
    backbone = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for i in range(len(batch)):
        ids, P, R = _unpadded(batch, i)
        with torch.no_grad():
            hidden = backbone(ids).last_hidden_state[0, P - 1 : P - 1 + R]
            expect = (hidden @ hf.score.weight[0]).numpy()
        np.testing.assert_allclose(values[i, :R], expect, atol=ATOL)
        assert not values[i, R:].any()
