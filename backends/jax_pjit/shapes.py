"""Shape padding: pad a Batch to a few shapes so jitted steps compile a bounded number
of times.

``jax.jit`` compiles once per input shape. RL batches vary in prompt length ``P`` and
response length ``R`` every step, so both are padded up to a power of two (at least
``min_len``), and the sample count ``B`` is padded to a whole number of micro-batches.
A run therefore compiles at most ``log2(max_len / min_len) + 1`` sizes per axis.

Padding keeps polyrl.batch's layout: prompt columns grow on the left, response columns
on the right (so ``responses[:, t]`` stays predicted at ``P - 1 + t`` of the padded
sequence), padded positions and rows have ``attention_mask = response_mask = 0``, and
every other response-aligned column (``[B, R]``: old log-probs, advantages, ...) is
zero-padded on the right. Outputs are cut back to ``[:B, :R]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from polyrl.batch import Batch

__all__ = ["Padded", "pow2_len", "micro_rows", "padded_cost", "pad_batch", "pack_rows"]

SEQUENCE = ("input_ids", "attention_mask", "position_ids")  # [B, P + R]
REQUIRED = (*SEQUENCE, "responses", "response_mask")


def pow2_len(n: int, min_len: int) -> int:
    """Smallest power of two >= max(n, min_len)."""
    n = max(int(n), int(min_len), 1)
    return 1 << (n - 1).bit_length()


def micro_rows(batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Rows of one global micro-batch: ``dp`` shards of at most ``micro_batch_size``, the
    per-shard count rounded up to a power of two so small batches do not pad to a full
    micro-batch yet still compile a bounded number of shapes."""
    per_shard = -(-batch_size // dp)
    return dp * min(micro_batch_size, pow2_len(per_shard, 1))


def padded_cost(shards: int, min_len: int, packed: bool) -> Callable[[np.ndarray, np.ndarray], int]:
    """``polyrl.micro_batch.plan``'s cost of a global micro-batch as this backend pads it,
    from its rows' real prompt and response lengths (in the micro-batch's order): rows up
    to :func:`micro_rows` (``shards`` x a power of two) and prompt and response lengths up
    to powers of two (:func:`pad_batch`); ``packed`` (:func:`pack_rows`): ``shards`` rows
    as long as the longest shard's real tokens rounded up to a power of two."""

    def cost(prompt: np.ndarray, response: np.ndarray) -> int:
        rows = micro_rows(len(prompt), len(prompt), shards)
        if not packed:
            return rows * (pow2_len(prompt.max(), min_len) + pow2_len(response.max(), min_len))
        tokens = np.zeros(rows, np.int64)
        tokens[: len(prompt)] = prompt + response
        return shards * packed_len(tokens, shards, min_len)

    return cost


def packed_len(lengths: np.ndarray, shards: int, min_len: int) -> int:
    """The length of each packed row (:func:`pack_rows`) of a padded micro-batch whose
    rows have these real ``lengths`` (a multiple of ``shards`` of them): the longest
    shard's tokens, up to a power of two."""
    return pow2_len(lengths.reshape(shards, -1).sum(1).max(), min_len)


@dataclasses.dataclass
class Padded:
    """The padded numeric columns and what is needed to undo the padding."""

    arrays: dict[str, np.ndarray]
    batch_size: int  # original B
    response_len: int  # original R


def _pad(x: np.ndarray, left: int, right: int, mode: str = "constant") -> np.ndarray:
    widths = [(0, 0), (left, right)] + [(0, 0)] * (x.ndim - 2)
    return np.pad(x, widths, mode=mode)


def _canonical(name: str, x: np.ndarray) -> np.ndarray:
    if x.dtype == np.float64:
        return x.astype(np.float32)
    if x.dtype in (np.int64, np.uint64, np.uint32):
        return x.astype(np.int32)
    if x.dtype == bool:
        return x.astype(np.int32)
    if x.dtype.kind not in "fiu":
        raise TypeError(
            f"batch column {name!r} has dtype {x.dtype}; numeric columns only (put other "
            "per-sample data in Batch.meta)"
        )
    return x


def pad_batch(
    batch: Batch, rows_multiple: int, min_len: int, at_least: tuple[int, int, int] = (0, 0, 0)
) -> Padded:
    """Pad ``batch``'s tensors: P and R to powers of two, B to a multiple of ``rows_multiple``;
    ``at_least``: (B, P, R) to pad up to at least (the largest shard of any host, so all
    hosts of a multi-controller role build the same global shapes)."""
    batch.require(*REQUIRED, who="the jax_pjit backend")
    b, r = batch["responses"].shape
    p = batch["input_ids"].shape[1] - r
    pb, rb = pow2_len(max(p, at_least[1]), min_len), pow2_len(max(r, at_least[2]), min_len)
    out: dict[str, np.ndarray] = {}
    for name, x in batch.tensors.items():
        x = _canonical(name, x)
        if name in SEQUENCE:
            mode = "edge" if name == "position_ids" else "constant"
            x = np.concatenate(
                [_pad(x[:, :p], pb - p, 0), _pad(x[:, p:], 0, rb - r, mode=mode)], axis=1
            )
        elif name == "prompts":
            x = _pad(x, pb - p, 0)
        elif x.ndim >= 2 and x.shape[1] == r:
            x = _pad(x, 0, rb - r)
        elif x.ndim >= 2:
            raise ValueError(
                f"batch column {name!r} has shape {x.shape}; the jax_pjit backend pads "
                f"per-sample columns [B], response-aligned columns [B, R={r}] and the "
                f"sequence columns {SEQUENCE}; reshape it or move it to Batch.meta"
            )
        rows = (-max(b, at_least[0])) % rows_multiple + max(0, at_least[0] - b)
        out[name] = np.pad(x, [(0, rows)] + [(0, 0)] * (x.ndim - 1)) if rows else x
    return Padded(out, b, r)


def pack_rows(arrays: dict[str, np.ndarray], shards: int, min_len: int) -> dict[str, np.ndarray]:
    """One padded micro-batch (``B`` rows, a multiple of ``shards``) -> the same columns
    with the sequence columns replaced by ``shards`` packed rows: shard ``j``'s samples
    (rows ``j * B / shards`` onwards) laid end to end without padding, the row length
    padded to a power of two (>= ``min_len``; the longest shard's tokens).

    ``packed_ids`` / ``packed_positions`` [shards, T] (positions as in the batch, i.e.
    restarting per sequence), ``packed_segments`` [shards, T] (k + 1 for the shard's k-th
    sample, 0 = padding), ``packed_index`` [B, R] (where in its shard's row each response
    token is predicted, i.e. the packed ``P - 1 + t``; a real position of the sample for
    padded response columns) and ``packed_last`` [B] (its last real token)."""
    mask = arrays["attention_mask"] != 0
    b, full = mask.shape
    r = arrays["responses"].shape[1]
    per = b // shards
    lengths = mask.sum(1)
    t = packed_len(lengths, shards, min_len)
    ids, positions, segments = (np.zeros((shards, t), np.int32) for _ in range(3))
    index, last = np.zeros((b, r), np.int32), np.zeros(b, np.int32)
    start = 0
    for i in range(b):
        row, k = divmod(i, per)
        start = 0 if k == 0 else start
        n = int(lengths[i])
        span = slice(start, start + n)
        ids[row, span] = arrays["input_ids"][i][mask[i]]
        positions[row, span] = arrays["position_ids"][i][mask[i]]
        segments[row, span] = k + 1
        predicts = start + mask[i, : full - r].sum() - 1 + np.arange(r)
        index[i] = np.clip(predicts, start, max(start, start + n - 1))
        last[i] = max(start, start + n - 1)
        start += n
    out = {k: v for k, v in arrays.items() if k not in SEQUENCE}
    return out | {
        "packed_ids": ids,
        "packed_positions": positions,
        "packed_segments": segments,
        "packed_index": index,
        "packed_last": last,
    }
