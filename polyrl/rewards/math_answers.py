"""Verifiable math rewards: GSM8K-style ("#### 42") and MATH-style (``\\boxed{...}``).

The final answer is cut out of the response by a small, explicit rule; whether it equals
the ground truth is decided by math-verify (Hugging Face's maintained verifier: LaTeX and
plain expressions to sympy, so ``1/2``, ``0.5`` and ``\\frac{1}{2}`` agree). Registered
under the data_source names verl's data preprocessors write, so verl datasets score
without changes:

* ``openai/gsm8k``: the answer is the text after the last ``####`` (the end of that
  line), or, without ``####``, the last ``\\boxed{}``.
* ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``
  and the NuminaMath sources verl lists: the answer is the last ``\\boxed{}`` (or
  ``\\fbox{}``).

Score (verl's convention): 1.0 for a correct answer; ``extra_info["format_score"]``
(default 0.0: the format reward is off) for a well-formed but wrong answer; 0.0 when the
response has no answer in the expected form (or one over ``MAX_ANSWER_CHARS``).

Timeouts: math-verify bounds sympy's work with ``signal.alarm``, which only works in a
process's main thread; a Ray actor may call a reward from another thread. There the
timeouts are off, and the length limit on the answer is what bounds the work. The score
is the same in every thread (tests/core/test_math_rewards.py checks it).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

from polyrl.rewards.registry import register_reward

__all__ = [
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "MAX_ANSWER_CHARS",
    "gsm8k_answer",
    "last_boxed",
    "answers_match",
    "gsm8k_reward",
    "math_reward",
]

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)
# Longer "answers" score 0: they are not final answers, and they bound sympy's work where
# math-verify's timeouts cannot run (outside the main thread).
MAX_ANSWER_CHARS = 256
# math-verify's own defaults, in seconds (main thread only).
TIMEOUT_S = 5

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LEADING_NUMBER = re.compile(r"-?\d*\.?\d+(?:\s*/\s*\d+)?(?![\w^.])")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces;
    None when there is none or it is not closed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def gsm8k_answer(text: str) -> str | None:
    """The text after the last ``####`` up to the end of its line, with thousands
    separators and ``$`` removed (only its leading number when it starts with one:
    ``18 dollars`` -> ``18``); without ``####``, the last ``\\boxed{}``."""
    if "####" not in text:
        return last_boxed(text)
    tail = _THOUSANDS.sub("", text.rsplit("####", 1)[1].strip().split("\n", 1)[0])
    tail = tail.replace("$", "").strip()
    number = _LEADING_NUMBER.match(tail)  # "18 dollars" -> "18"
    return (number.group(0) if number else tail) or None


def answers_match(answer: str, ground_truth: str) -> bool:
    """math-verify's equivalence of two final answers (LaTeX or plain), each read as if
    boxed, so a bare ``\\frac{1}{2}`` and a bare ``0.5`` both parse."""
    from math_verify import parse, verify

    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))


def _score(answer: str | None, ground_truth: str, extra_info: Mapping[str, Any] | None) -> float:
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    if answers_match(answer, ground_truth):
        return 1.0
    return float((extra_info or {}).get("format_score", 0.0))


def gsm8k_reward(
    response: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> float:
    """GSM8K: the answer after ``####`` (see :func:`gsm8k_answer`) against the ground
    truth (a bare number, or a full GSM8K solution ending in ``#### N``)."""
    truth = gsm8k_answer(ground_truth) if "####" in ground_truth else ground_truth
    return _score(gsm8k_answer(response), _THOUSANDS.sub("", truth or ""), extra_info)


def math_reward(
    response: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> float:
    """MATH: the last ``\\boxed{}`` of the response against the ground truth (the
    boxed content of the reference solution, as verl's MATH preprocessing stores it, or
    a full solution whose last ``\\boxed{}`` is taken)."""
    truth = last_boxed(ground_truth) if _BOXED.search(ground_truth) else ground_truth
    return _score(last_boxed(response), truth or "", extra_info)


for _source in GSM8K_SOURCES:
    register_reward(_source)(gsm8k_reward)
for _source in MATH_SOURCES:
    register_reward(_source)(math_reward)
