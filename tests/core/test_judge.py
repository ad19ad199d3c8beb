"""The LLM judge's pure parts (polyrl.loop.judge): score parsers, the prompt template,
the score scale and the config's checks. The judge on real vLLM: tests/trainer/test_judge_runs.py."""

from __future__ import annotations

import pytest

from polyrl.errors import ConfigError
from polyrl.loop.judge import (
    PARSERS,
    JudgeConfig,
    parse_json,
    parse_regex,
    register_judge_parser,
    render,
)

DEFAULT = JudgeConfig().pattern


@pytest.mark.parametrize(
    ("reply", "want"),
    [
        ("score: 7", 7.0),
        ("The answer is right. Score = 7.5 (out of 10)", 7.5),
        ("SCORE:10", 10.0),
        ("score: -2", -2.0),
        ("I give it 7", None),  # no 'score'
        ("score: seven", None),
        ("", None),
        ("score: 3 ... score: 9", 3.0),  # the first match
    ],
)
def test_regex_parser_default_pattern(reply, want):
    assert parse_regex(reply, DEFAULT) == want


def test_regex_parser_custom_pattern_and_whole_match():
    assert parse_regex("rating 8/10", r"(\d+)/10") == 8.0
    assert parse_regex("42 apples", r"\d+") == 42.0  # no group: the whole match
    assert parse_regex("1e999", r"\S+") is None  # inf is not a score


@pytest.mark.parametrize(
    ("reply", "want"),
    [
        ('Verdict: {"score": 4, "why": "ok"} done', 4.0),
        ('{"score": "3.5"}', 3.5),
        ('{"score": true}', None),
        ('{"grade": 4}', None),
        ('{not json} then {"score": 6}', 6.0),  # a brace that starts no object is skipped
        ("no object", None),
    ],
)
def test_json_parser(reply, want):
    assert parse_json(reply, "score") == want


def test_scores_map_to_unit_interval_and_out_of_range_is_malformed():
    c = JudgeConfig(min_score=1.0, max_score=5.0)
    assert c.score_of("score: 1") == 0.0
    assert c.score_of("score: 3") == 0.5  # (3 - 1) / (5 - 1)
    assert c.score_of("score: 5") == 1.0
    assert c.score_of("score: 6") is None and c.score_of("score: 0.5") is None
    assert c.score_of("nothing") is None


def test_render_fills_prompt_response_and_truth():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy 12"}]
    got = render("Q: {prompt} | A: {response} | want {ground_truth} {{json}}", messages, "12", "12")
    assert got == "Q: be brief\ncopy 12 | A: 12 | want 12 {json}"
    assert render("{prompt}/{response}", "plain", "r", "g") == "plain/r"


