"""The LLM judge on real vLLM (gin/experiments/tiny_judge.gin: the run's own pool, the
tiny model as judge): malformed replies (a random tiny model writes them naturally) are
retried, counted and given the fallback; a round past its timeout is counted and
retried; the counts reach metrics.jsonl and the raw replies rollouts.jsonl."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from polyrl.configure.launch import _components, parse_config, prepare
from polyrl.loop.metrics import read_jsonl
from polyrl.rewards import get_reward_fn

JUDGE = "gin/experiments/tiny_judge.gin"


def test_judge_survives_malformed_and_timed_out_judgements(ray_session, tmp_path):
    from polyrl.loop.judge import Judge
    from polyrl.loop.trainer import RLTrainer

    run = tmp_path / "judge"
    cfg, _ = parse_config(
        [JUDGE],
        [
            f"polyrl.RunConfig.run_dir = {str(run)!r}",
            "polyrl.RunConfig.tensorboard = False",
            "polyrl.RunConfig.total_steps = 1",
        ],
    )
    cfg, spec = prepare(cfg)
    trainer = RLTrainer(cfg, spec, _components(cfg, spec))
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
