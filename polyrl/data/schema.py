"""Validation of datasets: the RL, preference and SFT (chat) schemas (``polyrl.data.tasks``).

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

from polyrl.data.formats import from_verl, read_dataset, row_schema, write_dataset
from polyrl.data.prompts import encode_prompt
from polyrl.rewards import REWARDS

__all__ = [
    "DatasetError",
    "DatasetReport",
    "validate_rows",
    "validate_file",
    "load_rows",
    "ROLES",
    "KINDS",
]

ROLES = ("system", "user", "assistant")
REQUIRED = ("prompt", "ground_truth", "data_source")
# data_sources an environment plays (multi-turn rows score in their env, not by a reward
# function); polyrl.envs.register_env adds to it, so this package never imports envs.
ENV_SOURCES: set[str] = set()
# Preference (DPO) rows: the prompt and two assistant responses, the first preferred.
PREFERENCE_REQUIRED = ("prompt", "chosen", "rejected")
# SFT rows: one conversation, learned on its assistant turns (polyrl.data.chat).
SFT_REQUIRED = ("messages",)
KINDS = {"rl": REQUIRED, "preference": PREFERENCE_REQUIRED, "sft": SFT_REQUIRED}
OVERLONG = ("error", "truncate_left", "drop")
BAD_ROWS = ("error", "drop")  # validate-dataset --bad-rows


class DatasetError(ValueError):
    """A dataset does not follow the RL schema; ``problems`` lists every finding,
    ``n_bad`` how many of its ``n_rows`` rows (and unreadable lines) they concern (0: the
    file as a whole)."""

    def __init__(self, source: str, problems: list[str], n_rows: int, n_bad: int = 0):
        self.problems, self.n_rows, self.n_bad = problems, n_rows, n_bad
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
    kind: str = "rl"
    over_limit: int = 0  # rows over max_prompt_tokens (dropped or truncated by the policy)
    overlong: str = "error"
    kept: tuple[int, ...] | None = None  # with overlong="drop": the rows that stay
    schema: str = "polyrl"  # "verl": ground truth read from reward_model.ground_truth
    # With bad_rows="drop": the rows that pass every check (None: all do, or "error"),
    # the rows and lines left out and what was wrong with them.
    good: tuple[int, ...] | None = None
    n_bad: int = 0
    bad: tuple[str, ...] = ()

    def summary(self) -> str:
        sources = ", ".join(f"{k}: {v}" for k, v in sorted(self.data_sources.items()))
        tokens = (
            ""
            if self.max_prompt_tokens is None
            else f", longest prompt {self.max_prompt_tokens} tokens"
        )
        schema = ", verl schema" if self.schema == "verl" else ""
        return f"{self.n_rows} rows ({sources}){tokens}{schema}"

    def table(self) -> str:
        """The summary table ``polyrl validate-dataset`` prints."""
        verb = {"drop": "dropped", "truncate_left": "truncated"}.get(self.overlong)
        rows = [
            ("schema", f"{self.kind} ({self.schema} fields)"),
            ("rows", str(self.n_rows)),
            *((f"  data_source {k}", str(v)) for k, v in sorted(self.data_sources.items())),
            ("longest prompt (chars)", str(self.max_prompt_chars)),
            (
                "longest prompt (tokens)",
                "- (no --tokenizer)"
                if self.max_prompt_tokens is None
                else str(self.max_prompt_tokens),
            ),
        ]
        if verb:
            rows.append((f"rows {verb} (over the token limit)", str(self.over_limit)))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _label(i: int, lines: Sequence[int] | None) -> str:
    return f"row {i} (line {lines[i]})" if lines else f"row {i}"


def grouped(problems: Sequence[str], shown: int = 3) -> list[str]:
    """One line per distinct problem: ``row 3: X`` stays as is; the same ``X`` in many
    rows becomes ``512 rows (row 0, row 1, row 2, ...): X``, in first-seen order."""
    rows: dict[str, list[str]] = {}
    for problem in problems:
        label, sep, what = problem.partition(": ")
        if not (sep and label.startswith("row ")):
            label, what = "", problem
        rows.setdefault(what, []).append(label)
    out = []
    for what, labels in rows.items():
        if len(labels) == 1:
            out.append(f"{labels[0]}: {what}" if labels[0] else what)
            continue
        more = ", ..." if len(labels) > shown else ""
        out.append(f"{len(labels)} rows ({', '.join(labels[:shown])}{more}): {what}")
    return out


def _prompt_problems(at: str, prompt: Any) -> list[str]:
    if not isinstance(prompt, Sequence) or isinstance(prompt, str) or not prompt:
        return [
            f"{at}: field 'prompt' must be a non-empty list of chat messages "
            f"[{{'role': 'user', 'content': ...}}], got {prompt!r:.80}"
        ]
    out = []
    roles = []
    for j, msg in enumerate(prompt):
        role = msg.get("role") if isinstance(msg, Mapping) else None
        content = msg.get("content") if isinstance(msg, Mapping) else None
        roles.append(role)
        if role not in ROLES:
            out.append(f"{at}: prompt[{j}].role={role!r} is not one of {list(ROLES)}")
        if not isinstance(content, str) or not content:
            out.append(f"{at}: prompt[{j}].content must be a non-empty string, got {content!r:.80}")
    if all(r == "system" for r in roles):
        out.append(f"{at}: prompt has only system message(s); add a user turn the model answers")
    elif roles[-1] == "assistant":
        out.append(
            f"{at}: prompt ends on an assistant turn (prompt[{len(roles) - 1}]); the response "
            f"would continue it: end the prompt on a user turn"
        )
    return out


def _messages_problems(at: str, messages: Any) -> list[str]:
    """An SFT row's conversation: chat messages with at least one assistant turn, the
    first of which follows a user/system turn."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        return [
            f"{at}: field 'messages' must be a non-empty list of chat messages "
            f"[{{'role': 'user', 'content': ...}}, {{'role': 'assistant', 'content': ...}}], "
            f"got {messages!r:.80}"
        ]
    out, roles = [], []
    for j, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, Mapping) else None
        content = msg.get("content") if isinstance(msg, Mapping) else None
        roles.append(role)
        if role not in ROLES:
            out.append(f"{at}: messages[{j}].role={role!r} is not one of {list(ROLES)}")
        if not isinstance(content, str) or not content:
            out.append(
                f"{at}: messages[{j}].content must be a non-empty string, got {content!r:.80}"
            )
    if "assistant" not in roles:
        out.append(
            f"{at}: messages has no assistant message, so there is nothing to learn; add the "
            f"assistant's reply (role 'assistant') or drop the row"
        )
    elif roles[0] == "assistant":
        out.append(
            f"{at}: messages[0] is an assistant message; the first assistant turn must answer "
            f"a user (or system) message before it"
        )
    return out


