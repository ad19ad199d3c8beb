"""The LLM judge on real vLLM (gin/experiments/tiny_judge.gin: the run's own pool, the
tiny model as judge): malformed replies (a random tiny model writes them naturally) are
retried, counted and given the fallback; a round past its timeout is counted and
retried; the counts reach metrics.jsonl and the raw replies rollouts.jsonl. A judge on
servers of its own (JudgeConfig.model_path): another model, with its own tokenizer's
chat template, answers every judgement, while rollouts run ahead."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from polyrl.configure.launch import _components, parse_config, prepare
from polyrl.loop.metrics import read_jsonl
from polyrl.rewards import get_reward_fn

JUDGE = "gin/experiments/tiny_judge.gin"


def _trainer(run, *params: str):
    """tiny_judge.gin's trainer (its config, the RLTrainer), writing to ``run``."""
    from polyrl.loop.trainer import RLTrainer

    cfg, _ = parse_config(
        [JUDGE],
        [f"polyrl.RunConfig.run_dir = {str(run)!r}", "polyrl.RunConfig.tensorboard = False"]
        + list(params),
    )
    cfg, spec = prepare(cfg)
    return cfg, RLTrainer(cfg, spec, _components(cfg, spec))


def test_judge_survives_malformed_and_timed_out_judgements(ray_session, tmp_path):
    from polyrl.loop.judge import Judge

    run = tmp_path / "judge"
    cfg, trainer = _trainer(run, "polyrl.RunConfig.total_steps = 1")
    try:
        trainer.run()
        batch = trainer.collect(1)
        # 1. A score is a digit the reply starts with, 0..9, sampled at temperature 1 (the
        # greedy tiny judge says the same to every request): some replies parse, some not.
        digit = dataclasses.replace(
            cfg.judge, pattern=r"^(\d)", max_score=9.0, temperature=1.0, retries=2
        )
        judge = Judge(digit, trainer.pool, trainer.tokenizer)
        scores, replies = judge.score(batch)
        digit_metrics = judge.take_metrics()
        # 2. A timeout no round can meet: every request times out, every sample falls back.
        late = dataclasses.replace(cfg.judge, timeout_s=1e-3, fallback=0.25)
        judge = Judge(late, trainer.pool, trainer.tokenizer)
        late_scores, late_replies = judge.score(batch)
        late_metrics = judge.take_metrics()
    finally:
        trainer.shutdown()

    # The run: tiny_judge.gin's regex wants 'score: N', which the tiny model never writes
    # (checked on every dumped reply), so every judgement is malformed, asked again once
    # (retries = 1) and falls back to 0: the reward is the rule reward alone.
    (row,) = read_jsonl(run / "metrics.jsonl")
    samples = cfg.prompts_per_step * cfg.sampling.n
    assert row["judge/requests"] == 2 * samples and row["judge/malformed"] == 2 * samples
    assert row["judge/failed"] == samples and row["judge/timed_out"] == 0
    assert row["judge/score_mean"] == 0.0
    dumps = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert dumps
    for d in dumps:
        assert len(d["judge"]) == 2 and not any("score" in r for r in d["judge"]), d
        rule = get_reward_fn(d["data_source"])(d["response"], d["ground_truth"], None)
        assert abs(d["reward"] - rule) < 1e-6, d

    # The digit judge, by hand: a sample's score is the leading digit of its first reply
    # that starts with one, / 9; it took as many replies as attempts until then.
    want, failed, malformed = [], 0, 0
    for got in replies:
        found = [i for i, r in enumerate(got) if r[:1].isdigit()]
        if found:
            assert len(got) == found[0] + 1
            want.append(int(got[found[0]][0]) / 9)
        else:
            assert len(got) == 1 + digit.retries
            want.append(digit.fallback)
            failed += 1
        malformed += len(got) - bool(found)
    np.testing.assert_allclose(scores, want, rtol=1e-6)
    assert malformed > 0 and failed < len(batch), "the test needs both kinds of reply"
    assert digit_metrics["judge/malformed"] == malformed
    assert digit_metrics["judge/failed"] == failed
    assert digit_metrics["judge/requests"] == sum(len(r) for r in replies)
    assert digit_metrics["judge/score_mean"] == np.float32(want).mean()

    attempts = 1 + late.retries
    assert late_replies == [["<timed out>"] * attempts] * len(batch)
    np.testing.assert_array_equal(late_scores, np.full(len(batch), 0.25, np.float32))
    assert late_metrics == {
        "judge/requests": attempts * len(batch),
        "judge/malformed": 0.0,
        "judge/timed_out": attempts * len(batch),
        "judge/failed": len(batch),
        "judge/score_mean": 0.25,
    }


