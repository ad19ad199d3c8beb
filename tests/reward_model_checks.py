"""What the reward-model tests compare: an RL step's rewards with a reward model, and the
score transformers' sequence classifier gives (independent of both backends)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def classifier_scores(model_dir: Path, batch) -> np.ndarray:
    """transformers' ``AutoModelForSequenceClassification`` at ``model_dir``: the score
    head at each row's last real token. (Not ``.logits``: transformers pools at the last
    token that is not pad_token_id, and a random policy can sample the pad id as a real
    response token.)"""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            real = torch.from_numpy(ids[mask == 1].astype(np.int64))[None]
            out.append((model.model(real).last_hidden_state[0, -1] @ model.score.weight[0]).item())
    return np.array(out)


def rl_step_rewards(gin_files, params) -> tuple:
    """The first step's batch of an RL run (``gin_files`` + ``params``), its rewards from
    the trainer's reward stage, and each response's rule reward alone."""
    from polyrl.configure.launch import _components, parse_config, prepare
    from polyrl.loop.trainer import RLTrainer
    from polyrl.rewards import get_reward_fn

    cfg, _ = parse_config(gin_files, params)
    cfg, spec = prepare(cfg)
    trainer = RLTrainer(cfg, spec, _components(cfg, spec))
    try:
        batch = trainer.collect(0)
        got = trainer.reward(batch)["scores"]
    finally:
        trainer.shutdown()
    columns = ("response_text", "ground_truth", "data_source", "extra_info")
    rule = np.array([get_reward_fn(s)(t, g, e) for t, g, s, e in zip(*(batch[c] for c in columns))])
    return batch, got, rule
