"""GSM8K- and MATH-style rewards (polyrl.rewards.math_answers) on hand-written cases."""

from __future__ import annotations

import threading

import pytest

from polyrl.rewards import get_reward_fn
from polyrl.rewards.math_answers import gsm8k_answer, last_boxed

GSM8K = get_reward_fn("openai/gsm8k")
MATH = get_reward_fn("lighteval/MATH")


@pytest.mark.parametrize(
    "source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]
)
def test_verl_math_sources_are_registered(source):
    assert get_reward_fn(source)("so \\boxed{3}", "3", None) == 1.0


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("She has 5 + 7 = 12 apples.\n#### 12", "12", 1.0),
        ("#### 1,250", "1250", 1.0),  # thousands separator in the response
        ("#### 1250", "1,250", 1.0),  # ... or in the ground truth
        ("#### 1,000,000 dollars", "1000000", 1.0),
        ("#### $18", "18", 1.0),
        ("#### 0.5", "1/2", 1.0),
        ("first #### 3 then #### 4", "4", 1.0),  # the last marker counts
        ("#### 4\nbecause 2+2", "4", 1.0),  # the rest of the line only
        ("#### 3/4 of a cup", "0.75", 1.0),
        ("#### 2x", "2", 0.0),  # not a number followed by words
        ("The answer is \\boxed{42}.", "42", 1.0),  # no ####: the last box
        ("#### 13", "12", 0.0),  # wrong
        ("The answer is 12.", "12", 0.0),  # no answer marker: malformed
        ("####", "12", 0.0),
        ("", "12", 0.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # full solution as truth
    ],
)
def test_gsm8k(response, truth, expected):
    assert GSM8K(response, truth, None) == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # equivalent forms
        ("\\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{\\frac12}", "\\dfrac{1}{2}", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),  # commas in numbers
        ("\\boxed{3} no wait \\boxed{4}", "4", 1.0),  # the last box counts
        ("\\fbox{7}", "7", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),  # wrong
        ("\\boxed{0.51}", "\\frac{1}{2}", 0.0),
        ("the answer is 1/2", "\\frac{1}{2}", 0.0),  # no box: malformed
        ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # unclosed box
        ("\\boxed{}", "2", 0.0),
        ("\\boxed{" + "1+" * 200 + "1}", "201", 0.0),  # over MAX_ANSWER_CHARS
        ("\\boxed{)(*&^}", "2", 0.0),  # unparseable
        ("\\boxed{5}", "The sum is $\\boxed{5}$.", 1.0),  # full solution as truth
    ],
)
def test_math(response, truth, expected):
    assert MATH(response, truth, None) == expected


def test_format_reward_is_for_well_formed_wrong_answers():
    extra = {"format_score": 0.1}
    assert MATH("\\boxed{3}", "4", extra) == 0.1
    assert MATH("\\boxed{4}", "4", extra) == 1.0
    assert MATH("4", "4", extra) == 0.0  # no box: no format credit
    assert GSM8K("#### 3", "4", extra) == 0.1
    assert GSM8K("4", "4", extra) == 0.0


def test_extraction_rules():
    assert last_boxed("a \\boxed{\\frac{a}{b^{2}}} b") == "\\frac{a}{b^{2}}"
    assert last_boxed("no box") is None
    assert gsm8k_answer("x\n#### 2,024 \nmore") == "2024"


def test_same_scores_outside_the_main_thread():
    """math-verify's timeouts use signal.alarm (main thread only): a reward worker
    thread must get the same scores, not an error."""
    cases = [
        (MATH, "\\boxed{0.5}", "\\frac{1}{2}"),
        (MATH, "\\boxed{2}", "3"),
        (GSM8K, "#### 1,000", "1000"),
        (GSM8K, "no marker 5", "5"),
    ]
    main = [fn(r, t, None) for fn, r, t in cases]
    out: list = []
    thread = threading.Thread(target=lambda: out.extend(fn(r, t, None) for fn, r, t in cases))
    thread.start()
    thread.join()
    assert out == main == [1.0, 0.0, 1.0, 0.0]
