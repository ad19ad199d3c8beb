"""Validation of prompt datasets in the RL schema (see ``polyrl.data.tasks``).

Run before any worker starts (``polyrl validate-dataset``, and by the trainer when it
loads data): every problem names the row, the field, the bad value and the fix, and
all problems are reported at once rather than the first only.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polyrl.data.formats import read_dataset, row_schema
from polyrl.data.prompts import encode_prompt
from polyrl.rewards import REWARDS

__all__ = ["DatasetError", "DatasetReport", "validate_rows", "validate_file", "ROLES"]

ROLES = ("system", "user", "assistant")
REQUIRED = ("prompt", "ground_truth", "data_source")
# Preference (DPO) rows: the prompt and two assistant responses, the first preferred.
PREFERENCE_REQUIRED = ("prompt", "chosen", "rejected")


class DatasetError(ValueError):
    """A dataset does not follow the RL schema; ``problems`` lists every finding."""

    def __init__(self, source: str, problems: list[str], n_rows: int):
        self.problems = problems
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(
            f"dataset {source}: {len(problems)} problem(s) in {n_rows} rows:\n  {shown}{more}"
        )


@dataclasses.dataclass(frozen=True)
class DatasetReport:
    n_rows: int
    data_sources: dict[str, int]
    max_prompt_chars: int
    max_prompt_tokens: int | None = None
    schema: str = "polyrl"  # "verl": ground truth read from reward_model.ground_truth

    def summary(self) -> str:
        sources = ", ".join(f"{k}: {v}" for k, v in sorted(self.data_sources.items()))
        tokens = (
            ""
            if self.max_prompt_tokens is None
            else f", longest prompt {self.max_prompt_tokens} tokens"
        )
        schema = ", verl schema" if self.schema == "verl" else ""
        return f"{self.n_rows} rows ({sources}){tokens}{schema}"


def _row_problems(i: int, row: Any, required: tuple[str, ...] = REQUIRED) -> list[str]:
    """Every problem of row ``i``; ``data_source`` must have a reward only when required."""
    if not isinstance(row, Mapping):
        return [
            f"row {i}: expected an object with fields {list(required)}, got {type(row).__name__}"
        ]
    problems = [
        f"row {i}: missing field {name!r} (required fields: {list(required)})"
        + (" or verl's 'reward_model': {'ground_truth': ...}" if name == "ground_truth" else "")
        for name in required
        if name not in row
    ]
    prompt = row.get("prompt")
    if "prompt" in row:
        if not isinstance(prompt, Sequence) or isinstance(prompt, str) or not prompt:
            problems.append(
                f"row {i}: field 'prompt' must be a non-empty list of chat messages "
                f"[{{'role': 'user', 'content': ...}}], got {prompt!r:.80}"
            )
        else:
            for j, msg in enumerate(prompt):
                role = msg.get("role") if isinstance(msg, Mapping) else None
                content = msg.get("content") if isinstance(msg, Mapping) else None
                if role not in ROLES:
                    problems.append(
                        f"row {i}: prompt[{j}].role={role!r} is not one of {list(ROLES)}"
                    )
                if not isinstance(content, str) or not content:
                    problems.append(
                        f"row {i}: prompt[{j}].content must be a non-empty string, got {content!r:.80}"
                    )
    for name in ("ground_truth", "data_source", "chosen", "rejected"):
        if name in row and not isinstance(row[name], str):
            problems.append(
                f"row {i}: field {name!r} must be a string, got {type(row[name]).__name__} {row[name]!r:.80}"
            )
    source = row.get("data_source")
    if "data_source" in required and isinstance(source, str) and source not in REWARDS:
        problems.append(
            f"row {i}: data_source={source!r} has no reward function; registered sources: "
            f"{sorted(REWARDS)} (register one with polyrl.rewards.register_reward)"
        )
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        problems.append(
            f"row {i}: field 'extra_info' must be an object or absent, got {extra!r:.80}"
        )
    return problems


def validate_rows(
    rows: Sequence[Any],
    source: str = "<rows>",
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    kind: str = "rl",
) -> DatasetReport:
    """Check every row; raise :class:`DatasetError` listing all problems.

    kind: "rl" (prompt, ground_truth, data_source) or "preference" (prompt, chosen,
    rejected; data_source optional).

    With a ``tokenizer`` (transformers), prompts are rendered with its chat template and
    counted; rows over ``max_prompt_tokens`` are problems (name the row and length).
    """
    kinds = {"rl": REQUIRED, "preference": PREFERENCE_REQUIRED}
    if kind not in kinds:
        raise ValueError(f"validate_rows: kind={kind!r} is not one of {sorted(kinds)}")
    if not rows:
        raise DatasetError(source, ["the dataset has no rows"], 0)
    problems = [p for i, row in enumerate(rows) for p in _row_problems(i, row, kinds[kind])]
    longest_tokens = None
    if tokenizer is not None and not problems:
        longest_tokens = 0
        for i, row in enumerate(rows):
            n = len(encode_prompt(tokenizer, row["prompt"]))
            longest_tokens = max(longest_tokens, n)
            if max_prompt_tokens is not None and n > max_prompt_tokens:
                problems.append(
                    f"row {i}: prompt is {n} tokens, over max_prompt_tokens={max_prompt_tokens} "
                    f"(raise the limit or drop/shorten the row)"
                )
    if problems:
        raise DatasetError(source, problems, len(rows))
    return DatasetReport(
        n_rows=len(rows),
        data_sources=dict(collections.Counter(r.get("data_source", "<none>") for r in rows)),
        max_prompt_chars=max(sum(len(m["content"]) for m in r["prompt"]) for r in rows),
        max_prompt_tokens=longest_tokens,
        schema=row_schema(rows[0]),
    )


def validate_file(
    path: str | Path,
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    kind: str | None = None,
) -> DatasetReport:
    """Read a dataset (a file, a shard directory or a Hugging Face folder; see
    polyrl.data.formats) and :func:`validate_rows` it. ``kind``
    None: "preference" if the first row has ``chosen``, else "rl"."""
    rows = read_dataset(path)
    if kind is None:
        kind = (
            "preference" if rows and isinstance(rows[0], Mapping) and "chosen" in rows[0] else "rl"
        )
    return validate_rows(rows, str(path), tokenizer, max_prompt_tokens, kind)