def _row_problems(at: str, row: Any, required: tuple[str, ...] = REQUIRED) -> list[str]:
    """Every problem of one row (``at`` names it); ``data_source`` must have a reward only
    when required."""
    if not isinstance(row, Mapping):
        return [f"{at}: expected an object with fields {list(required)}, got {type(row).__name__}"]
    # A parquet column missing in some rows reads as null: the same as absent.
    row = {k: v for k, v in row.items() if v is not None}
    problems = [
        f"{at}: missing field {name!r} (required fields: {list(required)})"
        + (" or verl's 'reward_model': {'ground_truth': ...}" if name == "ground_truth" else "")
        for name in required
        if name not in row
    ]
    if "prompt" in row:
        problems += _prompt_problems(at, row["prompt"])
    if "messages" in row:
        problems += _messages_problems(at, row["messages"])
    for name in ("ground_truth", "data_source", "chosen", "rejected"):
        if name in row and not isinstance(row[name], str):
            problems.append(
                f"{at}: field {name!r} must be a string, got {type(row[name]).__name__} "
                f"{row[name]!r:.80}"
            )
        elif name in row and name in ("chosen", "rejected") and not row[name].strip():
            problems.append(f"{at}: field {name!r} is empty; give the response text")
        elif name == "ground_truth" and name in row and not row[name].strip():
            problems.append(
                f"{at}: field 'ground_truth' is empty; give the answer the reward compares "
                f"against (every response would be scored against nothing)"
            )
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if isinstance(chosen, str) and chosen.strip() and chosen == rejected:
        problems.append(
            f"{at}: 'chosen' and 'rejected' are the same text {chosen!r:.60}; the pair teaches "
            f"nothing: drop the row or fix one side"
        )
    source = row.get("data_source")
    if (
        "data_source" in required
        and isinstance(source, str)
        and source not in REWARDS
        and source not in ENV_SOURCES
    ):
        problems.append(
            f"{at}: data_source={source!r} has no reward function or environment; "
            f"registered sources: {sorted(REWARDS)}, environments: {sorted(ENV_SOURCES)}. "
            f"Register one with @polyrl.rewards.register_reward({source!r}) or "
            f"@polyrl.envs.register_env({source!r}) in a module and pass --import MODULE "
            f"(docs/rewards.md, docs/agents.md)"
        )
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        problems.append(f"{at}: field 'extra_info' must be an object or absent, got {extra!r:.80}")
    return problems