@pytest.fixture(scope="module")
def sevens_judge(tiny_model_dir, tmp_path_factory):
    """A judge model that always says 7: the tiny model with every layer's output
    projections zeroed (each layer adds nothing, so the last token's own embedding
    predicts it again: greedy decoding repeats the last token) and a chat template whose
    generation prompt ends in '7'."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("judge") / "sevens"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = "'<|im_start|>assistant:'"
    assert prompt in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.replace(prompt, "'<|im_start|>judge: 7'")
    tokenizer.save_pretrained(out)
    shutil.copy(tiny_model_dir / "polyrl_tiny.json", out)
    return out


@pytest.mark.slow  # 30 s idle, 42-85 s loaded: the default tier keeps the run's-own-pool judge
def test_a_judge_of_its_own_answers_from_its_servers(ray_session, tmp_path, sevens_judge):
    from polyrl.loop.judge import Judge

    run = tmp_path / "own_judge"
    cfg, trainer = _trainer(
        run,
        "polyrl.RunConfig.total_steps = 2",
        "polyrl.RunConfig.max_staleness = 1",  # allowed: generation never asks the judge
        f"polyrl.JudgeConfig.model_path = {str(sevens_judge)!r}",
        "polyrl.JudgeConfig.pattern = '^(\\d)'",
        "polyrl.JudgeConfig.max_score = 9.0",
    )
    try:
        trainer.run()
        judge_pool, pool = trainer.judge.pool, trainer.pool
        # The same requests on the run's own pool (the policy, the run's chat template):
        # its replies are not the judge's.
        batch = trainer.collect(2)
        _, policy_replies = Judge(cfg.judge, pool, trainer.tokenizer).score(batch)
        judge_scores, judge_replies = trainer.judge.score(batch)
    finally:
        trainer.shutdown()
    assert judge_pool is not pool and judge_pool.config.model_path == str(sevens_judge)
    assert judge_pool.config.num_servers == 1 and judge_pool.version == 0  # never pushed to
    assert pool.version == 2
    assert all(set(r) == {"7"} for (r,) in judge_replies), judge_replies
    np.testing.assert_allclose(judge_scores, np.full(len(batch), 7 / 9), rtol=1e-6)
    assert not any(set(r[0]) == {"7"} for r in policy_replies), policy_replies

    # Every judgement of the run: the sevens judge's, read at once (7 of 0..9).
    rows = read_jsonl(run / "metrics.jsonl")
    samples = cfg.prompts_per_step * cfg.sampling.n
    assert len(rows) == 2
    for row in rows:
        assert row["judge/requests"] == samples and row["judge/failed"] == 0
        assert row["judge/malformed"] == 0 and row["judge/timed_out"] == 0
        assert abs(row["judge/score_mean"] - 7 / 9) < 1e-6
    dumps = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert {d["step"] for d in dumps} == {1, 2}
    for d in dumps:
        (reply,) = d["judge"]
        assert reply and set(reply) == {"7"}, d
        rule = get_reward_fn(d["data_source"])(d["response"], d["ground_truth"], None)
        assert abs(d["reward"] - (rule + cfg.judge.coef * 7 / 9)) < 1e-5, d
