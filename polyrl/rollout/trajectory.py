"""An episode's token ids as it grows, and the chat template as token deltas.

:class:`Episode` holds one episode's prompt and turns (sampled ids with their log-probs
and versions, observation ids), :class:`ChatTokens` computes an observation's ids as the
difference of the template applied with and without the new messages, and
:func:`first_drift` compares an episode with a fresh rendering. The episode loop
(``polyrl.rollout.episodes``) and the OpenAI endpoint (``polyrl.rollout.openai_endpoint``)
both build episodes with them (docs/agents.md "Exact tokens").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from polyrl.envs.base import FINISH_REASONS

__all__ = ["ChatTokens", "Episode", "TemplateError", "first_drift"]


class TemplateError(ValueError):
    """The chat template does not extend a conversation by appending text (e.g. it
    rewrites earlier turns), so observation tokens cannot be computed as a difference."""


class ChatTokens:
    """A tokenizer's chat template as token deltas (module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([self.eos_id]) if self.eos_id is not None else ""

    def render(self, messages: Sequence[Mapping], tools: Any, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools or None, add_generation_prompt=generation, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of each text, in one batch of the tokenizer's Rust tokenizer
        (on the host's cores unless ``TOKENIZERS_PARALLELISM=false``): the ids
        ``tokenizer(text)`` gives without truncation or padding; one by one for a
        tokenizer without one (a Python-only tokenizer)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return [self.encode(t) for t in texts]
        return [list(enc.ids) for enc in backend.encode_batch(texts, add_special_tokens=False)]

    def prompt(self, messages: Sequence[Mapping], tools: Any = None) -> list[int]:
        """The first prompt: the template with the generation prompt (as
        ``polyrl.data.prompts.encode_prompt`` when there are no tools)."""
        return self.prompt_and_text(messages, tools)[0]

    def prompt_and_text(
        self, messages: Sequence[Mapping], tools: Any = None
    ) -> tuple[list[int], str]:
        """:meth:`prompt`'s ids and the template's text they encode (what an episode's
        first observation extends: :attr:`Episode.rendered`)."""
        text = self.render(messages, tools, True)
        return self.encode(text), text

    def observation(
        self,
        messages: Sequence[Mapping],
        new: Sequence[Mapping],
        tools: Any,
        sampled: Sequence[int],
        before: str | None = None,
    ) -> tuple[list[int], str]:
        """The ids to append after the model's last turn (``messages[-1]``, sampled as
        ``sampled``) for the ``new`` messages, up to the next generation prompt, and the
        template's text of the conversation with them and that prompt: the next
        observation's ``before``, the rendering of ``messages[:-1]`` with the generation
        prompt (rendered here when not given: an episode keeps it from its last request)."""
        if before is None:
            before = self.render(messages[:-1], tools, True)
        closed = self.render(messages, tools, False)
        content = str(messages[-1]["content"])
        if not closed.startswith(before + content):
            raise TemplateError(
                "the template does not render the assistant turn as the generation prompt "
                "followed by its text"
            )
        tail = closed[len(before) + len(content) :]  # the template's end of the turn
        if sampled and sampled[-1] == self.eos_id and tail.startswith(self.eos_text):
            tail = tail[len(self.eos_text) :]  # the model sampled that part itself
        full = self.render([*messages, *new], tools, True)
        if not full.startswith(closed):
            raise TemplateError(
                "the template renders the conversation differently once messages are "
                "appended (it rewrites earlier turns)"
            )
        return self.encode(tail + full[len(closed) :]), full


@dataclasses.dataclass
class Episode:
    """One episode's state while it runs (driver side)."""

    index: int  # in the batch: seeds its turns
    key: int  # unique in the run: names its env in the env workers
    row: dict[str, Any]
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tools: Any = None
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)  # the response: every turn
    sampled: list[int] = dataclasses.field(default_factory=list)  # 1 where the model sampled
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (pos, r)
    turns: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    segments: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)
    info: dict[str, float] = dataclasses.field(default_factory=dict)
    finish: str | None = None
    detail: str = ""
    drift: dict[str, Any] | None = None
    # the template's text of prompt_ids + ids with the generation prompt: what the next
    # observation extends (ChatTokens.observation's ``before``)
    rendered: str | None = None
    # the response decoded with its special tokens, set with the drift check when the
    # episode is closed out (EpisodeRunner.close_out)
    text: str | None = None
    # seconds its turns spent at the rollout servers ("sampling") and in env steps ("env"),
    # and the first start and last end of either (EpisodeRunner.metrics: in flight)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    span: tuple[float, float] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def append(self, kind: str, turn: int, ids: Sequence[int], log_probs: Any, version: int | Any):
        """``version``: of every token, or per token (a turn a push continued in place)."""
        start = self.length
        self.ids.extend(int(t) for t in ids)
        self.sampled.extend([int(kind == "sampled")] * len(ids))
        self.log_probs.extend(np.asarray(log_probs, np.float64).tolist())
        per_token = np.ndim(version) > 0
        self.versions.extend(map(int, version) if per_token else [int(version)] * len(ids))
        self.segments.append((kind, turn, start, self.length))

    def timed(self, what: str, start: float) -> None:
        """Count the seconds since ``start`` (``time.monotonic()``) as ``what``."""
        now = time.monotonic()
        self.seconds[what] = self.seconds.get(what, 0.0) + now - start
        self.span = (start, now) if self.span is None else (min(self.span[0], start), now)

    def end(self, reason: str, detail: str = "") -> None:
        assert reason in FINISH_REASONS, reason
        self.finish, self.detail = reason, detail


def first_drift(
    ids: Sequence[int], fresh: Sequence[int], segments: Sequence[tuple[str, int, int, int]]
) -> dict[str, Any] | None:
    """Where an episode's ids (prompt + response) first differ from ``fresh`` (the
    template applied to its whole conversation), as ``{"position", "turn", "kind"}``
    (kind: "prompt", "sampled" or "observation"), or None. ``fresh`` may go on past the
    episode's ids (the template closes the last turn)."""
    n = min(len(ids), len(fresh))
    diff = np.flatnonzero(np.asarray(ids[:n]) != np.asarray(fresh[:n]))
    if len(diff):
        pos = int(diff[0])
    elif len(fresh) < len(ids):
        pos = len(fresh)
    else:
        return None
    for kind, turn, start, end in segments:
        if start <= pos < end:
            return {"position": pos, "turn": turn, "kind": kind}
    return {"position": pos, "turn": -1, "kind": "prompt"}