def validate_rows(
    rows: Sequence[Any],
    source: str = "<rows>",
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    kind: str = "rl",
    lines: Sequence[int] | None = None,
    overlong: str = "error",
    limit_name: str = "max_prompt_tokens",
    unread: Sequence[str] = (),
    bad_rows: str = "error",
) -> DatasetReport:
    """Check every row; raise :class:`DatasetError` listing all problems.

    kind: "rl" (prompt, ground_truth, data_source), "preference" (prompt, chosen,
    rejected — both non-empty and different; data_source optional) or "sft" (messages,
    with at least one assistant turn; prompt lengths are then whole conversations).
    lines: the file line of each row (jsonl), named in every problem. unread: the
    problems of lines that gave no row (:func:`load_rows`), reported with the rows'.

    With a ``tokenizer`` (transformers), the prompts of rows without other problems are
    rendered with its chat template and counted. Rows over ``max_prompt_tokens`` (which
    needs the tokenizer) are problems when ``overlong="error"``; with "drop" or
    "truncate_left" they are counted in the report (``over_limit``; ``kept`` lists the
    rows a drop keeps). When every row is over the limit under "error", that is one
    problem naming ``limit_name`` (the setting that holds the limit), its value and the
    shortest prompt.

    bad_rows: "error" raises on any problem; "drop" returns a report whose ``good`` rows
    pass every check, with the count (``n_bad``) and problems (``bad``) of the rows and
    unread lines left out (an error still when none is left).
    """
    if kind not in KINDS:
        raise ValueError(f"validate_rows: kind={kind!r} is not one of {sorted(KINDS)}")
    if overlong not in OVERLONG:
        raise ValueError(f"validate_rows: overlong={overlong!r} is not one of {list(OVERLONG)}")
    if bad_rows not in BAD_ROWS:
        raise ValueError(f"validate_rows: bad_rows={bad_rows!r} is not one of {list(BAD_ROWS)}")
    read = len(rows) + len(unread)  # the rows the file holds, readable or not
    if max_prompt_tokens is not None and tokenizer is None:
        raise DatasetError(
            source,
            [
                f"max_prompt_tokens={max_prompt_tokens} needs a tokenizer to count prompt tokens; "
                f"pass --tokenizer <model dir>"
            ],
            read,
        )
    if not rows:
        raise DatasetError(source, [*unread, "the dataset has no rows"], read)
    by_row = {i: _row_problems(_label(i, lines), row, KINDS[kind]) for i, row in enumerate(rows)}
    bad = {i for i, found in by_row.items() if found}
    problems = [*unread, *grouped([p for found in by_row.values() for p in found])]
    checked = [i for i in range(len(rows)) if i not in bad]
    longest_tokens, over, kept = None, [], None
    if tokenizer is not None and checked:
        lengths = {i: _tokens(tokenizer, rows[i], kind) for i in checked}
        longest_tokens = max(lengths.values())
        if max_prompt_tokens is not None:
            over = [i for i in checked if lengths[i] > max_prompt_tokens]
        if len(over) == len(checked) and overlong == "error" and not bad:
            shortest = min(lengths.values())
            raise DatasetError(
                source,
                [
                    *unread,
                    f"every prompt ({len(rows)} rows) is over {limit_name}={max_prompt_tokens} "
                    f"tokens (the shortest is {shortest} tokens after the chat template), so "
                    f"nothing can be trained: raise {limit_name} to at least {shortest}, "
                    f"shorten the prompts or set RolloutConfig.overlong_prompt='truncate_left'",
                ],
                read,
            )
        if overlong == "error" and len(over) == 1:
            problems.append(
                f"{_label(over[0], lines)}: prompt is {lengths[over[0]]} tokens, over "
                f"max_prompt_tokens={max_prompt_tokens} (raise the limit, set "
                f"RolloutConfig.overlong_prompt to 'drop' or 'truncate_left', or shorten the row)"
            )
        elif overlong == "error" and over:
            worst = max(over, key=lambda i: lengths[i])
            labels = ", ".join(f"{_label(i, lines)} ({lengths[i]} tokens)" for i in over[:3])
            problems.append(
                f"{len(over)} rows ({labels}{', ...' if len(over) > 3 else ''}): prompt over "
                f"max_prompt_tokens={max_prompt_tokens} tokens, the longest is {lengths[worst]} "
                f"tokens ({_label(worst, lines)}) (raise the limit, set RolloutConfig.overlong_prompt "
                f"to 'drop' or 'truncate_left', or shorten the rows)"
            )
        if overlong == "error":
            bad.update(over)
        elif overlong == "drop":
            kept = tuple(i for i in checked if i not in set(over))
    good = [i for i in range(len(rows)) if i not in bad]
    if problems and (bad_rows == "error" or not good):
        none_left = [] if good or bad_rows == "error" else ["no row passes every check"]
        raise DatasetError(source, problems + none_left, read, len(bad) + len(unread))
    return DatasetReport(
        n_rows=len(good),
        data_sources=dict(collections.Counter(rows[i].get("data_source", "<none>") for i in good)),
        max_prompt_chars=max(
            sum(len(m["content"]) for m in rows[i]["messages" if kind == "sft" else "prompt"])
            for i in good
        ),
        max_prompt_tokens=longest_tokens,
        kind=kind,
        over_limit=len(over),
        overlong=overlong,
        kept=kept,
        schema=row_schema(rows[0]),
        good=tuple(good) if problems else None,
        n_bad=len(bad) + len(unread),
        bad=tuple(problems),
    )


