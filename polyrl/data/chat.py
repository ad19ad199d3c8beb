"""Chat conversations -> token ids with a loss mask on every assistant turn (SFT).

A conversation (``messages``: ``[{"role", "content"}, ...]``) is rendered with the
tokenizer's own chat template, *incrementally*: for each assistant message ``i`` the
text of ``messages[:i]`` with the generation prompt and the text of ``messages[:i + 1]``
are rendered; what the second adds to the first is that assistant turn (its content and
the template's end-of-turn marker, e.g. ``<|im_end|>``: the model learns to stop). The
template must render every shorter conversation as a prefix of the longer one (true of
the Qwen/Llama/ChatML families); one that does not is an error naming the turn.

The tokens are laid out as the RL sequences (``polyrl.batch``): the *prompt* is the
conversation up to the first assistant turn with the generation prompt (exactly what
``polyrl.data.prompts.encode_prompt`` gives an RL prompt, so an SFT'd model continues
RL prompts as it was trained), the *response* is everything after it, and the response
mask is 1 on the assistant turns' tokens and 0 on the user/system turns in between.
Each piece is tokenized on its own (no special tokens added), so a mask boundary is
always a token boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatTokens", "encode_chat", "TemplateError"]


class TemplateError(ValueError):
    """The chat template does not render a conversation incrementally."""


@dataclasses.dataclass(frozen=True)
class ChatTokens:
    """One conversation: ``prompt`` ids, ``response`` ids and ``mask`` (one 0/1 per
    response id: 1 on assistant tokens)."""

    prompt: list[int]
    response: list[int]
    mask: list[int]


def _render(tokenizer: Any, messages: Sequence[Mapping[str, str]], generation: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=generation, tokenize=False
    )


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> ChatTokens:
    """Prompt, response and per-token assistant mask of ``messages`` (module doc); needs
    at least one assistant message after a non-assistant one (``polyrl.data.schema``
    checks rows first)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0:
        raise ValueError(
            "encode_chat: the conversation needs an assistant message after a user/system one"
        )
    # (text, learn?) pieces whose concatenation is the whole rendered conversation.
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i in turns:
        before = _render(tokenizer, messages[:i], generation=True)
        after = _render(tokenizer, messages[: i + 1], generation=False)
        if not before.startswith(done) or not after.startswith(before):
            raise TemplateError(
                f"the chat template does not render messages[:{i}] as a prefix of "
                f"messages[:{i + 1}] (assistant turn {i}), so the assistant tokens cannot be "
                "masked turn by turn; use a template that renders conversations incrementally"
            )
        pieces += [(before[len(done) :], False), (after[len(before) :], True)]
        done = after
    full = _render(tokenizer, messages, generation=False)
    if not full.startswith(done):
        raise TemplateError(
            "the chat template does not render the conversation's last assistant turn as a "
            "prefix of the whole conversation; use a template that renders incrementally"
        )
    pieces.append((full[len(done) :], False))
    prompt = _ids(tokenizer, pieces[0][0])
    response: list[int] = []
    mask: list[int] = []
    for text, learn in pieces[1:]:
        ids = _ids(tokenizer, text)
        response += ids
        mask += [int(learn)] * len(ids)
    return ChatTokens(prompt, response, mask)
