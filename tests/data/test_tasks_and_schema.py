"""Task datasets in the RL schema, and the schema validator's error messages."""

from __future__ import annotations

import pytest

from polyrl.data.formats import read_dataset, write_dataset
from polyrl.data.schema import DatasetError, validate_file, validate_rows
from polyrl.data.tasks import make_rows
from polyrl.rewards import get_reward_fn


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_round_trip_and_valid(tmp_path, suffix):
    rows = make_rows("addition", 20, seed=1)
    path = write_dataset(rows, tmp_path / f"d{suffix}")
    assert read_dataset(path) == rows
    report = validate_file(path)
    assert report.n_rows == 20 and report.data_sources == {"polyrl/addition": 20}


def test_rows_are_deterministic_and_correct():
    rows = make_rows("addition", 30, seed=5)
    assert rows == make_rows("addition", 30, seed=5)
    assert rows != make_rows("addition", 30, seed=6)
    for row in rows:
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        assert int(row["ground_truth"]) == int(a) + int(b)
        assert (
            get_reward_fn(row["data_source"])(row["ground_truth"], row["ground_truth"], None) == 1.0
        )
    for row in make_rows("copy", 10):
        assert row["prompt"][0]["content"] == f"copy {row['ground_truth']}"


def test_random_policy_scores_above_zero_on_copy():
    """The learn-from-scratch task: uniformly random digit strings already earn credit."""
    import random

    rng = random.Random(0)
    reward = get_reward_fn("polyrl/copy")
    rows = make_rows("copy", 500, seed=0)
    scores = [
        reward("".join(rng.choice("0123456789") for _ in range(3)), r["ground_truth"], None)
        for r in rows
    ]
    # Per position: right with p = 1/10 (credit 1), else a wrong digit (credit 0.25):
    # expected 0.1 * 1 + 0.9 * 0.25 = 0.325.
    assert 0.30 < sum(scores) / len(scores) < 0.35


def test_unknown_task_lists_tasks():
    with pytest.raises(ValueError, match=r"unknown task 'gsm8k'.*'addition'"):
        make_rows("gsm8k", 1)


def test_validator_reports_every_problem_with_row_and_field():
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+1="}],
            "ground_truth": "2",
            "data_source": "polyrl/addition",
        },
        {"prompt": "1+1=", "ground_truth": "2", "data_source": "polyrl/addition"},
        {
            "prompt": [{"role": "robot", "content": ""}],
            "ground_truth": 2,
            "data_source": "polyrl/addition",
        },
        {"prompt": [{"role": "user", "content": "x"}], "data_source": "nope"},
    ]
    with pytest.raises(DatasetError) as info:
        validate_rows(rows, "mem")
    msg = str(info.value)
    assert "row 1: field 'prompt' must be a non-empty list of chat messages" in msg
    assert "row 2: prompt[0].role='robot' is not one of ['system', 'user', 'assistant']" in msg
    assert "row 2: prompt[0].content must be a non-empty string" in msg
    assert "row 2: field 'ground_truth' must be a string, got int 2" in msg
    assert "row 3: missing field 'ground_truth'" in msg
    assert "row 3: data_source='nope' has no reward function" in msg
    assert "row 0" not in msg
    assert len(info.value.problems) == 6


def test_validator_counts_tokens_and_flags_long_prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = make_rows("copy", 3)
    report = validate_rows(rows, tokenizer=tok)
    # "<|im_start|>", "user", ":", "copy", " ", 3 digits, "<|im_end|>", "<|im_start|>",
    # "as", "sistant", ":"  -> 1+1+1+1+1+3+1+1+1+1+1 = 13 tokens
    assert report.max_prompt_tokens == 13
    rows[1]["prompt"][0]["content"] = "copy 12"  # 12 tokens: under the limit
    # rows 0 and 2 over: one problem with the count, the rows and the longest
    with pytest.raises(
        DatasetError,
        match=r"1 problem\(s\) in 3 rows:\n  2 rows \(row 0 \(13 tokens\), row 2 \(13 tokens\)\): "
        r"prompt over max_prompt_tokens=12 tokens, the longest is 13 tokens \(row 0\)",
    ):
        validate_rows(rows, tokenizer=tok, max_prompt_tokens=12)
    rows[2]["prompt"][0]["content"] = "copy 12"
    with pytest.raises(
        DatasetError, match=r"row 0: prompt is 13 tokens, over max_prompt_tokens=12"
    ):
        validate_rows(rows, tokenizer=tok, max_prompt_tokens=12)
    # every row over: one problem with the shortest prompt, not one a row
    with pytest.raises(
        DatasetError,
        match=r"1 problem\(s\) in 3 rows:\n  every prompt \(3 rows\) is over "
        r"max_prompt_tokens=10 tokens \(the shortest is 12 tokens",
    ):
        validate_rows(rows, tokenizer=tok, max_prompt_tokens=10)


def test_empty_dataset_is_an_error():
    with pytest.raises(DatasetError, match="no rows"):
        validate_rows([])