def _tokens(tokenizer: Any, row: Mapping[str, Any], kind: str) -> int:
    """The row's length in tokens: the rendered prompt, or a whole SFT conversation."""
    if kind == "sft":
        from polyrl.data.chat import TemplateError, encode_chat

        try:
            chat = encode_chat(tokenizer, row["messages"])
        except TemplateError as e:
            raise DatasetError("<chat template>", [str(e)], 1) from None
        return len(chat.prompt) + len(chat.response)
    return len(encode_prompt(tokenizer, row["prompt"]))


def _jsonl_rows(path: Path) -> tuple[list[Any], list[int], list[str]]:
    """Rows of a jsonl file, their line numbers and the problem of each line that gives
    no row (not UTF-8, not JSON); the lines after a bad one are still read."""
    import json

    rows, lines, problems = [], [], []
    data = path.read_bytes()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append(
                f"line {number}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                f"re-encode the file as UTF-8"
            )
            continue
        if not text.strip():
            continue
        try:
            rows.append(from_verl(json.loads(text)))
            lines.append(number)
        except json.JSONDecodeError as e:
            # json's messages for where something starts end in "at" ("Unterminated
            # string starting at"): the column completes them
            where = f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"
            problems.append(
                f"line {number}: invalid JSON ({where}); each line must be one JSON object"
            )
    return rows, lines, problems


def load_rows(path: str | Path) -> tuple[list[Any], list[int] | None, list[str]]:
    """Read a dataset (file, shard directory, HF folder: polyrl.data.formats) for
    validation: ``(rows, line of each row, problems of lines that gave no row)`` (lines
    and their problems: a jsonl file only; pass them to :func:`validate_rows`). A
    missing, unreadable or unparsable file is a :class:`DatasetError` naming it. The
    file is only read, never modified."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(str(path), [f"file {str(path)!r} does not exist"], 0)
    try:
        if path.suffix == ".jsonl" and path.is_file():
            return _jsonl_rows(path)
        return read_dataset(path), None, []
    except PermissionError as e:
        raise DatasetError(
            str(path),
            [f"file {str(path)!r} is not readable ({e.strerror}); fix its permissions"],
            0,
        ) from None
    except DatasetError:
        raise
    except Exception as e:  # pyarrow and friends: a corrupt file, named
        raise DatasetError(
            str(path), [f"file {str(path)!r} cannot be parsed: {type(e).__name__}: {e}"], 0
        ) from None


def detect_kind(rows: Sequence[Any]) -> str:
    """ "preference" when any row carries ``chosen`` or ``rejected``, "sft" when any
    carries ``messages`` (and no ``prompt``), else "rl"."""
    rows = [r for r in rows if isinstance(r, Mapping)]
    if any("chosen" in r or "rejected" in r for r in rows):
        return "preference"
    return "sft" if any("messages" in r and "prompt" not in r for r in rows) else "rl"


def validate_file(
    path: str | Path,
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    kind: str | None = None,
    overlong: str = "error",
    limit_name: str = "max_prompt_tokens",
    bad_rows: str = "error",
    out: str | Path | None = None,
) -> DatasetReport:
    """Read a dataset (a file, a shard directory or a Hugging Face folder; see
    polyrl.data.formats) and :func:`validate_rows` it. ``kind`` None:
    :func:`detect_kind`. ``out``: write the rows that pass every check there
    (``.jsonl``/``.parquet``; with ``bad_rows="drop"`` the bad ones left out)."""
    rows, lines, unread = load_rows(path)
    kind = kind or detect_kind(rows)
    report = validate_rows(
        rows,
        str(path),
        tokenizer,
        max_prompt_tokens,
        kind,
        lines,
        overlong,
        limit_name,
        unread,
        bad_rows,
    )
    if out is not None:
        good = range(len(rows)) if report.good is None else report.good
        write_dataset([rows[i] for i in good], out)
    return report
