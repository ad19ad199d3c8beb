"""The backend-neutral tensor interface: one code path for numpy, torch and jax arrays.

Algorithm code (``polyrl.algos``) asks ``xp = namespace(x)`` for the Array-API namespace
of its inputs (via ``array_api_compat``: ``array_api_compat.numpy``,
``array_api_compat.torch`` or ``jax.numpy``) and then uses only ``xp.*``. This module
adds the few operations the standard lacks and RL needs; every one returns the kind of
array it was given and is differentiable under torch autograd and ``jax.grad``.

This module never imports torch or jax at module level: a framework is imported
lazily, and only once an array of that framework has been handed in (so it is
already loaded).

Shapes: ``[B, T]`` = batch x response tokens, ``[B, T, V]`` adds the vocabulary.
Masks have the shape of the values they mask and may be bool, int or float arrays; a
position counts where ``mask != 0`` and float masks weight the values they select
(``sum(x * mask)``).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device, is_jax_array, is_torch_array

__all__ = [
    "namespace",
    "device_of",
    "to_numpy",
    "asarray_like",
    "where",
    "clip",
    "stop_gradient",
    "logsumexp",
    "log_softmax",
    "log_sigmoid",
    "gather_log_probs",
    "entropy_from_logits",
    "log_probs_and_entropy",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "reverse_linear_scan",
    "shift_left",
]

Array = Any  # numpy.ndarray | torch.Tensor | jax.Array


def namespace(*arrays: Array) -> Any:
    """The Array-API namespace shared by ``arrays`` (``None`` and Python numbers are skipped).

    numpy -> ``array_api_compat.numpy``; torch -> ``array_api_compat.torch``;
    jax -> ``jax.numpy``. Mixing frameworks raises ``TypeError`` (array_api_compat).
    """
    present = [a for a in arrays if a is not None and not isinstance(a, numbers.Number)]
    if not present:
        raise ValueError("namespace() needs at least one array; got only None / Python numbers")
    return array_namespace(*present)


def device_of(x: Array) -> Any:
    """The device ``x`` lives on (``array_api_compat.device``)."""
    return device(x)


def to_numpy(x: Array) -> np.ndarray:
    """A host numpy copy of ``x`` (torch: detached, moved to CPU; jax: device_get).

    For host-side, non-differentiable inputs only (group ids, lengths, scores).
    """
    if is_torch_array(x):
        x = x.detach().cpu()
        try:
            return x.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            return x.float().numpy()
    return np.asarray(x)


def asarray_like(values: Any, like: Array, dtype: Any = None) -> Array:
    """``values`` (numpy / Python) as an array of ``like``'s framework and device.

    ``dtype`` defaults to ``like.dtype``.
    """
    xp = namespace(like)
    return xp.asarray(values, dtype=like.dtype if dtype is None else dtype, device=device(like))


def where(cond: Array, x: Array | float, y: Array | float) -> Array:
    """Element-wise ``x if cond else y`` (``x`` / ``y`` may be Python numbers)."""
    xp = namespace(cond, x, y)
    return xp.where(cond, x, y)


def clip(x: Array, low: float | Array | None = None, high: float | Array | None = None) -> Array:
    """``min(max(x, low), high)``; bounds may be numbers or arrays; ``None`` leaves that
    side open."""
    xp = namespace(x)
    if low is not None:
        x = xp.maximum(x, low) if not isinstance(low, numbers.Number) else xp.clip(x, low, None)
    if high is not None:
        x = xp.minimum(x, high) if not isinstance(high, numbers.Number) else xp.clip(x, None, high)
    return x


def stop_gradient(x: Array) -> Array:
    """``x`` with no gradient flowing back: torch ``detach``, jax ``lax.stop_gradient``,
    numpy identity. Python numbers pass through."""
    if is_torch_array(x):
        return x.detach()
    if is_jax_array(x):
        import jax  # already loaded: x is a jax array

        return jax.lax.stop_gradient(x)
    return x


def logsumexp(x: Array, axis: int = -1, keepdims: bool = False) -> Array:
    """``log(sum(exp(x), axis))``, stable: ``m + log(sum(exp(x - m)))`` with ``m = max(x)``.

    Rows that are all ``-inf`` give ``-inf`` (not NaN). The shift ``m`` is treated as a
    constant for differentiation (the gradient is softmax(x) either way).
    """
    xp = namespace(x)
    m = xp.max(x, axis=axis, keepdims=True)
    m = stop_gradient(xp.where(xp.isfinite(m), m, xp.zeros_like(m)))
    out = xp.log(xp.sum(xp.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else xp.squeeze(out, axis=axis)


def log_softmax(x: Array, axis: int = -1) -> Array:
    """``x - logsumexp(x, axis, keepdims=True)``; torch's own fused kernel for torch
    tensors (one pass forward and one backward over [tokens x vocab], where the
    composite takes about six: the LM head's chunks spend most of their non-GEMM time
    here; XLA fuses the composite itself)."""
    if is_torch_array(x):
        return x.log_softmax(dim=axis)
    return x - logsumexp(x, axis=axis, keepdims=True)


def log_sigmoid(x: Array) -> Array:
    """``log(1 / (1 + exp(-x))) = -softplus(-x) = min(x, 0) - log1p(exp(-|x|))``, stable
    for large ``|x|``."""
    xp = namespace(x)
    return xp.minimum(x, xp.zeros_like(x)) - xp.log1p(xp.exp(-xp.abs(x)))


def _check_ids(logits: Array, ids: Array, who: str) -> None:
    if tuple(logits.shape[:-1]) != tuple(ids.shape):
        raise ValueError(
            f"{who}: logits has shape {tuple(logits.shape)} and ids {tuple(ids.shape)}; "
            "need logits [..., V] and ids [...] with the same leading shape"
        )


def _take(logp: Array, ids: Array) -> Array:
    if is_torch_array(ids):
        # gather (int64 ids only), not take_along_dim: that one broadcasts its operands,
        # which makes torch.compile specialise on every token count (ModelConfig.compile)
        return logp.gather(-1, ids.long()[..., None])[..., 0]
    # jax takes any integer ids (int64 exists only with x64)
    return namespace(logp, ids).take_along_axis(logp, ids[..., None], axis=-1)[..., 0]


def _entropy(logp: Array) -> Array:
    # Entries with p = 0 contribute 0, and no NaN to the gradient (both branches finite).
    xp = namespace(logp)
    p = xp.exp(logp)
    return -xp.sum(p * xp.where(p > 0, logp, xp.zeros_like(logp)), axis=-1)


def gather_log_probs(logits: Array, ids: Array, temperature: float = 1.0) -> Array:
    """Log-probabilities of ``ids`` under ``softmax(logits / temperature)``.

    ``logits`` [B, T, V], ``ids`` [B, T] integer -> [B, T]:
    ``out[b, t] = log_softmax(logits[b, t] / temperature)[ids[b, t]]``.
    """
    _check_ids(logits, ids, "gather_log_probs")
    return _take(log_softmax(logits / temperature, axis=-1), ids)


def entropy_from_logits(logits: Array) -> Array:
    """Entropy of ``softmax(logits)`` along the last axis: [..., V] -> [...].

    ``H = -sum_v p_v log p_v`` with ``log p = log_softmax(logits)`` (stable for large
    logits). Entries with ``p_v = 0`` (``-inf`` logits or underflow) contribute 0, and
    contribute no NaN to the gradient either (both branches of the ``where`` are finite).
    """
    return _entropy(log_softmax(logits, axis=-1))


def log_probs_and_entropy(
    logits: Array, ids: Array, entropy: bool = True
) -> tuple[Array, Array | None]:
    """``(gather_log_probs(logits, ids), entropy_from_logits(logits) or None)`` from one
    ``log_softmax``: what a backend computes per chunk of tokens after its LM head."""
    _check_ids(logits, ids, "log_probs_and_entropy")
    logp = log_softmax(logits, axis=-1)
    return _take(logp, ids), (_entropy(logp) if entropy else None)


def _mask_as(mask: Array, x: Array) -> Array:
    xp = namespace(x, mask)
    if tuple(mask.shape) != tuple(x.shape):
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but the values have shape {tuple(x.shape)}; "
            "they must be equal"
        )
    return xp.astype(mask, x.dtype)


def masked_sum(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """``sum(x * mask, axis)``; values outside the mask (``mask == 0``) are replaced by 0
    first, so a NaN/inf there never leaks into the sum (as verl ``masked_sum``)."""
    xp = namespace(x, mask)
    m = _mask_as(mask, x)
    return xp.sum(xp.where(m != 0, x * m, xp.zeros_like(x)), axis=axis)


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """``sum(x * mask, axis) / sum(mask, axis)``; 0 where the mask sums to 0.

    verl divides by ``sum(mask) + 1e-8``; here the division is exact and an empty mask
    gives 0 (the two differ by < 1e-8 relative elsewhere).
    """
    xp = namespace(x, mask)
    m = _mask_as(mask, x)
    count = xp.sum(m, axis=axis)
    total = masked_sum(x, m, axis=axis)
    return xp.where(count != 0, total / xp.where(count != 0, count, xp.ones_like(count)), 0.0)


def masked_var(x: Array, mask: Array, unbiased: bool = True) -> Array:
    """Variance of the masked entries of ``x`` (all axes): ``mean((x - mean)^2)``, times
    Bessel's ``n / (n - 1)`` when ``unbiased`` (``n = sum(mask)``), as verl ``masked_var``.

    verl raises when ``n <= 1``; this function is traceable under ``jax.jit`` and cannot,
    so ``n <= 1`` gives the biased variance instead (0 for a single entry).
    """
    xp = namespace(x, mask)
    m = _mask_as(mask, x)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = xp.sum(m)
        bessel = xp.where(n > 1, n / xp.where(n > 1, n - 1, xp.ones_like(n)), 1.0)
        var = var * bessel
    return var


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """``(x - mean) / sqrt(var + eps)`` with the masked mean and unbiased masked variance
    (verl ``masked_whiten``); ``shift_mean=False`` adds the mean back afterwards.

    All positions are transformed (masked ones too); callers multiply by the mask if they
    need zeros there. All-equal entries give 0 (``var = 0``), never NaN.
    """
    xp = namespace(x, mask)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) / xp.sqrt(var + eps)
    return out if shift_mean else out + mean


def shift_left(x: Array, fill: float = 0.0) -> Array:
    """``out[..., t] = x[..., t + 1]``, and ``fill`` at the last position: [B, T] -> [B, T]."""
    xp = namespace(x)
    pad = xp.full_like(x[..., :1], fill)
    return xp.concat([x[..., 1:], pad], axis=-1)


def reverse_linear_scan(x: Array, decay: Array | float) -> Array:
    """Right-to-left linear recurrence along the last axis: [B, T] -> [B, T].

    ``y[:, t] = x[:, t] + decay[:, t] * y[:, t + 1]``, with ``y[:, T] = 0``. ``decay`` is a
    [B, T] array or a Python number. With ``decay = gamma`` this is the discounted
    reverse cumulative sum (returns); GAE and masked returns are two such scans
    (see ``polyrl.algos.advantages``). JAX arrays use ``lax.scan`` (immutable arrays,
    jit-friendly); numpy and torch loop over ``T`` and stack.
    """
    xp = namespace(x)
    if isinstance(decay, numbers.Number):
        decay = xp.full_like(x, float(decay))
    elif tuple(decay.shape) != tuple(x.shape):
        raise ValueError(
            f"reverse_linear_scan: decay has shape {tuple(decay.shape)} but x has "
            f"{tuple(x.shape)}; decay must be a number or an array of x's shape"
        )
    if x.ndim != 2:
        raise ValueError(f"reverse_linear_scan: x must be [B, T], got shape {tuple(x.shape)}")
    if is_jax_array(x):
        return _jax_reverse_scan()(x, decay)
    carry = xp.zeros_like(x[:, 0])
    outs = []
    for t in range(x.shape[1] - 1, -1, -1):
        carry = x[:, t] + decay[:, t] * carry
        outs.append(carry)
    if not outs:
        return x
    return xp.stack(outs[::-1], axis=1)


def _scan_step(carry: Array, inputs: tuple[Array, Array]) -> tuple[Array, Array]:
    x_t, d_t = inputs
    y_t = x_t + d_t * carry
    return y_t, y_t


@functools.cache
def _jax_reverse_scan() -> Any:
    """The jitted jax path of :func:`reverse_linear_scan`, built once (a module-level step
    function and one ``jax.jit`` object, so repeated calls hit the compilation cache)."""
    import jax  # already loaded: only called with jax arrays

    def scan(x: Array, decay: Array) -> Array:
        init = jax.numpy.zeros_like(x[:, 0])
        _, ys = jax.lax.scan(_scan_step, init, (x.T, decay.T), reverse=True)
        return ys.T

    return jax.jit(scan)
