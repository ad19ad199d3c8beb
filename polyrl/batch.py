"""Batch: the one container that moves samples between roles.

A Batch is columnar: ``tensors`` maps a name to a numpy array whose first axis is the
sample axis (length ``B``); ``meta`` maps a name to a numpy *object* array of length
``B`` (strings, dicts, ground truths: anything per sample that is not numeric);
``info`` holds batch-level values (step, temperature, ...) that are not split.

It is plain numpy on purpose: numpy arrays pickle out-of-band, so Ray moves a Batch
through the object store without copying the column buffers, and every backend turns
numpy into its own arrays at its edge.

Sequence layout used by every role (shapes: B samples, P prompt tokens, R response
tokens)::

    prompts         [B, P]    int32  left-padded with pad_id
    responses       [B, R]    int32  right-padded with pad_id
    input_ids       [B, P+R]  int32  concat(prompts, responses)
    attention_mask  [B, P+R]  int32  1 on real tokens
    position_ids    [B, P+R]  int32  0 at the first real token, counting real tokens
    response_mask   [B, R]    float32 1 on real response tokens

Token ``responses[:, t]`` is predicted by the logits at position ``P - 1 + t``; a
backend's per-token log-probs are therefore ``[B, R]`` and line up with
``response_mask``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Batch", "from_token_lists"]

Index = int | slice | Sequence[int] | np.ndarray


def _as_meta(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object:
        return values
    values = list(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values  # assigning a list keeps nested lists/dicts as single objects
    return out


@dataclasses.dataclass
class Batch:
    """Columnar samples: ``tensors`` (numpy, first axis = sample), ``meta`` (object
    arrays, one entry per sample) and ``info`` (batch-level values)."""

    tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    meta: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = {k: np.asarray(v) for k, v in self.tensors.items()}
        self.meta = {k: _as_meta(v) for k, v in self.meta.items()}
        self._check_lengths()

    # ------------------------------------------------------------------ checks
    def _check_lengths(self) -> None:
        lengths: dict[str, int] = {}
        for kind, cols in (("tensor", self.tensors), ("meta", self.meta)):
            for name, col in cols.items():
                if col.ndim == 0:
                    raise ValueError(
                        f"Batch {kind} column {name!r} is a scalar; per-sample columns need a "
                        f"leading sample axis (put batch-level values in Batch.info)"
                    )
                lengths[name] = col.shape[0]
        if len(set(lengths.values())) > 1:
            first = next(iter(lengths))
            bad = next(k for k, n in lengths.items() if n != lengths[first])
            raise ValueError(
                f"Batch column {bad!r} has {lengths[bad]} samples but column {first!r} has "
                f"{lengths[first]}; every column must have the same first dimension "
                f"(all lengths: {lengths})"
            )

    def __len__(self) -> int:
        for cols in (self.tensors, self.meta):
            for col in cols.values():
                return int(col.shape[0])
        return 0

    @property
    def batch_size(self) -> int:
        return len(self)

    def keys(self) -> list[str]:
        return [*self.tensors, *self.meta]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.meta

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.meta:
            return self.meta[name]
        raise KeyError(f"Batch has no column {name!r}; columns: {sorted(self.keys())}")

    def require(self, *names: str, who: str = "this step") -> None:
        """Raise a KeyError naming every column ``who`` needs that is missing."""
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(
                f"{who} needs batch column(s) {missing}, but the batch has {sorted(self.keys())}"
            )

    # ------------------------------------------------------------- transforms
    def with_columns(
        self,
        tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        **info: Any,
    ) -> Batch:
        """A new Batch with columns added or replaced (arrays are shared, not copied)."""
        return Batch(
            {**self.tensors, **dict(tensors or {})},
            {**self.meta, **dict(meta or {})},
            {**self.info, **info},
        )

    def select(self, *names: str) -> Batch:
        """Only the named columns (tensors or meta); info is kept."""
        self.require(*names, who="Batch.select")
        return Batch(
            {k: v for k, v in self.tensors.items() if k in names},
            {k: v for k, v in self.meta.items() if k in names},
            dict(self.info),
        )

    def take(self, index: Index) -> Batch:
        """Rows by int, slice, integer array or boolean mask (a view for slices)."""
        if isinstance(index, int):
            index = [index]
        if not isinstance(index, slice):
            index = np.asarray(index)
            if index.dtype == bool and index.shape != (len(self),):
                raise ValueError(
                    f"Batch.take: boolean mask has shape {index.shape}, batch has {len(self)} rows"
                )
        return Batch(
            {k: v[index] for k, v in self.tensors.items()},
            {k: v[index] for k, v in self.meta.items()},
            dict(self.info),
        )

    def split(self, n: int) -> list[Batch]:
        """``n`` contiguous chunks of equal size (e.g. one per data-parallel rank).

        Raises if ``len(self)`` is not a multiple of ``n``: uneven shards would make ranks
        disagree on normalisers. Use :meth:`pad_to_multiple` first when that is intended.
        """
        if n <= 0:
            raise ValueError(f"Batch.split: n must be positive, got {n}")
        if len(self) % n:
            raise ValueError(
                f"Batch.split: {len(self)} samples do not split into {n} equal chunks; "
                f"pad with Batch.pad_to_multiple({n}) or change the batch size to a multiple of {n}"
            )
        size = len(self) // n
        return [self.take(slice(i * size, (i + 1) * size)) for i in range(n)]

    def chunks(self, size: int) -> list[Batch]:
        """Consecutive chunks of at most ``size`` rows (micro-batches); the last may be short."""
        if size <= 0:
            raise ValueError(f"Batch.chunks: size must be positive, got {size}")
        return [self.take(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of all batches in order. Columns must match; info comes from the first."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensors) != set(first.tensors) or set(b.meta) != set(first.meta):
                raise ValueError(
                    f"Batch.concat: batch {i} has columns {sorted(b.keys())}, batch 0 has "
                    f"{sorted(first.keys())}"
                )
            for k, v in b.tensors.items():
                if v.shape[1:] != first.tensors[k].shape[1:]:
                    raise ValueError(
                        f"Batch.concat: column {k!r} has per-sample shape {v.shape[1:]} in batch "
                        f"{i} but {first.tensors[k].shape[1:]} in batch 0; pad to a common length"
                    )
        return Batch(
            {k: np.concatenate([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: np.concatenate([b.meta[k] for b in batches]) for k in first.meta},
            dict(first.info),
        )

    def repeat(self, n: int, group_key: str = "group_ids") -> Batch:
        """Each row ``n`` times in a row (``[a, a, b, b]`` for n=2), for n-way sampling.

        Adds the int64 tensor column ``group_key`` holding the source row's index, unless
        the batch already has it (then its values are repeated), so samples of one prompt
        share a group id.
        """
        if n <= 0:
            raise ValueError(f"Batch.repeat: n must be positive, got {n}")
        src = self
        if group_key not in self:
            src = self.with_columns({group_key: np.arange(len(self), dtype=np.int64)})
        return Batch(
            {k: np.repeat(v, n, axis=0) for k, v in src.tensors.items()},
            {k: np.repeat(v, n, axis=0) for k, v in src.meta.items()},
            dict(src.info),
        )

    def pad_to_multiple(self, k: int) -> Batch:
        """Append copies of the last row so ``len`` is a multiple of ``k``.

        Padding rows get ``is_pad = 1`` in the int8 tensor column ``is_pad`` so a loss
        can mask them out.
        """
        if k <= 0:
            raise ValueError(f"Batch.pad_to_multiple: k must be positive, got {k}")
        if len(self) == 0:
            raise ValueError("Batch.pad_to_multiple: cannot pad an empty batch")
        n_pad = (-len(self)) % k
        is_pad = np.zeros(len(self) + n_pad, dtype=np.int8)
        is_pad[len(self) :] = 1
        idx = np.concatenate([np.arange(len(self)), np.full(n_pad, len(self) - 1)])
        return self.take(idx).with_columns({"is_pad": is_pad})

    def nbytes(self) -> int:
        return int(sum(v.nbytes for v in self.tensors.values()))

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}{tuple(v.shape)}:{v.dtype}" for k, v in self.tensors.items())
        meta = ", ".join(self.meta)
        return f"Batch(n={len(self)}, tensors=[{cols}], meta=[{meta}], info={sorted(self.info)})"


def from_token_lists(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    prompt_len: int | None = None,
    response_len: int | None = None,
) -> Batch:
    """Build the sequence columns (see module docstring) from ragged token lists.

    ``prompt_len``/``response_len`` fix the padded widths (e.g. to a few bucketed
    sizes so a jitted backend compiles a bounded number of times); they default to the
    longest prompt/response. A prompt or response longer than its width is an error.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"from_token_lists: {len(prompts)} prompts but {len(responses)} responses")
    p_max = max((len(p) for p in prompts), default=0)
    r_max = max((len(r) for r in responses), default=0)
    P = p_max if prompt_len is None else prompt_len
    R = r_max if response_len is None else response_len
    for name, width, longest in (("prompt_len", P, p_max), ("response_len", R, r_max)):
        if longest > width:
            raise ValueError(
                f"from_token_lists: {name}={width} but the longest sequence has {longest} tokens"
            )
    B = len(prompts)
    prompt_arr = np.full((B, P), pad_id, dtype=np.int32)
    resp_arr = np.full((B, R), pad_id, dtype=np.int32)
    attn = np.zeros((B, P + R), dtype=np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p):
            prompt_arr[i, P - len(p) :] = p
        resp_arr[i, : len(r)] = r
        attn[i, P - len(p) : P + len(r)] = 1
    position_ids = np.clip(np.cumsum(attn, axis=1) - 1, 0, None).astype(np.int32)
    return Batch(
        {
            "prompts": prompt_arr,
            "responses": resp_arr,
            "input_ids": np.concatenate([prompt_arr, resp_arr], axis=1),
            "attention_mask": attn,
            "position_ids": position_ids,
            "response_mask": attn[:, P:].astype(np.float32),
        }
    )
