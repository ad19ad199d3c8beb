"""Turning dataset rows into prompt token ids (the rollout servers take token ids)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["encode_prompt", "encode_prompts"]


def encode_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Render chat ``messages`` with the tokenizer's chat template (plus the generation
    prompt) and tokenize without adding special tokens a second time."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompts(tokenizer: Any, rows: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """:func:`encode_prompt` of every row's ``prompt``."""
    return [encode_prompt(tokenizer, row["prompt"]) for row in rows]
