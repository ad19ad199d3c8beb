"""Synthetic tasks with rule-based rewards, written as prompt datasets in the RL schema.

RL schema (one row per prompt; what ``polyrl validate-dataset`` checks)::

    prompt        list of chat messages [{"role": "user", "content": str}, ...]
    ground_truth  str   what the reward function compares against
    data_source   str   selects the reward function (``polyrl.rewards``)
    extra_info    dict  optional, passed to the reward function (e.g. the split, the index)

Tasks:

* ``polyrl/addition`` — "37+45=" -> "82"; exact-match reward (1 or 0). A random policy
  scores ~0: a task for a model that already knows something.
* ``polyrl/copy`` — "copy 471" -> "471"; per-position credit (1 for the right digit, 0.25
  for a wrong digit; see ``polyrl.rewards.rules``). A random policy scores > 0, so RL
  learns it from scratch.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

__all__ = [
    "TASKS",
    "Task",
    "register_task",
    "make_rows",
    "make_preference_rows",
    "make_chat_rows",
    "MAKERS",
    "corpus",
]


@dataclasses.dataclass(frozen=True)
class Task:
    data_source: str
    make: Callable[[random.Random], tuple[str, str]]  # rng -> (user text, ground truth)
    description: str


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str(a + b)


def _copy(rng: random.Random, digits: int = 3) -> tuple[str, str]:
    s = "".join(rng.choice("0123456789") for _ in range(digits))
    return f"copy {s}", s


TASKS: dict[str, Task] = {
    "addition": Task("polyrl/addition", _addition, "2-digit addition, exact-match reward"),
    "copy": Task("polyrl/copy", _copy, "copy a 3-digit string, per-position partial credit"),
}
# The tokenizer's corpus: the built-in tasks only, so a user's task never changes it.
_BUILTIN_TASKS = tuple(TASKS.values())


def register_task(
    name: str, data_source: str, make: Callable[[random.Random], tuple[str, str]], description: str
) -> Task:
    """Add a task that ``polyrl.RunConfig.task = name`` generates on the fly: ``make(rng)``
    returns (user text, ground truth) and rows get ``data_source`` (register its reward
    with ``polyrl.rewards.register_reward``). Call it from a module given to ``--import``
    (docs/rewards.md). The tiny tokenizer knows only the built-in tasks' alphabet."""
    task = Task(data_source, make, description)
    if name in TASKS and TASKS[name] != task:
        raise ValueError(
            f"task {name!r} is already registered (data_source {TASKS[name].data_source!r})"
        )
    TASKS[name] = task
    return task


def corpus(samples_per_task: int = 200) -> list[str]:
    """Text the tokenizer is trained on (polyrl.data.tiny): every task's prompts and
    answers, the chat roles, and every digit and operator, so nothing a task or the chat
    template produces falls outside the vocabulary."""
    rng = random.Random("tokenizer-corpus")
    lines = ["0123456789 +-*=:", "system: user: assistant:"]
    for task in _BUILTIN_TASKS:
        for _ in range(samples_per_task):
            lines.extend(task.make(rng))
    return lines


def make_rows(task: str, n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` rows of ``task`` in the RL schema, deterministic in ``seed``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; available tasks: {sorted(TASKS)}")
    spec = TASKS[task]
    rng = random.Random(f"{task}/{split}/{seed}")
    rows = []
    for i in range(n):
        text, answer = spec.make(rng)
        rows.append(
            {
                "prompt": [{"role": "user", "content": text}],
                "ground_truth": answer,
                "data_source": spec.data_source,
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def make_preference_rows(task: str, n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` preference pairs for DPO: the RL rows plus ``chosen`` (the ground truth) and
    ``rejected`` (the same length, every character changed to another digit/char of the
    answer's alphabet), deterministic in ``seed``."""
    rng = random.Random(f"{task}/{split}/{seed}/rejected")
    rows = make_rows(task, n, seed, split)
    for row in rows:
        good = row["ground_truth"]
        bad = "".join(rng.choice([d for d in "0123456789" if d != c]) for c in good)
        row["chosen"], row["rejected"] = good, bad
    return rows


def make_chat_rows(task: str, n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` SFT conversations (``messages``) of ``task``, deterministic in ``seed``: the
    user's task text and the assistant's answer (the ground truth); every third row is a
    two-exchange conversation (a second task in the same chat), so the data has
    multi-turn rows whose loss mask covers two assistant turns."""
    rows = make_rows(task, 2 * n, seed, split)
    out = []
    for i in range(n):
        first, second = rows[2 * i], rows[2 * i + 1]
        messages = [
            *first["prompt"],
            {"role": "assistant", "content": first["ground_truth"]},
        ]
        if i % 3 == 2:
            messages += [
                *second["prompt"],
                {"role": "assistant", "content": second["ground_truth"]},
            ]
        out.append(
            {
                "messages": messages,
                "data_source": first["data_source"],
                "extra_info": {"split": split, "index": i},
            }
        )
    return out


# Row kind (polyrl.data.schema.KINDS) -> the rows a built-in task makes of that kind.
MAKERS = {"rl": make_rows, "preference": make_preference_rows, "sft": make_chat_rows}
