"""PromptSource: the training rows, validated once, served in deterministic batches
(prompts for RL, pairs for DPO: PairSource, conversations for SFT: ChatSource).

Batch ``k`` depends only on the seed and ``k`` (an epoch is a seeded permutation), so a
resumed run sees exactly the prompts the uninterrupted run would have: the data
position in a checkpoint is just the step number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from polyrl.batch import Batch, from_token_lists
from polyrl.data.formats import read_dataset
from polyrl.data.prompts import encode_prompts
from polyrl.data.schema import validate_rows
from polyrl.data.tasks import MAKERS

__all__ = ["PromptSource", "PairSource", "ChatSource", "source_for"]


class PromptSource:
    """Validated prompt rows + their token ids.

    ``batch(k, size)`` returns a Batch with meta columns ``prompt_ids`` (list[int]),
    ``prompt`` (the chat messages), ``ground_truth``, ``data_source``, ``extra_info`` and the int64 tensor ``prompt_index``.
    """

    kind = "rl"

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        seed: int = 0,
        max_prompt_tokens: int | None = None,
        source: str = "<rows>",
        overlong: str = "error",
    ):
        # overlong (RolloutConfig.overlong_prompt): "error" rejects prompts over
        # max_prompt_tokens, "drop" leaves them out here, "truncate_left" keeps them for
        # the rollout pool to cut.
        self.report = validate_rows(
            rows, source, tokenizer, max_prompt_tokens, self.kind, overlong=overlong
        )
        kept = self.report.kept
        self.rows = list(rows) if kept is None else [rows[i] for i in kept]
        self.prompt_ids = self.encode(tokenizer)
        self.seed = seed

    def encode(self, tokenizer: Any) -> list[list[int]]:
        """The token ids each row is served with (the rendered prompt)."""
        return encode_prompts(tokenizer, self.rows)

    @classmethod
    def from_files(cls, files: Sequence[str], tokenizer: Any, **kw: Any) -> PromptSource:
        rows = [row for f in files for row in read_dataset(f)]
        return cls(rows, tokenizer, source=", ".join(files), **kw)

    @classmethod
    def from_task(
        cls, task: str, n: int, tokenizer: Any, split: str = "train", **kw: Any
    ) -> PromptSource:
        rows = MAKERS[cls.kind](task, n, seed=kw.get("seed", 0), split=split)
        return cls(rows, tokenizer, source=f"task {task} ({split})", **kw)

    def __len__(self) -> int:
        return len(self.rows)

    def indices(self, k: int, size: int) -> np.ndarray:
        """Row indices of batch ``k``: consecutive slices of per-epoch permutations."""
        if size > len(self):
            raise ValueError(
                f"prompts_per_step={size} is larger than the dataset ({len(self)} rows); "
                f"lower prompts_per_step or add data"
            )
        per_epoch = len(self) // size
        epoch, pos = divmod(k, per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        return order[pos * size : (pos + 1) * size]

    def batch(self, k: int, size: int) -> Batch:
        return self.take(self.indices(k, size))

    def take(self, idx: np.ndarray) -> Batch:
        """The rows at ``idx`` (e.g. ``np.arange(len(source))``: all, in file order)."""
        rows = [self.rows[i] for i in idx]
        return Batch(
            {"prompt_index": idx.astype(np.int64)},
            {
                "prompt_ids": [self.prompt_ids[i] for i in idx],
                "prompt": [r["prompt"] for r in rows],
                "ground_truth": [r["ground_truth"] for r in rows],
                "data_source": [r["data_source"] for r in rows],
                "extra_info": [r.get("extra_info") for r in rows],
            },
        )


class PairSource(PromptSource):
    """Preference pairs (``prompt``, ``chosen``, ``rejected``) for DPO.

    ``batch(k, size)`` (and ``take(idx)``) returns ``2 * size`` rows, interleaved: row
    ``2i`` is pair ``i``'s chosen and row ``2i + 1`` its rejected response (each ending
    with EOS), in the sequence layout of ``polyrl.batch``. Mini-batches of even size keep
    pairs whole. DPO and the reward model (Bradley-Terry) read it.
    """

    kind = "preference"

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Any, **kw: Any):
        super().__init__(rows, tokenizer, **kw)
        eos = [tokenizer.eos_token_id]

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos

        self.responses = [(encode(r["chosen"]), encode(r["rejected"])) for r in self.rows]
        self.pad_id = tokenizer.pad_token_id

    def take(self, idx: np.ndarray) -> Batch:
        prompts = [self.prompt_ids[i] for i in idx for _ in range(2)]
        responses = [resp for i in idx for resp in self.responses[i]]
        seq = from_token_lists(prompts, responses, self.pad_id)
        return seq.with_columns({"pair_index": np.repeat(idx, 2).astype(np.int64)})


class ChatSource(PromptSource):
    """SFT conversations (``messages``), tokenized once with a mask per assistant turn
    (``polyrl.data.chat.encode_chat``).

    ``batch(k, size)`` returns ``size`` rows in the sequence layout of ``polyrl.batch``:
    the prompt is the conversation up to its first assistant turn, the response the rest,
    and ``response_mask`` is 1 on assistant tokens only (0 on later user turns).
    ``max_prompt_tokens`` limits whole conversations.
    """

    kind = "sft"

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Any, **kw: Any):
        super().__init__(rows, tokenizer, **kw)
        self.pad_id = tokenizer.pad_token_id

    def encode(self, tokenizer: Any) -> list[Any]:
        from polyrl.data.chat import encode_chat

        return [encode_chat(tokenizer, row["messages"]) for row in self.rows]

    def take(self, idx: np.ndarray) -> Batch:
        chats = [self.prompt_ids[i] for i in idx]
        seq = from_token_lists([c.prompt for c in chats], [c.response for c in chats], self.pad_id)
        mask = seq["response_mask"].copy()
        for row, chat in enumerate(chats):
            mask[row, : len(chat.mask)] = chat.mask
        return seq.with_columns(
            {"response_mask": mask, "prompt_index": np.asarray(idx, np.int64)},
            {"messages": [self.rows[i]["messages"] for i in idx]},
        )


def source_for(kind: str) -> type[PromptSource]:
    """The data source of a row kind (``AlgorithmSpec.data_kind``: "rl", "preference",
    "sft")."""
    return {"rl": PromptSource, "preference": PairSource, "sft": ChatSource}[kind]
