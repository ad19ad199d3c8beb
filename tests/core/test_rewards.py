"""Rule-based rewards on hand-written cases."""

import pytest

from polyrl.rewards import get_reward_fn, register_reward


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("82", "82", 1.0),
        (" 82 ", "82", 1.0),
        ("83", "82", 0.0),
        ("820", "82", 0.0),
        ("", "82", 0.0),
    ],
)
def test_addition_exact_match(response, truth, expected):
    assert get_reward_fn("polyrl/addition")(response, truth, None) == expected


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("472", "472", 1.0),
        ("479", "472", (1 + 1 + 0.25) / 3),  # 4, 7 in place; 9 a wrong digit
        ("47", "472", 2 / 3),  # short: the missing digit is a miss
        ("4720", "472", 3 / 4),  # long: the extra character is a miss
        ("abc", "472", 0.0),  # no digits at all
        ("7a2", "472", (0.25 + 0 + 1) / 3),  # wrong digit, letter, right digit
    ],
)
def test_copy_positional_credit(response, truth, expected):
    assert get_reward_fn("polyrl/copy")(response, truth, None) == pytest.approx(expected)


def test_unknown_source_lists_registered_ones():
    with pytest.raises(
        ValueError, match=r"no reward function for data_source 'gsm8k'.*polyrl/addition"
    ):
        get_reward_fn("gsm8k")


def test_register_conflict_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("polyrl/copy")(lambda r, g, e: 0.0)