def test_a_registered_parser_is_used():
    @register_judge_parser("test_last_digit")
    def last_digit(reply: str, pattern: str) -> float | None:
        digits = [c for c in reply if c.isdigit()]
        return float(digits[-1]) if digits else None

    try:
        assert JudgeConfig(parser="test_last_digit").score_of("1 then 8") == 0.8
    finally:
        del PARSERS["test_last_digit"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"template": "{response} {answer}"}, r"template has unknown field\(s\) \['answer'\]"),
        ({"template": "rate {prompt}"}, r"template has no \{response\} field"),
        ({"template": "{response"}, r"template cannot be formatted"),
        ({"parser": "yaml"}, r"parser='yaml' is not a parser; use one of \['json', 'regex'\]"),
        ({"pattern": "score: ("}, r"pattern='score: \(' is not a regular expression"),
        ({"min_score": 5.0, "max_score": 5.0}, r"max_score must be above min_score"),
        ({"retries": -1}, r"retries=-1 must be >= 0"),
        ({"timeout_s": 0.0}, r"timeout_s=0.0 must be > 0"),
        ({"fallback": 2.0}, r"fallback=2.0 must be in \[0, 1\]"),
        ({"retry_temperature": -1.0}, r"retry_temperature=-1.0 must be >= 0"),
        ({"num_servers": 0}, r"JudgeConfig.num_servers=0 must be >= 1"),
        ({"tensor_parallel_size": 0}, r"JudgeConfig.tensor_parallel_size=0 must be >= 1"),
        ({"gpu_memory_utilization": 1.5}, r"JudgeConfig.gpu_memory_utilization=1.5 must be in"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        JudgeConfig(**kwargs)


def test_validate_config_names_what_a_judge_cannot_run_with():
    from polyrl.algos import get_algorithm
    from polyrl.configure.launch import parse_config
    from polyrl.configure.validate import judge_problems

    def problems(*params: str, algorithm: str = "grpo") -> list[str]:
        cfg, _ = parse_config(["gin/experiments/tiny_judge.gin"], params)
        return judge_problems(cfg, get_algorithm(algorithm))

    assert problems() == []
    (ahead,) = problems("polyrl.RunConfig.max_staleness = 1")
    assert "max_staleness=1 / streaming=False generate while the trainer rewards" in ahead
    (dpo,) = problems(algorithm="dpo")
    assert dpo.startswith("RunConfig.judge is set but 'dpo' (preference) scores no responses")


def test_validate_config_checks_a_judge_of_its_own(tiny_model_dir, tmp_path):
    """JudgeConfig.model_path: the directory must hold a model, a tokenizer and a chat
    template; the judge's pool must be one of RunConfig.pools and fit it; rollouts may
    then run ahead and stream (generation never asks the judge's servers)."""
    import shutil

    from transformers import AutoTokenizer

    from polyrl.algos import get_algorithm
    from polyrl.configure.launch import parse_config
    from polyrl.configure.validate import batch_arithmetic, check_run, judge_problems

    plain = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, plain)
    tokenizer = AutoTokenizer.from_pretrained(plain)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        (plain / name).unlink(missing_ok=True)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)

    def parse(*params: str):
        return parse_config(["gin/experiments/tiny_judge.gin"], params)[0]

    def problems(path, *params: str, algorithm: str = "grpo") -> list[str]:
        cfg = parse(f"polyrl.JudgeConfig.model_path = {str(path)!r}", *params)
        return judge_problems(cfg, get_algorithm(algorithm))

    assert problems(tiny_model_dir) == []
    assert problems(tiny_model_dir, "polyrl.RunConfig.max_staleness = 1") == []
    assert problems(tiny_model_dir, "polyrl.RunConfig.streaming = True") == []
    (missing,) = problems(tmp_path / "nowhere")
    assert missing == (
        f"JudgeConfig.model_path={str(tmp_path / 'nowhere')!r} has no config.json; pass a "
        "local Hugging Face model directory"
    )
    (untemplated,) = problems(plain)
    assert untemplated.startswith(f"JudgeConfig.model_path={str(plain)!r}: its tokenizer has no")
    (remax,) = problems(tiny_model_dir, "polyrl.RunConfig.max_staleness = 1", algorithm="remax")
    assert "max_staleness=1: 'remax' rewards its greedy baseline" in remax

    own = f"polyrl.JudgeConfig.model_path = {str(tiny_model_dir)!r}"
    assert (
        f"judge: {tiny_model_dir} on 1 server(s) of its own x tensor_parallel 1 in pool "
        "'shared', one request per sample a step"
    ) in batch_arithmetic(parse(own), get_algorithm("grpo"), None)
    assert "judge: the rollout servers (the policy), one request per sample a step" in (
        batch_arithmetic(parse(), get_algorithm("grpo"), None)
    )
    cfg = parse(own, "polyrl.JudgeConfig.pool = 'judges'")
    assert (
        "polyrl.JudgeConfig.pool='judges' (judge) is not a pool in RunConfig.pools (['shared'])"
        in check_run(cfg, get_algorithm("grpo"), cluster=False)
    )
    cfg = parse(
        own,
        "polyrl.RunConfig.pools = {'shared': {'CPU': 2}, 'judges': {'GPU': 1}}",
        "polyrl.JudgeConfig.pool = 'judges'",
        "polyrl.JudgeConfig.tensor_parallel_size = 2",
    )
    assert (
        "judge puts 2 devices on each of its 1 node(s) but pool 'judges' has 1 GPUs per node"
        in " ".join(check_run(cfg, get_algorithm("grpo"), cluster=False))
    )


def test_the_judge_servers_take_the_rollout_settings_but_their_own():
    from polyrl.rollout.sampling import RolloutConfig

    rollout = RolloutConfig(
        model_path="policy",
        num_servers=4,
        max_model_len=96,
        gpu_memory_utilization=0.4,
        enable_sleep_mode=True,
        engine="sync",
        pool="train",
    )
    own = JudgeConfig(model_path="judge", num_servers=2, pool="judges", gpu_memory_utilization=0.2)
    servers = own.servers(rollout)
    assert (servers.model_path, servers.num_servers, servers.pool) == ("judge", 2, "judges")
    assert servers.gpu_memory_utilization == 0.2 and servers.max_model_len == 96
    assert servers.engine == "async" and not servers.enable_sleep_mode  # frozen, never asleep
    shared = JudgeConfig(model_path="judge").servers(rollout)
    assert shared.gpu_memory_utilization == 0.4 and shared.pool == "shared"
